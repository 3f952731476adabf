"""tests/support/conformance.py: what the Open Responses checks accept and reject."""

from __future__ import annotations

import copy
import re
from typing import Any

import httpx
import pytest
from openai.types.responses import ResponseCompletedEvent, ResponseTextDeltaEvent

from tests.support import conformance
from tests.support.conformance import check_event, check_events, check_response

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": None,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


def valid_response(status: str = "completed") -> dict[str, Any]:
    """A Response as resq sends it: reasoning, a call and a message, every spec field present."""
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1_700_000_000,
        "completed_at": 1_700_000_001 if status == "completed" else None,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "max_tool_calls": None,
        "metadata": {},
        "model": "tiny",
        "output": [
            {
                "type": "reasoning",
                "id": "rs_1",
                "status": "completed",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "think"}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
                "status": "completed",
            },
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Hi.", "annotations": [], "logprobs": []}],
            },
        ],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "prompt_cache_key": None,
        "prompt_cache_retention": None,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "service_tier": "default",
        "store": True,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [copy.deepcopy(WEATHER_TOOL)],
        "top_logprobs": 0,
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": {
            "input_tokens": 5,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 7,
            "output_tokens_details": {"reasoning_tokens": 1},
            "total_tokens": 12,
        },
        "user": None,
    }


def reasoning_delta(kind: str = "response.reasoning_text.delta") -> dict[str, Any]:
    return {
        "type": kind,
        "sequence_number": 3,
        "item_id": "rs_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "think",
    }


def test_a_valid_response_passes() -> None:
    check_response(valid_response())
    check_response(valid_response("in_progress") | {"output": [], "usage": None})


def test_a_response_missing_presence_penalty_fails() -> None:
    response = valid_response()
    del response["presence_penalty"]
    with pytest.raises(AssertionError, match=r"response\.presence_penalty: Field required"):
        check_response(response)


def test_a_tool_echoed_without_strict_fails() -> None:
    response = valid_response()
    del response["tools"][0]["strict"]
    with pytest.raises(
        AssertionError, match=re.escape("response.tools[0] (function).strict: Field required")
    ):
        check_response(response)


def test_a_function_tool_with_null_strict_passes() -> None:
    response = valid_response()
    response["tools"][0]["strict"] = None
    check_response(response)


def test_types_are_checked_strictly() -> None:
    response = valid_response()
    response["created_at"] = "1700000000"
    with pytest.raises(AssertionError, match=r"response\.created_at: Input should be a valid integer"):
        check_response(response)


def test_a_bad_output_item_is_named_by_index_and_type() -> None:
    response = valid_response()
    del response["output"][1]["call_id"]
    with pytest.raises(AssertionError, match=re.escape("response.output[1] (function_call).call_id")):
        check_response(response)
    response = valid_response()
    del response["output"][2]["content"][0]["annotations"]
    with pytest.raises(AssertionError, match=re.escape("output[2] (message).content[0].annotations")):
        check_response(response)


def test_an_output_item_type_the_spec_lacks_fails() -> None:
    response = valid_response()
    response["output"].append({"type": "web_search_call", "id": "ws_1", "status": "completed"})
    with pytest.raises(AssertionError, match="output item type 'web_search_call' is not in the spec"):
        check_response(response)


def test_a_divergent_event_name_on_the_allow_list_passes() -> None:
    assert "response.reasoning_text.delta" in conformance.EVENT_RENAMES
    check_event(reasoning_delta())
    check_event(reasoning_delta() | {"type": "response.reasoning_text.done", "text": "think"})
    check_event(reasoning_delta("response.reasoning.delta"))


def test_an_allowed_event_name_still_gets_its_fields_checked() -> None:
    event = reasoning_delta()
    del event["delta"]
    with pytest.raises(
        AssertionError, match=re.escape("event #3 response.reasoning_text.delta: delta: Field required")
    ):
        check_event(event)


def test_an_event_type_off_the_allow_list_fails() -> None:
    with pytest.raises(AssertionError, match=re.escape("'response.reasoning_txt.delta' is not in the spec")):
        check_event(reasoning_delta("response.reasoning_txt.delta"))


def test_a_lifecycle_event_checks_its_response() -> None:
    response = valid_response("in_progress") | {"output": [], "usage": None}
    check_event({"type": "response.created", "sequence_number": 0, "response": response})
    del response["tools"][0]["strict"]
    with pytest.raises(
        AssertionError, match=re.escape("event #0 response.created: response.tools[0] (function)")
    ):
        check_event({"type": "response.created", "sequence_number": 0, "response": response})


def test_item_and_part_events_check_their_payload() -> None:
    message = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}
    check_event(
        {"type": "response.output_item.added", "sequence_number": 4, "output_index": 0, "item": message}
    )
    part = {"type": "output_text", "text": "", "annotations": []}
    added = {
        "type": "response.content_part.added",
        "sequence_number": 5,
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "part": part,
    }
    check_event(added)
    with pytest.raises(AssertionError, match=re.escape("part.annotations: Field required")):
        check_event(added | {"part": {"type": "output_text", "text": ""}})


@pytest.mark.parametrize(
    "divergence",
    [
        {"tools": [{"type": "web_search"}, {"type": "custom", "name": "sql", "description": None}]},
        {"tool_choice": {"type": "custom", "name": "sql"}},
        {
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "custom", "name": "sql"}],
            }
        },
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "schema": {},
                    "description": None,
                    "strict": True,
                }
            }
        },
        {"reasoning": {"effort": "minimal", "summary": None}},
    ],
)
def test_allowed_response_divergences_pass(divergence: dict[str, Any]) -> None:
    check_response(valid_response() | divergence)


def test_a_json_schema_format_without_description_fails() -> None:
    response = valid_response() | {
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": True}}
    }
    with pytest.raises(AssertionError, match=re.escape("response.text.format.description: Field required")):
        check_response(response)


def test_sdk_only_items_and_events_pass() -> None:
    call = {
        "type": "custom_tool_call",
        "id": "ctc_1",
        "call_id": "call_1",
        "name": "sql",
        "input": "select 1",
    }
    check_response(valid_response() | {"output": [call]})
    delta = {
        "type": "response.custom_tool_call_input.delta",
        "sequence_number": 6,
        "item_id": "ctc_1",
        "output_index": 0,
        "delta": "select",
    }
    check_event(delta)
    with pytest.raises(
        AssertionError, match=re.escape("custom_tool_call_input.delta: sequence_number: expected int")
    ):
        check_event(delta | {"sequence_number": "6"})
    check_event(
        {"type": "error", "sequence_number": 1, "code": "server_error", "message": "boom", "param": None}
    )
    payload = {"type": "server_error", "code": "server_error", "message": "boom", "param": None}
    check_event({"type": "error", "sequence_number": 1, "error": payload})


def test_every_divergence_is_documented() -> None:
    doc = conformance.__doc__ or ""
    for key in conformance.DIVERGENCES:
        assert f"``{key}``" in doc, key


def test_check_events_reads_sdk_events_as_sent() -> None:
    sent = {
        "type": "response.output_text.delta",
        "sequence_number": 7,
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "Hi",
        "logprobs": [],
    }
    event = ResponseTextDeltaEvent.model_validate(sent)
    assert conformance.wire_dict(event) == sent
    check_events([event, sent])
    with pytest.raises(
        AssertionError,
        match=re.escape("event #7 response.output_text.delta: delta: Input should be a valid string"),
    ):
        check_events([sent | {"delta": 3}])


def test_text_event_logprobs_may_lack_bytes_but_parts_may_not() -> None:
    entry = {"token": "Hi", "logprob": -0.5, "top_logprobs": []}
    delta = {
        "type": "response.output_text.delta",
        "sequence_number": 7,
        "item_id": "msg_1",
        "output_index": 0,
        "content_index": 0,
        "delta": "Hi",
        "logprobs": [entry],
    }
    check_event(delta)
    with pytest.raises(AssertionError, match=r"logprobs\[0\]\.logprob: Field required"):
        check_event(delta | {"logprobs": [{"token": "Hi", "top_logprobs": []}]})
    response = valid_response()
    response["output"][2]["content"][0]["logprobs"] = [entry]
    with pytest.raises(AssertionError, match=re.escape("content[0].logprobs[0].bytes: Field required")):
        check_response(response)
    response["output"][2]["content"][0]["logprobs"] = [entry | {"bytes": [72, 105]}]
    check_response(response)


def test_responses_dumped_from_sdk_models_pass() -> None:
    response = valid_response() | {
        "text": {
            "format": {"type": "json_schema", "name": "x", "schema": {}, "description": None, "strict": True}
        }
    }
    event = ResponseCompletedEvent.model_validate(
        {"type": "response.completed", "sequence_number": 9, "response": response}
    )
    dumped = event.model_dump(mode="json")  # as invariants.as_dict does: floats, `schema_`
    assert dumped["response"]["created_at"] == 1_700_000_000.0
    assert "schema_" in dumped["response"]["text"]["format"]
    check_events([event, dumped])
    with pytest.raises(AssertionError, match=r"response\.created_at: Input should be a valid integer"):
        check_events([dumped | {"response": response | {"created_at": 1.5}}])


def test_the_http_hook_checks_json_responses_only() -> None:
    def reply(path: str, body: Any, content_type: str = "application/json") -> httpx.Response:
        request = httpx.Request("POST", f"http://127.0.0.1/v1{path}")
        return httpx.Response(200, json=body, headers={"content-type": content_type}, request=request)

    conformance.check_http_response(reply("/responses", valid_response()))
    conformance.check_http_response(reply("/responses/resp_1/cancel", valid_response()))
    broken = valid_response()
    del broken["frequency_penalty"]
    with pytest.raises(AssertionError, match=r"response\.frequency_penalty: Field required"):
        conformance.check_http_response(reply("/responses/resp_1", broken))
    conformance.check_http_response(reply("/responses/resp_1/input_items", {"object": "list", "data": []}))
    conformance.check_http_response(reply("/responses", broken, "text/event-stream"))
