"""Output assembly: segments in, output items and their events out.

One object per response keeps the small state the OpenAI event order needs: the
items so far and the one item still open. Whatever the chunking of the input,
the same segments give the same items and events, the deltas of an item
concatenate to its ``.done`` text, and the final Response lists exactly the
items (same ids, same text) that were streamed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from resq import ids
from resq.conversation import split_tool_name
from resq.events import builders as build
from resq.events import types
from resq.events.builders import Event, ItemStatus
from resq.postprocess.segments import (
    CustomToolCallSegment,
    ReasoningEnd,
    ReasoningSegment,
    Segment,
    TextSegment,
    ToolCallSegment,
)

OpenKind = Literal["message", "reasoning"]


@dataclass
class _OpenItem:
    kind: OpenKind
    item_id: str
    output_index: int
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass(frozen=True)
class ReasoningOutput:
    """How reasoning items are shown: with the summary mirrored, with a sealed copy."""

    summary: bool = False
    """Mirror the reasoning into ``summary`` (and its summary events): there is no summarizer,
    so the summary of the whole reasoning is the reasoning itself."""
    seal: Callable[[str], str] | None = None
    """Seals a reasoning text into ``encrypted_content``; None: no ``encrypted_content``."""


class OutputAssembler:
    """Builds the output items of one response from parser segments."""

    def __init__(self, response_id: str, reasoning: ReasoningOutput | None = None) -> None:
        self._response_id = response_id
        self._reasoning = reasoning or ReasoningOutput()
        self.items: list[dict[str, Any]] = []
        """Closed output items, in ``output_index`` order (the final Response's ``output``)."""
        self._open: _OpenItem | None = None
        self.function_calls = 0

    def add(self, segment: Segment) -> list[Event]:
        """The events ``segment`` causes (may open or close items)."""
        if isinstance(segment, TextSegment):
            return self._append_text("message", segment.text, segment.logprobs)
        if isinstance(segment, ReasoningSegment):
            return self._append_text("reasoning", segment.text, [])
        if isinstance(segment, ReasoningEnd):
            open_item = self._open
            return (
                self._close_open("completed")
                if open_item is not None and open_item.kind == "reasoning"
                else []
            )
        if isinstance(segment, CustomToolCallSegment):
            return self._custom_tool_call(segment)
        return self._function_call(segment)

    def add_finished(self, item: dict[str, Any]) -> list[Event]:
        """An item made before generation (a compaction), added and done at once at the next index."""
        index = self._next_index()
        self.items.append(item)
        return [build.output_item_added(index, item), build.output_item_done(index, item)]

    def close(self, status: ItemStatus) -> list[Event]:
        """Close the open item, if any, with ``status`` (end of generation)."""
        if self._open is None:
            return []
        return self._close_open(status)

    # --- internals -----------------------------------------------------------------------------

    def _next_index(self) -> int:
        return len(self.items)

    def _append_text(self, kind: OpenKind, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        if self._open is not None and self._open.kind != kind:
            events += self._close_open("completed")
        if self._open is None:
            events += self._open_item(kind)
        item = self._open
        assert item is not None
        item.text_parts.append(text)
        item.logprobs.extend(logprobs)
        if kind == "message":
            events.append(build.output_text_delta(item.item_id, item.output_index, 0, text, logprobs))
        else:
            if self._reasoning.summary:
                events.append(build.reasoning_summary_text_delta(item.item_id, item.output_index, 0, text))
            events.append(build.reasoning_text_delta(item.item_id, item.output_index, 0, text))
        return events

    def _open_item(self, kind: OpenKind) -> list[Event]:
        index = self._next_index()
        if kind == "message":
            item_id = ids.item_id("msg", self._response_id, index)
            self._open = _OpenItem(kind, item_id, index)
            return [
                build.output_item_added(index, build.message_item(item_id, "in_progress")),
                build.content_part_added(item_id, index, 0, build.output_text_part("")),
            ]
        item_id = ids.item_id("rs", self._response_id, index)
        self._open = _OpenItem(kind, item_id, index)
        events = [build.output_item_added(index, build.reasoning_item(item_id, "in_progress"))]
        if self._reasoning.summary:
            events.append(
                build.reasoning_summary_part(
                    types.REASONING_SUMMARY_PART_ADDED, item_id, index, 0, build.summary_text_part("")
                )
            )
        events.append(build.content_part_added(item_id, index, 0, build.reasoning_text_part("")))
        return events

    def _close_open(self, status: ItemStatus) -> list[Event]:
        item = self._open
        assert item is not None
        self._open = None
        text = item.text
        if item.kind == "message":
            part = build.output_text_part(text, item.logprobs)
            done_item = build.message_item(item.item_id, status, [part])
            events = [
                build.output_text_done(item.item_id, item.output_index, 0, text, item.logprobs),
                build.content_part_done(item.item_id, item.output_index, 0, part),
            ]
        else:
            part = build.reasoning_text_part(text)
            summary = [build.summary_text_part(text)] if self._reasoning.summary else []
            sealed = self._reasoning.seal(text) if self._reasoning.seal is not None else None
            done_item = build.reasoning_item(item.item_id, status, [part], summary, sealed)
            events = []
            if summary:
                events += [
                    build.reasoning_summary_text_done(item.item_id, item.output_index, 0, text),
                    build.reasoning_summary_part(
                        types.REASONING_SUMMARY_PART_DONE, item.item_id, item.output_index, 0, summary[0]
                    ),
                ]
            events += [
                build.reasoning_text_done(item.item_id, item.output_index, 0, text),
                build.content_part_done(item.item_id, item.output_index, 0, part),
            ]
        self.items.append(done_item)
        events.append(build.output_item_done(item.output_index, done_item))
        return events

    def _start_call(self, prefix: str) -> tuple[list[Event], int, str, str]:
        """Close the open item and number a call item: (events so far, index, item id, call id)."""
        events = self._close_open("completed") if self._open is not None else []
        index = self._next_index()
        self.function_calls += 1
        return (
            events,
            index,
            ids.item_id(prefix, self._response_id, index),
            ids.item_id("call", self._response_id, index),
        )

    def _function_call(self, call: ToolCallSegment) -> list[Event]:
        events, index, item_id, call_id = self._start_call("fc")
        namespace, name = split_tool_name(call.name)
        done_item = build.function_call_item(item_id, call_id, name, call.arguments, "completed", namespace)
        self.items.append(done_item)
        return [
            *events,
            build.output_item_added(
                index, build.function_call_item(item_id, call_id, name, "", "in_progress", namespace)
            ),
            build.function_call_arguments_delta(item_id, index, call.arguments),
            build.function_call_arguments_done(item_id, index, name, call.arguments),
            build.output_item_done(index, done_item),
        ]

    def _custom_tool_call(self, call: CustomToolCallSegment) -> list[Event]:
        events, index, item_id, call_id = self._start_call("ctc")
        namespace, name = split_tool_name(call.name)
        done_item = build.custom_tool_call_item(item_id, call_id, name, call.input, "completed", namespace)
        self.items.append(done_item)
        return [
            *events,
            build.output_item_added(
                index, build.custom_tool_call_item(item_id, call_id, name, "", "in_progress", namespace)
            ),
            build.custom_tool_call_input_delta(item_id, index, call.input),
            build.custom_tool_call_input_done(item_id, index, call.input),
            build.output_item_done(index, done_item),
        ]
