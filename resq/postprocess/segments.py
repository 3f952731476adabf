"""What output parsers produce: typed pieces of the assistant's answer, in order."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import groupby
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
class ReasoningEnd:
    """A reasoning block closed (its closing tag was generated): its item is complete, whatever
    comes next. Without it the item stayed open until answer text arrived, so a limit that cut
    the whitespace after ``</think>`` closed whole reasoning as ``incomplete``."""


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


Segment = TextSegment | ReasoningSegment | ReasoningEnd | ToolCallSegment | CustomToolCallSegment


def joined(segments: Iterable[Segment]) -> list[Segment]:
    """``segments`` with each run of consecutive text (or reasoning) segments joined into one.

    The processor walks a reasoning or logprobs answer one token at a time, which yields a
    segment per token: joined, one token-stream entry (a stream interval's tokens) makes one
    delta per item it touches instead of one per token. Text keeps its first segment's
    ``start`` and all the logprobs in order; calls are never joined.
    """
    out: list[Segment] = []
    # Runs of one joinable kind share a key; every call is a key of its own.
    for _, group in groupby(
        segments, key=lambda s: type(s) if isinstance(s, TextSegment | ReasoningSegment) else id(s)
    ):
        run = list(group)
        first = run[0]
        if len(run) == 1:
            out.append(first)
        elif isinstance(first, TextSegment):
            texts = [s for s in run if isinstance(s, TextSegment)]
            logprobs = [entry for s in texts for entry in s.logprobs]
            out.append(TextSegment("".join(s.text for s in texts), logprobs, first.start))
        else:
            out.append(ReasoningSegment("".join(s.text for s in run if isinstance(s, ReasoningSegment))))
    return out
