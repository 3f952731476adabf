"""The invariants every streamed response must keep, checked on event dicts.

Used on every streamed end-to-end test and in the processor's unit tests, so
"the stream is well-formed" means the same thing everywhere.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tests.support.conformance import check_events

TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
CONTENT_EVENTS = {
    "response.content_part.added",
    "response.content_part.done",
    "response.output_text.delta",
    "response.output_text.done",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
}


def as_dict(event: Any) -> dict[str, Any]:
    """An SDK event (pydantic) or a dict, as a plain dict."""
    if isinstance(event, dict):
        return event
    dumped: dict[str, Any] = event.model_dump(mode="json")
    return dumped


def item_text(item: dict[str, Any]) -> str:
    """The text of an output item (message text, reasoning text, call arguments)."""
    if item["type"] == "function_call":
        return str(item["arguments"])
    return "".join(part.get("text", "") for part in item.get("content") or [])


def check_stream(
    events: list[Any], *, background: bool = False, first_sequence_number: int = 0
) -> dict[str, Any]:
    """Assert the stream invariants; return the final Response (from the terminal event) as a dict."""
    check_events(events)  # Open Responses conformance of every event and of the Responses they carry
    dicts = [as_dict(event) for event in events]
    assert dicts, "empty stream"
    types = [event["type"] for event in dicts]
    numbers = [event["sequence_number"] for event in dicts]
    assert numbers[0] == first_sequence_number, numbers
    for previous, (number, kind) in zip(numbers, zip(numbers[1:], types[1:], strict=True), strict=False):
        # Numbers are consecutive, except where the API merged a run of deltas a slow client fell
        # behind on (RESQ_SSE_COALESCE_AFTER): the merged delta carries the run's last number. The
        # text checks below still see every token once.
        assert number == previous + 1 or (number > previous and kind.endswith(".delta")), numbers

    if first_sequence_number == 0 and not background:
        # A foreground response is in progress from its creation: the API logs both at once.
        assert types[:2] == ["response.created", "response.in_progress"], types[:3]
    elif first_sequence_number == 0:
        expected_head = ["response.created", "response.queued"]
        assert types[:2] == expected_head, types[:3]
        # Only a background response that ends before generation starts (cancelled while queued,
        # or failed because no GPU worker took it) has no `response.in_progress`: then nothing but
        # its terminal event follows the head. Every other stream, whatever its end, has it next.
        never_started = types[-1] in ("response.incomplete", "response.failed") and len(types) == 3
        if not never_started:
            assert types[2] == "response.in_progress", types[:4]

    terminal_positions = [index for index, kind in enumerate(types) if kind in TERMINAL]
    assert terminal_positions == [len(types) - 1], f"terminal events at {terminal_positions} of {len(types)}"
    final = dicts[-1]["response"]

    added: dict[int, dict[str, Any]] = {}
    done: dict[int, dict[str, Any]] = {}
    deltas: dict[int, list[str]] = defaultdict(list)
    done_texts: dict[int, str] = {}
    parts_open: set[tuple[int, int]] = set()
    for event in dicts:
        kind = event["type"]
        if kind == "response.output_item.added":
            index = event["output_index"]
            assert index not in added, f"output_index {index} reused"
            assert index == len(added), f"output_index {index} out of order"
            added[index] = event["item"]
        elif kind == "response.output_item.done":
            index = event["output_index"]
            assert index in added and index not in done, f"item done without added / twice at {index}"
            assert event["item"]["id"] == added[index]["id"], "item id changed between added and done"
            assert not any(key[0] == index for key in parts_open), "item done while a part is open"
            done[index] = event["item"]
        elif kind in CONTENT_EVENTS:
            index = event["output_index"]
            assert index in added and index not in done, f"{kind} outside its item's lifetime"
            assert event["item_id"] == added[index]["id"], f"{kind} names another item"
            if kind == "response.content_part.added":
                key = (index, event["content_index"])
                assert key not in parts_open
                parts_open.add(key)
            elif kind == "response.content_part.done":
                key = (index, event["content_index"])
                assert key in parts_open, "part done without added"
                parts_open.remove(key)
            elif kind.endswith(".delta"):
                deltas[index].append(event["delta"])
            elif kind.endswith("arguments.done"):
                done_texts[index] = event["arguments"]
            else:
                done_texts[index] = event["text"]
    assert set(added) == set(done), f"items added {sorted(added)} but done {sorted(done)}"
    _check_summaries(dicts, added, done)

    for index, texts in deltas.items():
        assert "".join(texts) == done_texts[index], f"deltas of item {index} do not add up to its done text"
    output = final["output"]
    assert [item["id"] for item in output] == [done[index]["id"] for index in sorted(done)], "item ids differ"
    for index, item in enumerate(output):
        assert item == done[index], f"final item {index} differs from its output_item.done"
        if index in done_texts:
            assert item_text(item) == done_texts[index]
    return dict(final)


def _check_summaries(
    dicts: list[dict[str, Any]], added: dict[int, dict[str, Any]], done: dict[int, dict[str, Any]]
) -> None:
    """Reasoning summary parts open and close inside their item, and their deltas add up to the summary."""
    open_parts: set[tuple[int, int]] = set()
    deltas: dict[tuple[int, int], list[str]] = defaultdict(list)
    texts: dict[tuple[int, int], str] = {}
    closed: set[tuple[int, int]] = set()
    for event in dicts:
        kind = event["type"]
        if not kind.startswith("response.reasoning_summary_"):
            continue
        key = (event["output_index"], event["summary_index"])
        assert event["item_id"] == added[key[0]]["id"], f"{kind} names another item"
        if kind == "response.reasoning_summary_part.added":
            assert key not in open_parts and key not in closed, f"summary part {key} added twice"
            open_parts.add(key)
            continue
        assert key in open_parts, f"{kind} outside its summary part {key}"
        if kind == "response.reasoning_summary_text.delta":
            deltas[key].append(event["delta"])
        elif kind == "response.reasoning_summary_text.done":
            texts[key] = event["text"]
        elif kind == "response.reasoning_summary_part.done":
            assert event["part"]["text"] == texts.get(key), f"summary part {key} done with another text"
            open_parts.remove(key)
            closed.add(key)
    assert not open_parts, f"summary parts never closed: {sorted(open_parts)}"
    for key in closed:
        index, summary_index = key
        assert "".join(deltas[key]) == texts[key], f"summary deltas of {key} do not add up"
        assert done[index]["summary"][summary_index]["text"] == texts[key], f"summary {key} differs"


def output_text(response: dict[str, Any]) -> str:
    """All message text of a Response dict (as the SDK's ``output_text``)."""
    return "".join(
        part.get("text", "")
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
