"""The parser chain of one response: reasoning, then tool calls, then plain text.

The reasoning parser sees the raw decoded output; its answer text goes on to the
tool-call parser; reasoning segments pass straight through. Order is kept: where
reasoning interrupts the answer, the tool parser first releases what it holds, so
no held text is overtaken and no call is ever stitched together across reasoning.
"""

from __future__ import annotations

from resq.postprocess.parsers.hermes import HermesToolParser
from resq.postprocess.parsers.reasoning import ReasoningParser, Span
from resq.postprocess.segments import Segment, TextSegment


class ParserChain:
    """Reasoning parser -> tool parser -> text; either stage may be absent."""

    def __init__(
        self, reasoning: ReasoningParser | None = None, tools: HermesToolParser | None = None
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def tracks_reasoning(self) -> bool:
        """Whether reasoning can occur (then the processor counts reasoning tokens)."""
        return self.reasoning is not None

    @property
    def resolved(self) -> int:
        """How many characters of the output the reasoning stage has classified."""
        return self.reasoning.resolved if self.reasoning is not None else 0

    def take_reasoning_spans(self) -> list[Span]:
        """Character ranges of the output found to be reasoning since the last call."""
        return self.reasoning.take_reasoning_spans() if self.reasoning is not None else []

    def feed(self, text: str) -> list[Segment]:
        """Segments that ``text`` (the next chunk of decoded output) completes."""
        if self.reasoning is None:
            return self._answer([TextSegment(text)] if text else [])
        return self._answer(self.reasoning.feed(text))

    def finish(self) -> list[Segment]:
        """Everything still held back, by every stage, at the end of the output."""
        out = self._answer(self.reasoning.finish()) if self.reasoning is not None else []
        if self.tools is not None:
            out += self.tools.finish()
        return out

    def _answer(self, segments: list[Segment]) -> list[Segment]:
        """Route the reasoning stage's output through the tool stage."""
        if self.tools is None:
            return segments
        out: list[Segment] = []
        for segment in segments:
            if isinstance(segment, TextSegment):
                out += self.tools.feed(segment.text)
            else:
                out += self.tools.finish()
                out.append(segment)
        return out
