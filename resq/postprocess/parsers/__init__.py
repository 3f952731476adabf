"""Output parsers: decoded text in, typed segments (text, reasoning, tool calls) out.

A parser sees the answer as a sequence of text chunks of any size and must give
the same segments whatever the chunking. Parsers are chosen per response from
:class:`resq.options.ProcessingOptions` and chained by :func:`make_parser`:
reasoning (``reasoning_parser``) -> tool calls (``tool_parser``, only when
``tools_enabled``; otherwise tool-call markup stays plain text) -> text.

- ``qwen3`` / ``deepseek_r1``: ``<think>...</think>`` (:mod:`.reasoning`); they differ
  only in whether generation starts inside reasoning (the template opened ``<think>``).
- ``hermes``: ``<tool_call>{json}</tool_call>`` (:mod:`.hermes`).
"""

from __future__ import annotations

from typing import Protocol

from resq.grammars import CallEnvelope, ReasoningMarkup
from resq.options import ProcessingOptions
from resq.postprocess.parsers.chain import ParserChain
from resq.postprocess.parsers.hermes import CALL_CLOSE, CALL_OPEN, HermesToolParser, forced_call_opening
from resq.postprocess.parsers.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningParser, ReasoningTokenCounter
from resq.postprocess.segments import Segment, TextSegment

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "HermesToolParser",
    "OutputParser",
    "ParserChain",
    "PlainTextParser",
    "ReasoningParser",
    "ReasoningTokenCounter",
    "UnknownParserError",
    "call_end_tag",
    "call_envelope",
    "forced_call_prefix",
    "make_parser",
    "reasoning_markup",
]


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


# Name -> whether generation starts inside reasoning (the chat template ends with <think>).
_STARTS_IN_REASONING: dict[str, bool] = {"qwen3": False, "deepseek_r1": True}

REASONING_PARSERS: tuple[str, ...] = tuple(_STARTS_IN_REASONING)
TOOL_PARSERS: tuple[str, ...] = ("hermes",)


def make_parser(options: ProcessingOptions) -> ParserChain:
    """The parser chain for a response (names are checked even when a stage stays off)."""
    if options.reasoning_parser is not None and options.reasoning_parser not in REASONING_PARSERS:
        raise UnknownParserError(f"unknown reasoning parser {options.reasoning_parser!r}")
    if options.tool_parser is not None and options.tool_parser not in TOOL_PARSERS:
        raise UnknownParserError(f"unknown tool parser {options.tool_parser!r}")
    reasoning = None
    if options.reasoning_parser is not None:
        reasoning = ReasoningParser(starts_in_reasoning=_STARTS_IN_REASONING[options.reasoning_parser])
    tools = None
    if options.tool_parser is not None and options.tools_enabled:
        tools = HermesToolParser(raw_input_tools=frozenset(options.raw_input_tools))
    return ParserChain(
        reasoning,
        tools,
        max_calls=options.max_function_calls if tools else None,
        custom_tools=frozenset(options.custom_tools),
    )


def call_end_tag(tool_parser: str) -> str:
    """The text that ends a call in the format of ``tool_parser`` (a per-request stop point)."""
    if tool_parser not in TOOL_PARSERS:
        raise UnknownParserError(f"unknown tool parser {tool_parser!r}")
    return CALL_CLOSE


def forced_call_prefix(reasoning_parser: str | None, tool_parser: str, function_name: str | None) -> str:
    """The text an answer must start with to be a call (of ``function_name``, or of any function).

    Where generation starts inside reasoning (the template opened ``<think>``), the
    reasoning is closed first: a call is answer text.
    """
    if tool_parser not in TOOL_PARSERS:
        raise UnknownParserError(f"unknown tool parser {tool_parser!r}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise UnknownParserError(f"unknown reasoning parser {reasoning_parser!r}")
    close_reasoning = THINK_CLOSE + "\n\n" if _STARTS_IN_REASONING.get(reasoning_parser or "") else ""
    return close_reasoning + forced_call_opening(function_name)


def reasoning_markup(reasoning_parser: str) -> ReasoningMarkup:
    """How ``reasoning_parser``'s format delimits reasoning, for answer grammars."""
    if reasoning_parser not in REASONING_PARSERS:
        raise UnknownParserError(f"unknown reasoning parser {reasoning_parser!r}")
    return ReasoningMarkup(THINK_OPEN, THINK_CLOSE, starts_inside=_STARTS_IN_REASONING[reasoning_parser])


def call_envelope(tool_parser: str) -> CallEnvelope:
    """How ``tool_parser``'s format wraps one call, for answer grammars."""
    if tool_parser not in TOOL_PARSERS:
        raise UnknownParserError(f"unknown tool parser {tool_parser!r}")
    return CallEnvelope(CALL_OPEN, CALL_CLOSE)
