"""Hostile and malformed input: every case gets its exact 4xx and OpenAI error, and harms nothing.

The matrix runs against an API of its own with small limits (body size, output-token cap).
After every case a normal request must still succeed, and a response stored before the
matrix must read back byte for byte as it was.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import websockets.exceptions
import websockets.sync.client
import zstandard
from openai import RateLimitError
from openai.types.responses import Response

from tests.e2e.conftest import MODEL, Stack, start_stack
from tests.fixture_model import scenario
from tests.support.processes import RoleProcess, wait_until

pytestmark = pytest.mark.e2e

MAX_BODY_BYTES = 65536
OUTPUT_TOKENS_CAP = 1020
"""Below the fixture model's 1024-position context, but a prompt plus this many tokens is not."""
UNKNOWN_ID = "resp_" + "0" * 32
STORED = "{stored}"
"""Placeholder in a case's path for the id of the response stored before the matrix."""
INVALID = "invalid_request_error"


@dataclass(frozen=True)
class Case:
    """One bad request and the error it must get."""

    name: str
    status: int
    code: str | None
    param: str | None
    json: Any = None
    method: str = "POST"
    path: str = "/v1/responses"
    params: dict[str, str] = field(default_factory=dict)
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    type: str = INVALID


CHAT = "/v1/chat/completions"


def chat(**fields: Any) -> dict[str, Any]:
    """A chat completion body: a valid one, changed by ``fields``."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def body(**fields: Any) -> dict[str, Any]:
    """A valid request body with ``fields`` changed (``None`` as a value removes the field)."""
    merged = {"model": MODEL, "input": "Say hello.", **fields}
    return {key: value for key, value in merged.items() if value is not None}


def _chunks(data: bytes, size: int = 4096) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


DEEP = _nested(100)
"""Deeper than any JSON schema needs: it would exhaust the JSON encoders' recursion."""

LONG_INPUT = "ha " * 1500
"""More tokens than the fixture model's 1024-position context."""

CASES = [
    # --- the body as a whole ----------------------------------------------------------------------
    Case("not_json", 400, "invalid_json", None, content=b'{"model": "fixture", "input": '),
    Case("json_array", 400, "invalid_type", None, json=[]),
    Case("json_string", 400, "invalid_type", None, json="hello"),
    Case("empty_body", 400, "invalid_json", None, content=b""),
    Case("too_large", 413, "request_too_large", None, json=body(input="x" * MAX_BODY_BYTES)),
    Case(
        "too_large_chunked",
        413,
        "request_too_large",
        None,
        content=b'{"model": "fixture", "input": "' + b"x" * (2 * MAX_BODY_BYTES) + b'"}',
        headers={"Content-Type": "application/json"},
    ),
    Case(
        "unsupported_encoding",
        415,
        "unsupported_content_encoding",
        None,
        content=b'{"model": "fixture", "input": "hi"}',
        headers={"Content-Encoding": "br"},
    ),
    Case(
        "corrupt_gzip",
        400,
        "invalid_body",
        None,
        content=b"not gzip at all",
        headers={"Content-Encoding": "gzip"},
    ),
    Case(
        "zstd_bomb",
        413,
        "request_too_large",
        None,
        content=zstandard.ZstdCompressor().compress(
            b'{"model": "fixture", "input": "' + b"x" * (64 * MAX_BODY_BYTES) + b'"}'
        ),
        headers={"Content-Encoding": "zstd"},
    ),
    Case(
        "form_encoded",
        400,
        "invalid_type",
        None,
        content=b"model=fixture&input=hi",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    ),
    Case(
        "not_utf8", 400, "invalid_json", None, content='{"model": "fixture", "input": "é"}'.encode("latin-1")
    ),
    Case(
        "lone_surrogate", 400, "invalid_value", "input", content=b'{"model": "fixture", "input": "\\ud800"}'
    ),
    Case(
        "lone_surrogate_key",
        400,
        "invalid_value",
        None,
        content=b'{"model": "fixture", "input": "hi", "\\ud800": 1}',
    ),
    Case(
        "nesting_too_deep",
        400,
        "invalid_value",
        "tools",
        json=body(tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "x": DEEP}}]),
    ),
    Case(
        "integer_past_64_bits",
        400,
        "invalid_value",
        "input[1].content[0].annotations[0]",
        json=body(
            input=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "x", "annotations": [2**64]}],
                },
            ]
        ),
    ),
    Case(
        "integer_past_64_bits_in_a_conversation",
        400,
        "invalid_value",
        "items[0].content[0].annotations[0]",
        path="/v1/conversations",
        json={
            "items": [
                {
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "x", "annotations": [-(2**63) - 1]}],
                }
            ]
        },
    ),
    Case(
        "nan_number",
        400,
        "invalid_value",
        "temperature",
        content=b'{"model": "fixture", "input": "hi", "temperature": NaN}',
    ),
    Case(
        "infinite_number",
        400,
        "invalid_value",
        "top_p",
        content=b'{"model": "fixture", "input": "hi", "top_p": 1e400}',
    ),
    # --- fields: presence, unknown, types ----------------------------------------------------------
    Case("missing_model", 400, "missing_required_parameter", "model", json={"input": "hi"}),
    Case("empty_model", 400, "invalid_value", "model", json=body(model="")),
    Case("unknown_model", 404, "model_not_found", "model", json=body(model="no-such-model")),
    Case("model_wrong_type", 400, "invalid_type", "model", json=body(model=7)),
    Case("unknown_field", 400, "unknown_parameter", "frobnicate", json=body(frobnicate=1)),
    Case(
        "unknown_nested_field",
        400,
        "unknown_parameter",
        "input[0].mood",
        json=body(input=[{"role": "user", "content": "hi", "mood": "grumpy"}]),
    ),
    Case("missing_input", 400, "missing_required_parameter", "input", json=body(input=None)),
    Case("empty_input_list", 400, "missing_required_parameter", "input", json=body(input=[])),
    Case("input_wrong_type", 400, "invalid_type", "input", json=body(input=5)),
    Case(
        "bad_role",
        400,
        "invalid_value",
        "input[0].role",
        json=body(input=[{"role": "robot", "content": "x"}]),
    ),
    Case(
        "content_wrong_type",
        400,
        "invalid_type",
        "input[0].content",
        json=body(input=[{"role": "user", "content": 42}]),
    ),
    Case(
        "image_content",
        400,
        "unsupported_parameter",
        "input[0].content[0].type",
        json=body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    ),
    Case("instructions_wrong_type", 400, "invalid_type", "instructions", json=body(instructions=["a"])),
    Case("stream_wrong_type", 400, "invalid_type", "stream", json=body(stream="maybe")),
    Case("stream_as_number", 400, "invalid_type", "stream", json=body(stream=1)),
    Case(
        "max_output_tokens_as_bool",
        400,
        "invalid_type",
        "max_output_tokens",
        json=body(max_output_tokens=True),
    ),
    Case("temperature_wrong_type", 400, "invalid_type", "temperature", json=body(temperature="hot")),
    Case("temperature_too_high", 400, "invalid_value", "temperature", json=body(temperature=3)),
    Case("top_p_zero", 400, "invalid_value", "top_p", json=body(top_p=0)),
    Case("user_too_long", 400, "invalid_value", "user", json=body(user="u" * 257)),
    Case(
        "background_without_store",
        400,
        "invalid_value",
        "background",
        json=body(background=True, store=False),
    ),
    # --- limits -----------------------------------------------------------------------------------
    Case("max_output_tokens_zero", 400, "invalid_value", "max_output_tokens", json=body(max_output_tokens=0)),
    Case(
        "max_output_tokens_wrong_type",
        400,
        "invalid_type",
        "max_output_tokens",
        json=body(max_output_tokens="ten"),
    ),
    Case(
        "max_output_tokens_over_cap",
        400,
        "invalid_value",
        "max_output_tokens",
        json=body(max_output_tokens=OUTPUT_TOKENS_CAP + 1),
    ),
    Case(
        "max_output_tokens_huge",
        400,
        "invalid_value",
        "max_output_tokens",
        json=body(max_output_tokens=10**30),
    ),
    Case(
        "output_leaves_no_room",
        400,
        "context_length_exceeded",
        "input",
        json=body(max_output_tokens=OUTPUT_TOKENS_CAP),
    ),
    Case("input_over_context", 400, "context_length_exceeded", "input", json=body(input=LONG_INPUT)),
    Case(
        "metadata_too_many_keys",
        400,
        "invalid_value",
        "metadata",
        json=body(metadata={f"k{index}": "v" for index in range(17)}),
    ),
    Case("metadata_key_too_long", 400, "invalid_value", "metadata", json=body(metadata={"k" * 65: "v"})),
    Case("metadata_value_too_long", 400, "invalid_value", "metadata", json=body(metadata={"k": "v" * 513})),
    Case("metadata_value_not_string", 400, "invalid_type", "metadata.k", json=body(metadata={"k": 1})),
    # --- unsupported features ---------------------------------------------------------------------
    Case("truncation_unknown", 400, "invalid_value", "truncation", json=body(truncation="sometimes")),
    Case("conversation_malformed", 400, "invalid_value", "conversation", json=body(conversation="conv_1")),
    Case(
        "conversation_id_wrong_type",
        400,
        "invalid_type",
        "conversation.id",
        json=body(conversation={"id": 3}),
    ),
    Case(
        "conversation_unknown",
        404,
        None,
        "conversation",
        json=body(conversation="conv_" + "0" * 32),
    ),
    Case(
        "conversation_and_previous_response",
        400,
        "invalid_value",
        "conversation",
        json=body(conversation="conv_" + "0" * 32, previous_response_id="resp_" + "0" * 32),
    ),
    Case(
        "tool_output_without_its_call",
        400,
        "invalid_value",
        "input[1].call_id",
        json=body(
            input=[
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_nowhere", "output": "42"},
            ]
        ),
    ),
    Case(
        "context_management_unknown_type",
        400,
        "invalid_value",
        "context_management[0].type",
        json=body(context_management=[{"type": "summary"}]),
    ),
    Case(
        "compaction_forged",
        400,
        "invalid_encrypted_content",
        "input[0].encrypted_content",
        json=body(
            input=[{"type": "compaction", "encrypted_content": "rq1_AAAA"}, {"role": "user", "content": "hi"}]
        ),
    ),
    Case(
        "unknown_tool_type",
        400,
        "invalid_value",
        "tools[0].type",
        json=body(tools=[{"type": "teleport"}]),
    ),
    Case(
        "too_many_tools",
        400,
        "invalid_value",
        "tools",
        json=body(tools=[{"type": "function", "name": f"f{index}"} for index in range(129)]),
    ),
    Case(
        "too_many_tools_in_a_namespace",
        400,
        "invalid_value",
        "tools[0].tools",
        json=body(
            tools=[
                {
                    "type": "namespace",
                    "name": "n",
                    "description": "Many.",
                    "tools": [{"type": "function", "name": f"f{index}"} for index in range(129)],
                }
            ]
        ),
    ),
    Case(
        "function_parameters_not_an_object",
        400,
        "invalid_function_parameters",
        "tools[0].parameters",
        json=body(tools=[{"type": "function", "name": "f", "parameters": {"type": "array"}}]),
    ),
    Case(
        "hosted_tool_choice",
        400,
        "unsupported_parameter",
        "tool_choice.type",
        json=body(tools=[{"type": "web_search"}], tool_choice={"type": "web_search"}),
    ),
    Case("tool_choice_without_tools", 400, "invalid_value", "tool_choice", json=body(tool_choice="required")),
    Case(
        "json_schema_invalid",
        400,
        "invalid_json_schema",
        "text.format.schema",
        json=body(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}),
    ),
    Case(
        "json_schema_bad_pattern",
        400,
        "invalid_json_schema",
        "text.format.schema",
        json=body(text={"format": {"type": "json_schema", "name": "x", "schema": {"pattern": "(a"}}}),
    ),
    Case(
        "json_schema_without_name",
        400,
        "missing_required_parameter",
        "text.format.name",
        json=body(text={"format": {"type": "json_schema", "schema": {}}}),
    ),
    Case(
        "text_format_unknown_type",
        400,
        "invalid_value",
        "text.format",
        json=body(text={"format": {"type": "yaml"}}),
    ),
    Case(
        "namespaced_strict_tool_unsupported_schema",
        400,
        "invalid_json_schema",
        "tools[0].tools[0].parameters",
        json=body(
            tools=[
                {
                    "type": "namespace",
                    "name": "n",
                    "description": "Tools.",
                    "tools": [{"type": "function", "name": "f", "strict": True, "parameters": {"not": {}}}],
                }
            ]
        ),
    ),
    Case(
        "namespaced_custom_tool_bad_lark",
        400,
        "invalid_value",
        "tools[0].tools[0].format.definition",
        json=body(
            tools=[
                {
                    "type": "namespace",
                    "name": "n",
                    "description": "Tools.",
                    "tools": [
                        {
                            "type": "custom",
                            "name": "c",
                            "format": {"type": "grammar", "syntax": "lark", "definition": "start: foo"},
                        }
                    ],
                }
            ]
        ),
    ),
    Case(
        "namespace_without_description",
        400,
        "missing_required_parameter",
        "tools[0].description",
        json=body(tools=[{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f"}]}]),
    ),
    Case(
        "strict_tool_bad_parameters",
        400,
        "invalid_json_schema",
        "tools[0].parameters",
        json=body(
            tools=[
                {
                    "type": "function",
                    "name": "f",
                    "strict": True,
                    "parameters": {"type": "object", "properties": {"a": {"type": 7}}},
                }
            ]
        ),
    ),
    Case("unknown_include", 400, "invalid_value", "include", json=body(include=["everything"])),
    # --- ids --------------------------------------------------------------------------------------
    Case(
        "previous_id_malformed",
        400,
        "previous_response_not_found",
        "previous_response_id",
        json=body(previous_response_id="resp_123"),
    ),
    Case(
        "previous_id_unknown",
        400,
        "previous_response_not_found",
        "previous_response_id",
        json=body(previous_response_id=UNKNOWN_ID),
    ),
    Case("get_malformed_id", 400, "invalid_value", "response_id", method="GET", path="/v1/responses/nope"),
    Case(
        "get_overlong_id",
        400,
        "invalid_value",
        "response_id",
        method="GET",
        path="/v1/responses/resp_" + "a" * 5000,
    ),
    Case("get_unknown_id", 404, None, "response_id", method="GET", path=f"/v1/responses/{UNKNOWN_ID}"),
    Case(
        "input_tokens_no_input",
        400,
        "missing_required_parameter",
        "input",
        path="/v1/responses/input_tokens",
        json={"model": MODEL},
    ),
    Case(
        "input_tokens_unknown_model",
        404,
        "model_not_found",
        "model",
        path="/v1/responses/input_tokens",
        json={"model": "nope", "input": "hi"},
    ),
    Case(
        "compact_no_model",
        400,
        "missing_required_parameter",
        "model",
        path="/v1/responses/compact",
        json={"input": "hi"},
    ),
    Case(
        "compact_unknown_field",
        400,
        "unknown_parameter",
        "stream",
        path="/v1/responses/compact",
        json={"model": MODEL, "input": "hi", "stream": True},
    ),
    Case(
        "compact_forged",
        400,
        "invalid_encrypted_content",
        "input[0].encrypted_content",
        path="/v1/responses/compact",
        json={"model": MODEL, "input": [{"type": "compaction", "encrypted_content": "rq1_AAAA"}]},
    ),
    Case("cancel_malformed_id", 400, "invalid_value", "response_id", path="/v1/responses/x/cancel"),
    Case("cancel_unknown_id", 404, None, "response_id", path=f"/v1/responses/{UNKNOWN_ID}/cancel"),
    Case("cancel_not_background", 400, "invalid_value", None, path=f"/v1/responses/{STORED}/cancel"),
    Case("delete_malformed_id", 400, "invalid_value", "response_id", method="DELETE", path="/v1/responses/x"),
    Case("delete_unknown_id", 404, None, "response_id", method="DELETE", path=f"/v1/responses/{UNKNOWN_ID}"),
    Case(
        "input_items_unknown_id",
        404,
        None,
        "response_id",
        method="GET",
        path=f"/v1/responses/{UNKNOWN_ID}/input_items",
    ),
    # --- query parameters -------------------------------------------------------------------------
    Case(
        "stream_query_not_boolean",
        400,
        "invalid_value",
        "stream",
        method="GET",
        path=f"/v1/responses/{STORED}",
        params={"stream": "maybe"},
    ),
    Case(
        "starting_after_negative",
        400,
        "invalid_value",
        "starting_after",
        method="GET",
        path=f"/v1/responses/{STORED}",
        params={"stream": "true", "starting_after": "-1"},
    ),
    Case(
        "starting_after_not_integer",
        400,
        "invalid_type",
        "starting_after",
        method="GET",
        path=f"/v1/responses/{STORED}",
        params={"stream": "true", "starting_after": "ten"},
    ),
    Case(
        "starting_after_too_large",
        400,
        "invalid_value",
        "starting_after",
        method="GET",
        path=f"/v1/responses/{STORED}",
        params={"stream": "true", "starting_after": str(2**64)},
    ),
    Case(
        "input_items_limit_zero",
        400,
        "invalid_value",
        "limit",
        method="GET",
        path=f"/v1/responses/{STORED}/input_items",
        params={"limit": "0"},
    ),
    Case(
        "input_items_limit_not_integer",
        400,
        "invalid_value",
        "limit",
        method="GET",
        path=f"/v1/responses/{STORED}/input_items",
        params={"limit": "many"},
    ),
    Case(
        "input_items_bad_order",
        400,
        "invalid_value",
        "order",
        method="GET",
        path=f"/v1/responses/{STORED}/input_items",
        params={"order": "sideways"},
    ),
    Case(
        "input_items_bad_after",
        400,
        "invalid_value",
        "after",
        method="GET",
        path=f"/v1/responses/{STORED}/input_items",
        params={"after": "msg_nope"},
    ),
    # --- routes -----------------------------------------------------------------------------------
    # Chat Completions: the same envelopes, naming the chat parameter.
    Case("chat_no_messages", 400, "missing_required_parameter", "messages", path=CHAT, json={"model": MODEL}),
    Case("chat_messages_not_a_list", 400, "invalid_type", "messages", path=CHAT, json=chat(messages="hi")),
    Case("chat_unknown_model", 404, "model_not_found", "model", path=CHAT, json=chat(model="nope")),
    Case("chat_n", 400, "unsupported_parameter", "n", path=CHAT, json=chat(n=3)),
    Case("chat_store", 400, "unsupported_parameter", "store", path=CHAT, json=chat(store=True)),
    Case("chat_stream_string", 400, "invalid_type", "stream", path=CHAT, json=chat(stream="yes")),
    Case(
        "chat_stream_options_without_stream",
        400,
        "invalid_value",
        "stream_options",
        path=CHAT,
        json=chat(stream_options={"include_usage": True}),
    ),
    Case("chat_bad_temperature", 400, "invalid_value", "temperature", path=CHAT, json=chat(temperature=-1)),
    Case(
        "chat_conflicting_limits",
        400,
        "invalid_value",
        "max_tokens",
        path=CHAT,
        json=chat(max_tokens=5, max_completion_tokens=6),
    ),
    Case(
        "chat_content_wrong_type",
        400,
        "invalid_type",
        "messages[0].content",
        path=CHAT,
        json=chat(messages=[{"role": "user", "content": 5}]),
    ),
    Case(
        "chat_tool_call_without_id",
        400,
        "missing_required_parameter",
        "messages[0].tool_calls[0].id",
        path=CHAT,
        json=chat(
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        ),
    ),
    Case(
        "chat_stop_too_long",
        400,
        "invalid_value",
        "stop",
        path=CHAT,
        json=chat(stop="x" * 300),
    ),
    Case(
        "chat_forced_unknown_tool",
        400,
        "invalid_value",
        "tool_choice",
        path=CHAT,
        json=chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
    ),
    Case(
        "chat_response_format_bad_schema",
        400,
        "invalid_json_schema",
        "response_format.json_schema.schema",
        path=CHAT,
        json=chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
        ),
    ),
    # `function` is a field of a chat tool, tool call and tool_choice (a union tag in Responses).
    Case(
        "chat_tool_bad_name",
        400,
        "invalid_value",
        "tools[0].function.name",
        path=CHAT,
        json=chat(tools=[{"type": "function", "function": {"name": "bad name"}}]),
    ),
    Case(
        "chat_tool_without_function",
        400,
        "missing_required_parameter",
        "tools[0].function",
        path=CHAT,
        json=chat(tools=[{"type": "function"}]),
    ),
    Case(
        "chat_tool_choice_without_name",
        400,
        "missing_required_parameter",
        "tool_choice.function.name",
        path=CHAT,
        json=chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {}},
        ),
    ),
    Case(
        "chat_tool_call_arguments_object",
        400,
        "invalid_type",
        "messages[0].tool_calls[0].function.arguments",
        path=CHAT,
        json=chat(
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
                    ],
                }
            ]
        ),
    ),
    Case("chat_wrong_method", 405, None, None, method="GET", path=CHAT),
    Case("unknown_route", 404, None, None, method="GET", path="/v1/nothing-here"),
    Case("wrong_method", 405, None, None, method="PUT", path="/v1/responses"),
    Case("wrong_method_on_id", 405, None, None, method="PATCH", path=f"/v1/responses/{STORED}"),
]


@pytest.fixture(scope="module")
def limited(gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path) -> Iterator[Stack]:
    """An API (inline post-processing) with small limits: the matrix's own."""
    env = {
        **base_env,
        "RESQ_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
        "RESQ_MAX_OUTPUT_TOKENS_CAP": str(OUTPUT_TOKENS_CAP),
    }
    started = start_stack(env, log_dir, 0, "limits")
    try:
        yield started
    finally:
        started.group.stop_all()


@pytest.fixture(scope="module")
def stored(limited: Stack) -> tuple[str, bytes]:
    """A response stored before the matrix: its id and its JSON as retrieved then."""
    response = limited.client().responses.create(model=MODEL, input="Say hello.", temperature=0)
    assert response.status == "completed"
    reply = httpx.get(f"{limited.base_url}/v1/responses/{response.id}", timeout=30)
    assert reply.status_code == 200
    return response.id, reply.content


def send(base_url: str, case: Case, stored_id: str) -> httpx.Response:
    """Send ``case`` as it is (a chunked body when it has ``content`` and no ``json``)."""
    url = base_url + case.path.replace(STORED, stored_id)
    with httpx.Client(timeout=60) as http:
        if case.json is not None:
            return http.request(case.method, url, json=case.json, params=case.params, headers=case.headers)
        if case.content:
            # A generator body goes out chunked: no Content-Length for the server to check first.
            headers = {"Content-Type": "application/json", **case.headers}
            return http.request(
                case.method, url, content=_chunks(case.content), params=case.params, headers=headers
            )
        headers = (
            {"Content-Type": "application/json", **case.headers} if case.content == b"" else case.headers
        )
        return http.request(case.method, url, content=case.content, params=case.params, headers=headers)


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_a_compressed_request_is_served(limited: Stack, encoding: str) -> None:
    """Codex CLI sends its request bodies zstd-compressed."""
    plain = json.dumps({"model": MODEL, "input": "Say hello.", "temperature": 0}).encode()
    compressed = zstandard.ZstdCompressor().compress(plain) if encoding == "zstd" else gzip.compress(plain)
    reply = httpx.post(
        f"{limited.base_url}/v1/responses",
        content=compressed,
        headers={"Content-Type": "application/json", "Content-Encoding": encoding},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert Response.model_validate(reply.json()).output_text == scenario("hello").completion


def test_a_websocket_message_over_the_body_limit_closes_the_socket_with_1009(limited: Stack) -> None:
    """A WebSocket message is a request body: one under the limit is answered (here, a 400 error
    event, the socket still open); one over it is not read whole: the socket closes, 1009."""
    url = limited.base_url.replace("http://", "ws://") + "/v1/responses"
    filler = "x" * (MAX_BODY_BYTES - 200)
    with websockets.sync.client.connect(url, max_size=None) as socket:
        socket.send(
            json.dumps({"type": "response.create", "model": MODEL, "input": filler, "temperature": 7})
        )
        refused = json.loads(socket.recv(timeout=30))
        assert (refused["type"], refused["error"]["param"]) == ("error", "temperature"), refused
        socket.send(json.dumps({"type": "response.create", "model": MODEL, "input": filler + "x" * 400}))
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            socket.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


def test_matrix_has_enough_cases() -> None:
    assert len(CASES) >= 30
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_gets_its_error_and_harms_nothing(
    limited: Stack, stored: tuple[str, bytes], case: Case
) -> None:
    stored_id, stored_json = stored
    reply = send(limited.base_url, case, stored_id)
    assert reply.status_code == case.status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and not error["message"].endswith(".."), error["message"]
    # A message template's placeholders are filled (pydantic's templates know no "!r").
    assert "!r}" not in error["message"] and "{kind" not in error["message"], error["message"]
    assert (error["type"], error["code"], error["param"]) == (case.type, case.code, case.param), error

    # The service is unharmed: a normal request succeeds, the stored response is as it was.
    response = limited.client().responses.create(model=MODEL, input="Say hello.", temperature=0)
    assert response.status == "completed"
    assert response.output_text == scenario("hello").completion
    again = httpx.get(f"{limited.base_url}/v1/responses/{stored_id}", timeout=30)
    assert again.status_code == 200 and again.content == stored_json


HOSTILE_ARGUMENTS = {
    # Nested past Python's recursion limit; 2,002 tokens, over the fixture model's 1,024.
    "deep": "[" * 1001 + "]" * 1001,
    # Escaped, so the body's own surrogate check passes it.
    "lone-surrogate": '{"a": "\\ud800"}',
}
"""A call's ``arguments`` text that took every endpoint rendering it to a 500 (and a conversation
storing it to a 500 on every later turn): now rendered as the text sent."""


@pytest.mark.parametrize("name", list(HOSTILE_ARGUMENTS))
def test_a_calls_arguments_text_is_rendered_as_sent_wherever_it_comes_in(limited: Stack, name: str) -> None:
    client = limited.client()
    arguments = HOSTILE_ARGUMENTS[name]
    fits = name != "deep"
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    items: list[Any] = [{"role": "user", "content": "Say hello."}, call, output]
    chat_messages: list[Any] = [
        {"role": "user", "content": "Say hello."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    counted = client.responses.input_tokens.count(model=MODEL, input=items).input_tokens
    assert counted > (1024 if not fits else 0)
    if fits:
        response = client.responses.create(model=MODEL, input=items, max_output_tokens=4)
        assert response.status in ("completed", "incomplete")
        completion = client.chat.completions.create(
            model=MODEL, max_completion_tokens=4, messages=chat_messages
        )
        assert completion.choices[0].finish_reason in ("stop", "length")
    else:
        # Rendered, it is simply too long for this model: the 400 any long prompt gets.
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.responses.create(model=MODEL, input=items, max_output_tokens=4)
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.chat.completions.create(model=MODEL, max_completion_tokens=4, messages=chat_messages)
    # Stored in a conversation, it no longer fails every later turn of it.
    conversation = client.conversations.create(items=items)
    for _ in range(2):
        turn = client.responses.create(
            model=MODEL,
            input="Say hello.",
            conversation=conversation.id,
            max_output_tokens=4,
            truncation="auto",
        )
        assert turn.status in ("completed", "incomplete")


def _wait_for_no_generations(redis_url: str, timeout_s: float = 90.0) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while client.zcard("resq:generations") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.zcard("resq:generations") == 0, "generations of earlier tests still listed"
    finally:
        client.close()


def test_a_response_deleted_or_dropped_while_it_generates_frees_its_slot_at_once(
    gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path, redis_url: str
) -> None:
    """``RESQ_MAX_PENDING=2``, filled by a background response that is then deleted and an unstored
    stream whose client leaves: both slots free within a publish round or two (they once stayed
    taken for the reaper's 60 s grace, every new request a 429 meanwhile)."""
    api = start_stack({**base_env, "RESQ_MAX_PENDING": "2"}, log_dir, 0, "freed-slots")
    try:
        _wait_for_no_generations(redis_url)
        client = api.client()
        endless = {"model": MODEL, "input": "Repeat forever.", "temperature": 0, "max_output_tokens": 960}
        deleted = client.responses.create(background=True, **endless).id
        with httpx.stream(
            "POST",
            f"{api.base_url}/v1/responses",
            json={**endless, "stream": True, "store": False},
            timeout=30,
        ) as dropped:
            for line in dropped.iter_lines():
                if "output_text.delta" in line:
                    break  # generating: the client leaves
        wait_until(
            lambda: client.responses.retrieve(deleted).status == "in_progress", 30, "the deleted one to start"
        )
        client.responses.delete(deleted)
        _wait_for_no_generations(redis_url, 15)
        response = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
        assert response.output_text == scenario("hello").completion
    finally:
        api.group.stop_all()


def test_past_max_pending_new_requests_get_429_with_retry_after(
    gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path, redis_url: str
) -> None:
    """Two endless generations fill ``RESQ_MAX_PENDING=2``; the third request waits for a free slot."""
    api = start_stack({**base_env, "RESQ_MAX_PENDING": "2"}, log_dir, 0, "backpressure")
    try:
        _wait_for_no_generations(redis_url)
        client = api.client()
        endless = {"model": MODEL, "input": "Repeat forever.", "temperature": 0, "max_output_tokens": 960}
        running = [client.responses.create(background=True, **endless).id for _ in range(2)]
        with pytest.raises(RateLimitError) as caught:
            client.responses.create(model=MODEL, input="Say hello.", temperature=0)
        assert caught.value.status_code == 429
        assert caught.value.response.headers["retry-after"] == "1"
        error = caught.value.body
        assert isinstance(error, dict)
        assert (error["type"], error["code"], error["param"]) == ("requests", "rate_limit_exceeded", None)
        # Streaming requests are refused the same way, before any event.
        reply = httpx.post(f"{api.base_url}/v1/responses", json={**endless, "stream": True}, timeout=30)
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"

        for response_id in running:
            # Incomplete only if it ran to its limit first (a stalled machine).
            assert client.responses.cancel(response_id).status in ("cancelled", "incomplete")
        _wait_for_no_generations(redis_url, 30)
        response = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
        assert response.output_text == scenario("hello").completion
    finally:
        api.group.stop_all()
