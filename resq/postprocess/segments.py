"""What output parsers produce: typed pieces of the assistant's answer, in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TextSegment:
    """Visible answer text (goes into a ``message`` item)."""

    text: str
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReasoningSegment:
    """Reasoning text (goes into a ``reasoning`` item)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallSegment:
    """One complete, valid function call; ``arguments`` is a JSON object as text."""

    name: str
    arguments: str


Segment = TextSegment | ReasoningSegment | ToolCallSegment
