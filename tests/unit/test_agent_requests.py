"""What agent clients send: namespace and hosted tools, allowed_tools, echoes, summaries, sealed reasoning."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from api.errors import OpenAIError, validation_error_to_openai
from api.generation_plan import hosted_tool_types, plan_tools
from api.input_items import normalise_item
from api.prompting import has_cache_breakpoint
from api.schemas import CreateResponseRequest
from api.submission import initial_response
from resq import jsonutil
from resq.conversation import flat_tool_name, items_to_messages, split_tool_name
from resq.events.assembler import OutputAssembler, ReasoningOutput
from resq.events.emitter import EventEmitter
from resq.postprocess.segments import ReasoningSegment, TextSegment, ToolCallSegment
from resq.sealed import REASONING, Sealer
from tests.support.invariants import check_stream
from tests.unit.test_events import base_response

RESPONSE_ID = "resp_" + "1" * 32
EVENT = TypeAdapter(ResponseStreamEvent)
SPAWN = {
    "type": "function",
    "name": "spawn",
    "description": "Start a sub-agent.",
    "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
}
AGENTS = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [SPAWN]}
EXEC = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}


def request(**fields: Any) -> CreateResponseRequest:
    return CreateResponseRequest.model_validate({"model": "tiny", "input": "hi", **fields})


def offered_names(plan: Any) -> list[str]:
    return [tool["function"]["name"] for tool in plan.template_tools or []]


# --- namespaces ---------------------------------------------------------------------------------


def test_flattened_names_split_back_and_plain_names_stay_plain() -> None:
    assert flat_tool_name("agents", "spawn") == "agents:spawn"
    assert split_tool_name("agents:spawn") == ("agents", "spawn")
    assert split_tool_name("exec_command") == (None, "exec_command")
    assert flat_tool_name(None, "exec_command") == "exec_command"
    # Declared names cannot hold ':', so a plain name never splits.
    with pytest.raises(ValueError):
        request(tools=[{**EXEC, "name": "agents:spawn"}])


def test_namespace_tools_are_offered_flattened_beside_plain_ones() -> None:
    plan = plan_tools(request(tools=[EXEC, AGENTS]), "hermes", "qwen3")
    assert offered_names(plan) == ["exec_command", "agents:spawn"]
    spawn = plan.template_tools[1]["function"]  # type: ignore[index]
    assert spawn["description"] == SPAWN["description"] and spawn["parameters"] == SPAWN["parameters"]


def test_a_namespace_function_and_a_plain_function_of_the_same_name_do_not_collide() -> None:
    plan = plan_tools(request(tools=[SPAWN, AGENTS]), "hermes", "qwen3")
    assert offered_names(plan) == ["spawn", "agents:spawn"]


def test_a_call_to_a_namespace_function_comes_back_with_name_and_namespace_apart() -> None:
    assembler = OutputAssembler(RESPONSE_ID)
    events = assembler.add(ToolCallSegment("agents:spawn", '{"task": "x"}'))
    item = assembler.items[0]
    assert (item["name"], item["namespace"]) == ("spawn", "agents")
    done = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert done[0]["name"] == "spawn"
    plain = OutputAssembler(RESPONSE_ID)
    plain.add(ToolCallSegment("exec_command", "{}"))
    assert "namespace" not in plain.items[0]


def test_an_echoed_namespace_call_renders_under_the_name_the_model_was_offered() -> None:
    items = [
        {"type": "message", "role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "agents", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    messages = items_to_messages(items)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "agents:spawn"


# --- hosted tools and allowed_tools -------------------------------------------------------------


def test_hosted_tools_are_not_offered_and_are_echoed_as_sent() -> None:
    asked = request(tools=[EXEC, WEB_SEARCH, {"type": "image_generation"}])
    plan = plan_tools(asked, "hermes", "qwen3")
    assert offered_names(plan) == ["exec_command"]
    assert hosted_tool_types(asked) == ["web_search", "image_generation"]
    created = initial_response(asked, RESPONSE_ID, "tiny", background=False, store=True)
    assert created["tools"][1] == WEB_SEARCH
    Response.model_validate({**created, "status": "completed"})


def test_only_hosted_tools_offer_nothing() -> None:
    plan = plan_tools(request(tools=[WEB_SEARCH]), "hermes", "qwen3")
    assert not plan.tools_enabled and plan.template_tools is None


def test_refusing_hosted_tools_names_the_first_one() -> None:
    with pytest.raises(OpenAIError) as caught:
        plan_tools(request(tools=[EXEC, WEB_SEARCH]), "hermes", "qwen3", refuse_hosted=True)
    error = caught.value.body()["error"]
    assert (error["param"], error["code"]) == ("tools[1]", "unsupported_parameter")


def test_allowed_tools_offers_only_the_listed_tools() -> None:
    choice = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "function", "name": "exec_command"}],
    }
    plan = plan_tools(request(tools=[EXEC, AGENTS], tool_choice=choice), "hermes", "qwen3")
    assert offered_names(plan) == ["exec_command"] and plan.forced_prefix == ""


def test_allowed_tools_required_forces_a_call_among_them() -> None:
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "spawn", "namespace": "agents"}, {"type": "web_search"}],
    }
    plan = plan_tools(request(tools=[EXEC, AGENTS, WEB_SEARCH], tool_choice=choice), "hermes", "qwen3")
    assert offered_names(plan) == ["agents:spawn"]
    # One tool allowed and a call required: the answer is prefilled with that call's opening.
    assert plan.forced_prefix.endswith('"name": "agents:spawn", "arguments":')


def test_allowed_tools_by_namespace_and_a_ref_to_no_tool() -> None:
    by_namespace = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "namespace", "name": "agents"}],
    }
    plan = plan_tools(request(tools=[EXEC, AGENTS], tool_choice=by_namespace), "hermes", "qwen3")
    assert offered_names(plan) == ["agents:spawn"]
    missing = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]}
    with pytest.raises(OpenAIError) as caught:
        plan_tools(request(tools=[EXEC], tool_choice=missing), "hermes", "qwen3")
    assert caught.value.body()["error"]["param"] == "tool_choice.tools[0]"


# --- the Response's echo ------------------------------------------------------------------------


def test_the_response_echoes_penalties_tier_and_null_tool_keys() -> None:
    asked = request(
        tools=[{"type": "function", "name": "f"}, AGENTS],
        presence_penalty=0.5,
        service_tier="priority",
        client_metadata={"session": "s1"},
    )
    created = initial_response(asked, RESPONSE_ID, "tiny", background=False, store=True)
    assert created["presence_penalty"] == 0.5 and created["frequency_penalty"] == 0.0
    assert created["service_tier"] == "default"  # the tier resq served
    assert created["tools"][0] == {
        "type": "function",
        "name": "f",
        "description": None,
        "parameters": None,
        "strict": None,
    }
    assert created["tools"][1]["tools"][0]["strict"] is None
    assert "client_metadata" not in created
    Response.model_validate({**created, "status": "completed"})


# --- reasoning: summary and encrypted_content ---------------------------------------------------


def _run(reasoning: ReasoningOutput) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    assembler = OutputAssembler(RESPONSE_ID, reasoning)
    emitter = EventEmitter(2)
    segments = [ReasoningSegment("Two plus "), ReasoningSegment("two."), TextSegment("4")]
    events = [jsonutil.loads(emitter.emit(e).data) for s in segments for e in assembler.add(s)]
    events += [jsonutil.loads(emitter.emit(e).data) for e in assembler.close("completed")]
    return events, assembler.items


def _enveloped(events: list[dict[str, Any]], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = {
        **base_response(),  # a whole Response: check_stream checks Open Responses conformance
        "id": RESPONSE_ID,
        "object": "response",
        "created_at": 1,
        "model": "tiny",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    head = [
        {"type": "response.created", "sequence_number": 0, "response": {**base, "status": "in_progress"}},
        {"type": "response.in_progress", "sequence_number": 1, "response": {**base, "status": "in_progress"}},
    ]
    tail = {
        "type": "response.completed",
        "sequence_number": 2 + len(events),
        "response": {**base, "status": "completed", "output": items},
    }
    return [*head, *events, tail]


def test_a_summary_request_mirrors_the_reasoning_into_summary_events_and_parts() -> None:
    events, items = _run(ReasoningOutput(summary=True))
    for event in events:
        EVENT.validate_python(event)
    check_stream(_enveloped(events, items))
    reasoning = items[0]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Two plus two."}]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Two plus two."}]
    kinds = [event["type"] for event in events]
    assert kinds.count("response.reasoning_summary_text.delta") == 2
    assert kinds.index("response.reasoning_summary_part.added") < kinds.index(
        "response.reasoning_summary_text.delta"
    )
    assert "encrypted_content" not in reasoning


def test_without_a_summary_request_summary_stays_empty() -> None:
    events, items = _run(ReasoningOutput())
    assert items[0]["summary"] == []
    assert not any(event["type"].startswith("response.reasoning_summary") for event in events)


def test_sealed_reasoning_opens_to_exactly_the_reasoning_text() -> None:
    sealer = Sealer(b"k")
    events, items = _run(ReasoningOutput(seal=lambda text: sealer.seal(REASONING, "me", text)))
    blob = items[0]["encrypted_content"]
    assert sealer.open(REASONING, "me", blob) == "Two plus two."
    done = [event for event in events if event["type"] == "response.output_item.done"]
    assert done[0]["item"]["encrypted_content"] == blob
    # Deterministic: the same segments seal to the same bytes (a re-run post-processor).
    assert _run(ReasoningOutput(seal=lambda text: sealer.seal(REASONING, "me", text)))[1] == items


# --- prompt_cache_options ---------------------------------------------------------------------------


def test_prompt_cache_options_are_echoed_as_applied_and_validate_strictly() -> None:
    asked = request(prompt_cache_options={"mode": "explicit", "comparison_response_id": "resp_1"})
    created = initial_response(asked, RESPONSE_ID, "tiny", background=False, store=True)
    assert created["prompt_cache_options"] == {
        "mode": "explicit",
        "ttl": "30m",
        "comparison_response_id": "resp_1",
    }
    echoed = Response.model_validate({**created, "status": "completed"})
    assert echoed.prompt_cache_options is not None and echoed.prompt_cache_options.ttl == "30m"
    plain = initial_response(request(), RESPONSE_ID, "tiny", background=False, store=True)
    assert plain["prompt_cache_options"] is None


@pytest.mark.parametrize(
    ("options", "param", "code"),
    [
        ({"prewarm": "yes"}, "prompt_cache_options.prewarm", None),
        ({"mode": "automatic"}, "prompt_cache_options.mode", None),
        ({"ttl": "1h"}, "prompt_cache_options.ttl", None),
        ({"retention": "24h"}, "prompt_cache_options.retention", None),
    ],
)
def test_prompt_cache_options_refusals_name_the_field(
    options: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(ValidationError) as raised:
        request(prompt_cache_options=options)
    error = validation_error_to_openai(raised.value.errors())
    assert error.status_code == 400 and error.param == param
    if code is not None:
        assert error.code == code


def test_prompt_cache_options_prewarm_false_is_no_change() -> None:
    options = request(prompt_cache_options={"prewarm": False}).prompt_cache_options
    assert options is not None and options.caches(has_breakpoint=False)


def test_explicit_prompt_caching_needs_a_breakpoint_somewhere_in_the_prompt() -> None:
    explicit = request(prompt_cache_options={"mode": "explicit"}).prompt_cache_options
    implicit = request(prompt_cache_options={"mode": "implicit"}).prompt_cache_options
    assert explicit is not None and implicit is not None
    plain = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]}]
    marked = [
        {"type": "function_call_output", "call_id": "c", "output": "x"},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a", "prompt_cache_breakpoint": {"mode": "explicit"}}],
        },
    ]
    in_output = [
        {
            "type": "function_call_output",
            "call_id": "c",
            "output": [{"type": "input_text", "text": "r", "prompt_cache_breakpoint": {"mode": "explicit"}}],
        }
    ]
    assert (
        not has_cache_breakpoint(plain) and has_cache_breakpoint(marked) and has_cache_breakpoint(in_output)
    )
    assert not explicit.caches(has_cache_breakpoint(plain))
    assert explicit.caches(has_cache_breakpoint(marked))
    assert implicit.caches(has_cache_breakpoint(plain))


def test_a_breakpoint_is_kept_on_the_stored_input_item() -> None:
    part = {"type": "input_text", "text": "a", "prompt_cache_breakpoint": {"mode": "explicit"}}
    item = normalise_item({"type": "message", "role": "user", "content": [part]}, "msg_1")
    assert item["content"] == [part]
    bare = normalise_item({"type": "message", "role": "user", "content": "a"}, "msg_2")
    assert bare["content"] == [{"type": "input_text", "text": "a"}]
