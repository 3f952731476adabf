"""Output parsers: decoded text in, typed segments (text, reasoning, tool calls) out.

The formats are one table (:data:`REASONING_FORMATS`, :data:`TOOL_CALL_FORMATS`), one row per
model family, as vLLM's parser managers: a new reasoning or tool-call format is one parser
module and one row; settings, grammars, ``tool_choice`` prefills and the chain read the rows.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from resq.grammars import CallEnvelope, ReasoningMarkup
from resq.options import ProcessingOptions
from resq.postprocess.parsers.chain import ParserChain, ToolCallParser
from resq.postprocess.parsers.hermes import CALL_CLOSE, CALL_OPEN, HermesToolParser, forced_call_opening
from resq.postprocess.parsers.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningParser, ReasoningTokenCounter
from resq.postprocess.segments import Segment, TextSegment

__all__ = [
    "REASONING_FORMATS",
    "REASONING_PARSERS",
    "TOOL_CALL_FORMATS",
    "TOOL_PARSERS",
    "HermesToolParser",
    "OutputParser",
    "ParserChain",
    "PlainTextParser",
    "ReasoningFormat",
    "ReasoningParser",
    "ReasoningTokenCounter",
    "ToolCallFormat",
    "ToolCallParser",
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


@dataclass(frozen=True)
class ReasoningFormat:
    """One model family's reasoning markup: its parser and how grammars see it."""

    make: Callable[[bool], ReasoningParser]
    """The parser, given whether a grammar constrains the answer (then reasoning comes first only)."""
    markup: ReasoningMarkup


@dataclass(frozen=True)
class ToolCallFormat:
    """One model family's tool-call markup: its parser, its envelope, and how a forced call opens."""

    make: Callable[[frozenset[str], bool], ToolCallParser]
    """The parser, given the custom tools called in the raw-input form and whether a grammar
    constrains the calls (then their JSON is well-formed)."""
    envelope: CallEnvelope
    forced_opening: Callable[[str | None], str]
    """The text a call (of that function, or of any) starts with, for ``tool_choice``."""


# --- the registry: one row per model family (a new format is one parser module and one row) ----

REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat(
        make=lambda constrained: ReasoningParser(starts_in_reasoning=False, reasoning_first_only=constrained),
        markup=ReasoningMarkup(THINK_OPEN, THINK_CLOSE, starts_inside=False),
    ),
    # The chat template opens <think> itself: generation starts inside reasoning.
    "deepseek_r1": ReasoningFormat(
        make=lambda constrained: ReasoningParser(starts_in_reasoning=True, reasoning_first_only=constrained),
        markup=ReasoningMarkup(THINK_OPEN, THINK_CLOSE, starts_inside=True),
    ),
}
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(
        make=lambda raw_input_tools, constrained: HermesToolParser(
            raw_input_tools=raw_input_tools, well_formed_json=constrained
        ),
        envelope=CallEnvelope(CALL_OPEN, CALL_CLOSE),
        forced_opening=forced_call_opening,
    ),
}

REASONING_PARSERS: tuple[str, ...] = tuple(REASONING_FORMATS)
TOOL_PARSERS: tuple[str, ...] = tuple(TOOL_CALL_FORMATS)


def reasoning_format(name: str) -> ReasoningFormat:
    """The row of reasoning parser ``name``."""
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise UnknownParserError(f"unknown reasoning parser {name!r}") from None


def tool_call_format(name: str) -> ToolCallFormat:
    """The row of tool parser ``name``."""
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        raise UnknownParserError(f"unknown tool parser {name!r}") from None


def make_parser(options: ProcessingOptions) -> ParserChain:
    """The parser chain for a response (names are checked even when a stage stays off)."""
    reasoning_row = reasoning_format(options.reasoning_parser) if options.reasoning_parser else None
    tool_row = tool_call_format(options.tool_parser) if options.tool_parser else None
    reasoning = reasoning_row.make(options.answer_constrained) if reasoning_row is not None else None
    tools = None
    if tool_row is not None and options.tools_enabled:
        tools = tool_row.make(frozenset(options.raw_input_tools), options.answer_constrained)
    return ParserChain(
        reasoning,
        tools,
        max_calls=options.max_function_calls if tools else None,
        custom_tools=frozenset(options.custom_tools),
    )


def call_end_tag(tool_parser: str) -> str:
    """The text that ends a call in the format of ``tool_parser`` (a per-request stop point)."""
    return tool_call_format(tool_parser).envelope.close_tag


def forced_call_prefix(reasoning_parser: str | None, tool_parser: str, function_name: str | None) -> str:
    """The text an answer must start with to be a call (of ``function_name``, or of any function).

    Where generation starts inside reasoning (the template opened it), the reasoning is
    closed first: a call is answer text.
    """
    row = tool_call_format(tool_parser)
    markup = reasoning_format(reasoning_parser).markup if reasoning_parser is not None else None
    close_reasoning = markup.close_tag + "\n\n" if markup is not None and markup.starts_inside else ""
    return close_reasoning + row.forced_opening(function_name)


def reasoning_markup(reasoning_parser: str) -> ReasoningMarkup:
    """How ``reasoning_parser``'s format delimits reasoning, for answer grammars."""
    return reasoning_format(reasoning_parser).markup


def call_envelope(tool_parser: str) -> CallEnvelope:
    """How ``tool_parser``'s format wraps one call, for answer grammars."""
    return tool_call_format(tool_parser).envelope
