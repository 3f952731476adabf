"""Output assembly: segments in, output items and their events out.

One object per response keeps the small state the OpenAI event order needs: the
items so far and the one item still open. Whatever the chunking of the input,
the same segments give the same items and events, the deltas of an item
concatenate to its ``.done`` text, and the final Response lists exactly the
items (same ids, same text) that were streamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from resq import ids
from resq.events import builders as build
from resq.events.builders import Event, ItemStatus
from resq.postprocess.segments import (
    CustomToolCallSegment,
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


class OutputAssembler:
    """Builds the output items of one response from parser segments."""

    def __init__(self, response_id: str) -> None:
        self._response_id = response_id
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
        if isinstance(segment, CustomToolCallSegment):
            return self._custom_tool_call(segment)
        return self._function_call(segment)

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
        return [
            build.output_item_added(index, build.reasoning_item(item_id, "in_progress")),
            build.content_part_added(item_id, index, 0, build.reasoning_text_part("")),
        ]

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
            done_item = build.reasoning_item(item.item_id, status, [part])
            events = [
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
        done_item = build.function_call_item(item_id, call_id, call.name, call.arguments, "completed")
        self.items.append(done_item)
        return [
            *events,
            build.output_item_added(
                index, build.function_call_item(item_id, call_id, call.name, "", "in_progress")
            ),
            build.function_call_arguments_delta(item_id, index, call.arguments),
            build.function_call_arguments_done(item_id, index, call.name, call.arguments),
            build.output_item_done(index, done_item),
        ]

    def _custom_tool_call(self, call: CustomToolCallSegment) -> list[Event]:
        events, index, item_id, call_id = self._start_call("ctc")
        done_item = build.custom_tool_call_item(item_id, call_id, call.name, call.input, "completed")
        self.items.append(done_item)
        return [
            *events,
            build.output_item_added(
                index, build.custom_tool_call_item(item_id, call_id, call.name, "", "in_progress")
            ),
            build.custom_tool_call_input_delta(item_id, index, call.input),
            build.custom_tool_call_input_done(item_id, index, call.input),
            build.output_item_done(index, done_item),
        ]
