"""What output parsers produce: typed pieces of the assistant's answer, in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TextSegment:
    """Visible answer text (goes into a ``message`` item).

    ``start`` says where ``text`` was found: the offset of its first character in
    the text the emitting stage was fed (for the parser chain's output: in the
    decoded output). Every text segment is one contiguous slice of that input,
    so the processor can tell which tokens it came from (for logprobs). It takes
    no part in comparisons: two segments with the same text are the same text.
    """

    text: str
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    start: int = field(default=-1, compare=False)


@dataclass(frozen=True, slots=True)
class ReasoningSegment:
    """Reasoning text (goes into a ``reasoning`` item)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallSegment:
    """One complete, valid function call; ``arguments`` is a JSON object as text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class CustomToolCallSegment:
    """One complete call of a custom tool; ``input`` is its text."""

    name: str
    input: str


Segment = TextSegment | ReasoningSegment | ToolCallSegment | CustomToolCallSegment
