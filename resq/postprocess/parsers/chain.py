"""The parser chain of one response: reasoning, then tool calls, then plain text.

The reasoning parser sees the raw decoded output; its answer text goes on to the
tool-call parser; reasoning segments pass straight through. Order is kept: where
reasoning interrupts the answer, the tool parser first releases what it holds, so
no held text is overtaken and no call is ever stitched together across reasoning.

Every text segment the chain returns says where it lies in the decoded output
(``TextSegment.start``), so that the processor can hand it the logprobs of the
tokens it came from. The tool parser only knows offsets in the answer text it was
fed; the chain maps them back, and where answer text that is one run for the tool
parser was not contiguous in the output (a stray ``</think>`` dropped in between),
it returns one segment per contiguous slice.

With a call limit (``parallel_tool_calls: false``) the answer ends with the last
call allowed: everything after it is dropped, as if generation had stopped there.

A call of a custom tool (``custom_tools``) becomes a :class:`CustomToolCallSegment`:
the chat template showed the tool as a function with one string parameter, so its
input is the ``input`` argument; arguments without a string ``input`` (the model wrote
something else) are the input as the JSON text they are.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Protocol

from resq.conversation import CUSTOM_INPUT
from resq.postprocess.parsers.reasoning import ReasoningParser, Span
from resq.postprocess.segments import CustomToolCallSegment, Segment, TextSegment, ToolCallSegment


class ToolCallParser(Protocol):
    """Incremental parser of one tool-call format: answer text in, text and call segments out."""

    def feed(self, text: str) -> list[Segment]:
        """Segments that ``text`` (the next chunk of answer text) completes."""
        ...

    def finish(self) -> list[Segment]:
        """Segments still held back when the answer ends."""
        ...


def custom_call(call: ToolCallSegment) -> CustomToolCallSegment:
    """``call`` (of a custom tool) with its text as the input."""
    arguments = json.loads(call.arguments)  # the tool parser only emits valid JSON objects
    text = arguments.get(CUSTOM_INPUT)
    return CustomToolCallSegment(call.name, text if isinstance(text, str) else call.arguments)


class ParserChain:
    """Reasoning parser -> tool parser -> text; either stage may be absent."""

    def __init__(
        self,
        reasoning: ReasoningParser | None = None,
        tools: ToolCallParser | None = None,
        max_calls: int | None = None,
        custom_tools: frozenset[str] = frozenset(),
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls
        self.custom_tools = custom_tools
        self._fed = 0
        """Characters of output fed so far."""
        self._answer_fed = 0
        """Characters of answer text handed to the tool parser so far."""
        self._answer_pieces: deque[tuple[int, int, int]] = deque()
        """(offset in the answer text, offset in the output, length) of each piece handed on."""
        self._calls = 0

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
        start = self._fed
        self._fed += len(text)
        if self.reasoning is None:
            return self._limit(self._answer([TextSegment(text, start=start)] if text else []))
        return self._limit(self._answer(self.reasoning.feed(text)))

    def finish(self) -> list[Segment]:
        """Everything still held back, by every stage, at the end of the output."""
        out = self._answer(self.reasoning.finish()) if self.reasoning is not None else []
        if self.tools is not None:
            out += self._from_tools(self.tools.finish())
        return self._limit(out)

    # --- internals -----------------------------------------------------------------------------

    def _answer(self, segments: list[Segment]) -> list[Segment]:
        """Route the reasoning stage's output through the tool stage."""
        if self.tools is None:
            return segments
        out: list[Segment] = []
        for segment in segments:
            if isinstance(segment, TextSegment):
                self._answer_pieces.append((self._answer_fed, segment.start, len(segment.text)))
                self._answer_fed += len(segment.text)
                out += self._from_tools(self.tools.feed(segment.text))
            else:
                out += self._from_tools(self.tools.finish())
                out.append(segment)
        return out

    def _from_tools(self, segments: list[Segment]) -> list[Segment]:
        out: list[Segment] = []
        for segment in segments:
            if isinstance(segment, TextSegment):
                out += self._place(segment)
            elif isinstance(segment, ToolCallSegment) and segment.name in self.custom_tools:
                out.append(custom_call(segment))
            else:
                out.append(segment)
        return out

    def _place(self, segment: TextSegment) -> list[TextSegment]:
        """``segment`` (answer-text offsets) as slices with output offsets, one per contiguous run."""
        placed: list[TextSegment] = []
        position = segment.start
        text = segment.text
        while text:
            # The tool parser releases text in order: pieces wholly before it are done with.
            while self._answer_pieces[0][0] + self._answer_pieces[0][2] <= position:
                self._answer_pieces.popleft()
            answer_start, output_start, length = self._answer_pieces[0]
            offset = position - answer_start
            size = min(len(text), length - offset)
            start = output_start + offset
            if placed and placed[-1].start + len(placed[-1].text) == start:
                placed[-1] = TextSegment(placed[-1].text + text[:size], start=placed[-1].start)
            else:
                placed.append(TextSegment(text[:size], start=start))
            text = text[size:]
            position += size
        return placed

    def _limit(self, segments: list[Segment]) -> list[Segment]:
        """Drop everything after the last call allowed."""
        if self.max_calls is None:
            return segments
        out: list[Segment] = []
        for segment in segments:
            if self._calls >= self.max_calls:
                break
            out.append(segment)
            if isinstance(segment, ToolCallSegment | CustomToolCallSegment):
                self._calls += 1
        return out
