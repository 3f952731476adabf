"""Output parsers: decoded text in, typed segments (text, reasoning, tool calls) out.

A parser sees the answer as a sequence of text chunks of any size and must give
the same segments whatever the chunking. Parsers are chosen per response from
:class:`resq.options.ProcessingOptions`.
"""

from __future__ import annotations

from typing import Protocol

from resq.options import ProcessingOptions
from resq.postprocess.segments import Segment, TextSegment


class OutputParser(Protocol):
    """Incremental parser of the decoded answer."""

    def feed(self, text: str) -> list[Segment]:
        """Segments that ``text`` (the next chunk) completes."""
        ...

    def finish(self) -> list[Segment]:
        """Segments still held back when generation ends."""
        ...


class PlainTextParser:
    """Everything is answer text."""

    def feed(self, text: str) -> list[Segment]:
        """The chunk as one text segment."""
        return [TextSegment(text)] if text else []

    def finish(self) -> list[Segment]:
        """Nothing is ever held back."""
        return []


class UnknownParserError(ValueError):
    """A parser name that resq does not know."""


REASONING_PARSERS: tuple[str, ...] = ()
TOOL_PARSERS: tuple[str, ...] = ()


def make_parser(options: ProcessingOptions) -> OutputParser:
    """The parser chain for a response."""
    if options.reasoning_parser is not None and options.reasoning_parser not in REASONING_PARSERS:
        raise UnknownParserError(f"unknown reasoning parser {options.reasoning_parser!r}")
    if options.tool_parser is not None and options.tool_parser not in TOOL_PARSERS:
        raise UnknownParserError(f"unknown tool parser {options.tool_parser!r}")
    return PlainTextParser()
