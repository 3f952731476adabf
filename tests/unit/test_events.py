"""Event builders and output assembly, validated against the openai SDK's own models."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from resq import jsonutil
from resq.events import builders as build
from resq.events import types
from resq.events.assembler import OutputAssembler
from resq.events.emitter import EventEmitter
from resq.postprocess.segments import ReasoningEnd, ReasoningSegment, TextSegment, ToolCallSegment
from tests.support.invariants import check_stream

EVENT = TypeAdapter(ResponseStreamEvent)
RESPONSE_ID = "resp_" + "0" * 32


def base_response(status: str = "in_progress") -> dict[str, Any]:
    return {
        "id": RESPONSE_ID,
        "object": "response",
        "created_at": 1,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "model": "tiny",
        "output": [],
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        # The rest of a Response as resq sends it (tests/support/conformance.py checks them all).
        "background": False,
        "completed_at": None,
        "max_output_tokens": None,
        "max_tool_calls": None,
        "previous_response_id": None,
        "prompt_cache_key": None,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "service_tier": "default",
        "store": True,
        "text": {"format": {"type": "text"}},
        "top_logprobs": 0,
        "truncation": "disabled",
        "usage": None,
    }


def strict(event: dict[str, Any]) -> None:
    """Validate as the SDK does in strict mode."""
    EVENT.validate_python(event, strict=False)


def test_every_builder_matches_the_sdk() -> None:
    emitter = EventEmitter()
    message = build.message_item("msg_1", "in_progress")
    reasoning = build.reasoning_item("rs_1", "in_progress")
    call = build.function_call_item("fc_1", "call_1", "f", "{}", "completed")
    events = [
        build.response_event(types.CREATED, base_response()),
        build.output_item_added(0, message),
        build.content_part_added("msg_1", 0, 0, build.output_text_part("")),
        build.output_text_delta("msg_1", 0, 0, "hi"),
        build.output_text_done("msg_1", 0, 0, "hi"),
        build.content_part_done("msg_1", 0, 0, build.output_text_part("hi")),
        build.output_item_done(0, build.message_item("msg_1", "completed", [build.output_text_part("hi")])),
        build.output_item_added(1, reasoning),
        build.content_part_added("rs_1", 1, 0, build.reasoning_text_part("")),
        build.reasoning_text_delta("rs_1", 1, 0, "hm"),
        build.reasoning_text_done("rs_1", 1, 0, "hm"),
        build.output_item_added(2, build.function_call_item("fc_1", "call_1", "f", "", "in_progress")),
        build.function_call_arguments_delta("fc_1", 2, "{}"),
        build.function_call_arguments_done("fc_1", 2, "f", "{}"),
        build.output_item_done(2, call),
    ]
    for event in events:
        encoded = emitter.emit(event)
        strict(jsonutil.loads(encoded.data))
    final = {**base_response("completed"), "usage": build.usage(3, 4, reasoning_tokens=1)}
    Response.model_validate(final)
    terminal = emitter.emit_with_response_json(types.COMPLETED, jsonutil.dumps(final))
    parsed = jsonutil.loads(terminal.data)
    strict(parsed)
    assert parsed["response"] == final and parsed["sequence_number"] == len(events)


def test_emitter_numbers_without_gaps() -> None:
    emitter = EventEmitter(2)
    numbers = [emitter.emit(build.output_text_delta("m", 0, 0, "x")).sequence_number for _ in range(5)]
    assert numbers == [2, 3, 4, 5, 6]


def run_assembler(
    segments: list[Any], close: str = "completed"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    assembler = OutputAssembler(RESPONSE_ID)
    emitter = EventEmitter(2)
    events = [jsonutil.loads(emitter.emit(e).data) for s in segments for e in assembler.add(s)]
    events += [jsonutil.loads(emitter.emit(e).data) for e in assembler.close(close)]  # type: ignore[arg-type]
    return events, assembler.items


def with_envelope(events: list[dict[str, Any]], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    head = [
        {"type": types.CREATED, "sequence_number": 0, "response": base_response()},
        {"type": types.IN_PROGRESS, "sequence_number": 1, "response": base_response()},
    ]
    tail = {
        "type": types.COMPLETED,
        "sequence_number": 2 + len(events),
        "response": {**base_response("completed"), "output": items},
    }
    return [*head, *events, tail]


def test_text_then_calls_then_text_make_separate_items() -> None:
    events, items = run_assembler(
        [
            ReasoningSegment("think "),
            ReasoningSegment("more"),
            TextSegment("Let me "),
            TextSegment("check."),
            ToolCallSegment("get_weather", '{"city": "Oslo"}'),
            ToolCallSegment("get_weather", '{"city": "Rome"}'),
            TextSegment("Done."),
        ]
    )
    for event in events:
        strict(event)
    assert [item["type"] for item in items] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
        "message",
    ]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "think more"}]
    assert items[1]["content"][0]["text"] == "Let me check."
    assert items[2]["arguments"] == '{"city": "Oslo"}' and items[2]["call_id"].startswith("call_")
    assert len({item["id"] for item in items}) == len(items)
    final = check_stream(with_envelope(events, items))
    assert final["output"] == items


def test_length_limit_closes_the_open_item_as_incomplete() -> None:
    events, items = run_assembler([TextSegment("partial")], close="incomplete")
    assert items[0]["status"] == "incomplete"
    assert events[-1]["type"] == types.OUTPUT_ITEM_DONE and events[-1]["item"]["status"] == "incomplete"


def test_reasoning_whose_block_closed_is_complete_when_the_limit_cuts_what_follows() -> None:
    """The limit cut the whitespace after </think>: the reasoning is whole (it was once closed
    incomplete, since its item stayed open until answer text came)."""
    events, items = run_assembler([ReasoningSegment("Two plus two."), ReasoningEnd()], close="incomplete")
    assert [item["status"] for item in items] == ["completed"]
    _, cut_items = run_assembler(
        [ReasoningSegment("Two plus"), ReasoningEnd(), TextSegment("Th")], close="incomplete"
    )
    assert [item["status"] for item in cut_items] == ["completed", "incomplete"]
    _, unclosed_items = run_assembler([ReasoningSegment("Two plus")], close="incomplete")
    assert [item["status"] for item in unclosed_items] == ["incomplete"]
    check_stream(with_envelope(events, items))


def test_item_ids_depend_only_on_response_and_position() -> None:
    _, first = run_assembler([TextSegment("a"), ToolCallSegment("f", "{}")])
    _, second = run_assembler([TextSegment("b"), ToolCallSegment("g", "{}")])
    assert [item["id"] for item in first] == [item["id"] for item in second]


@pytest.mark.parametrize("status", ["completed", "incomplete", "failed", "cancelled"])
def test_terminal_event_types(status: str) -> None:
    assert types.TERMINAL_BY_STATUS[status] in types.TERMINAL_TYPES
