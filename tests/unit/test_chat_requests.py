"""A chat completion request as the Responses request it means (``api/chat.py``), and its metrics."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from api import metrics
from api.chat import completion_id, extras, in_chat_terms, responses_request
from api.chat_schemas import ChatCompletionRequest
from api.errors import OpenAIError, validation_error_to_openai
from api.schemas import LOGPROBS_INCLUDE


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    )


def test_messages_become_input_items_in_order() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Dev."}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "thinking",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "assistant", "content": "It is 42."},
        ]
    )
    translated = responses_request(request)
    assert translated.store is False and translated.stream is False
    items = [item.model_dump(exclude_none=True) for item in translated.input or []]
    assert items == [
        {"type": "message", "role": "system", "content": "Be brief."},
        {"type": "message", "role": "developer", "content": "Dev."},
        {"type": "message", "role": "user", "content": "ab"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "thinking"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 42."}]},
    ]


def test_parameters_map_to_their_responses_names() -> None:
    request = chat(
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        parallel_tool_calls=False,
        tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
        ],
        tool_choice={"type": "function", "function": {"name": "f"}},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
        reasoning_effort="low",
        logprobs=True,
        stop=["x", "y"],
        stream=True,
        stream_options={"include_usage": True},
        prompt_cache_key="k",
        n=1,
        seed=3,
    )
    translated = responses_request(request)
    assert translated.max_output_tokens == 7
    assert (translated.temperature, translated.top_p) == (0.5, 0.9)
    assert (translated.presence_penalty, translated.frequency_penalty) == (0.1, 0.2)
    assert translated.parallel_tool_calls is False
    assert translated.stream is True and translated.prompt_cache_key == "k"
    assert [tool.model_dump(exclude_none=True) for tool in translated.tools or []] == [
        {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    ]
    assert translated.tool_choice is not None and translated.tool_choice.model_dump() == {  # type: ignore[union-attr]
        "type": "function",
        "name": "f",
    }
    assert translated.text is not None and translated.text.format is not None
    assert translated.text.format.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema",
        "name": "a",
        "schema": {"type": "object"},
    }
    assert translated.reasoning is not None and translated.reasoning.effort == "low"
    assert translated.include == [LOGPROBS_INCLUDE]
    assert extras(request).stop == ("x", "y") and extras(request).include_usage is True


def test_max_tokens_alone_and_equal_limits_are_fine_and_different_ones_a_400() -> None:
    assert responses_request(chat(max_tokens=5)).max_output_tokens == 5
    assert responses_request(chat(max_tokens=5, max_completion_tokens=5)).max_output_tokens == 5
    with pytest.raises(OpenAIError) as raised:
        responses_request(chat(max_tokens=5, max_completion_tokens=6))
    assert raised.value.param == "max_tokens"


def test_stream_options_come_only_with_a_stream() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    for not_streaming in ({}, {"stream": False}, {"stream": None}):
        with pytest.raises(ValidationError) as raised:
            chat(stream_options={"include_usage": True}, **not_streaming)
        error = validation_error_to_openai(raised.value.errors())
        assert (error.status_code, error.param, error.code) == (400, "stream_options", "invalid_value")
        assert error.message == (
            "Invalid value for 'stream_options': it is only allowed when 'stream' is true."
        )


def test_a_tool_result_answering_no_call_names_the_message() -> None:
    request = chat(
        messages=[{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "zz", "content": "x"}]
    )
    with pytest.raises(OpenAIError) as raised:
        responses_request(request)
    assert raised.value.status_code == 400
    assert raised.value.param == "messages[1].tool_call_id"


@pytest.mark.parametrize(
    ("responses_param", "chat_param"),
    [
        ("input[3].content", "messages[3].content"),
        ("input", "messages"),
        ("max_output_tokens", "max_tokens"),
        ("text.format.name", "response_format.json_schema.name"),
        ("text", "response_format"),
        # A chat tool is a function tool whose fields sit under `function`.
        ("tools[0].name", "tools[0].function.name"),
        ("tools[1]", "tools[1]"),
        ("textual", "textual"),
        (None, None),
    ],
)
def test_a_translated_error_names_the_chat_parameter(
    responses_param: str | None, chat_param: str | None
) -> None:
    error = in_chat_terms(OpenAIError(400, "bad", param=responses_param, code="invalid_value"), CHAT)
    assert (error.param, error.message, error.code, error.status_code) == (
        chat_param,
        "bad",
        "invalid_value",
        400,
    )


CHAT = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def test_a_translated_message_names_the_limit_as_sent_and_gives_no_responses_advice() -> None:
    sent = ChatCompletionRequest.model_validate(
        {**CHAT.model_dump(exclude_none=True), "max_completion_tokens": 40000}
    )
    too_many = in_chat_terms(
        OpenAIError(400, "Invalid 'max_output_tokens': 40000 is more than 4096.", param="max_output_tokens"),
        sent,
    )
    assert (too_many.param, too_many.message) == (
        "max_completion_tokens",
        "Invalid 'max_completion_tokens': 40000 is more than 4096.",
    )
    too_long = in_chat_terms(
        OpenAIError(
            400,
            "Too long. Please reduce the input or max_output_tokens, or send truncation 'auto'.",
            code="context_length_exceeded",
        ),
        CHAT,
    )
    assert too_long.message == "Too long. Please reduce the input or max_tokens."
    no_switch = in_chat_terms(
        OpenAIError(400, "reasoning.effort 'none' cannot be honoured.", param="reasoning.effort"), CHAT
    )
    assert (no_switch.param, no_switch.message) == (
        "reasoning_effort",
        "reasoning_effort 'none' cannot be honoured.",
    )
    too_many_items = in_chat_terms(
        OpenAIError(
            400,
            "The input has 4101 items; at most 4096 are allowed (compact or truncate the conversation).",
            param="input",
        ),
        CHAT,
    )
    assert (too_many_items.param, too_many_items.message) == (
        "messages",
        "The messages make 4101 items; at most 4096 are allowed (shorten the conversation).",
    )


def test_completion_ids_follow_the_response_id() -> None:
    assert completion_id("resp_abc123") == "chatcmpl-abc123"


def _delivered(status: str, endpoint: str) -> float:
    value = REGISTRY.get_sample_value(
        "resq_responses_delivered_total", {"status": status, "endpoint": endpoint}
    )
    return value or 0.0


def test_delivered_completions_are_counted_by_endpoint() -> None:
    before = _delivered("completed", "chat_completions"), _delivered("failed", "chat_completions")
    responses_before = _delivered("completed", "responses")
    metrics.record_delivered(
        {"object": "chat.completion", "model": "m", "usage": {"completion_tokens": 3}, "choices": []}
    )
    metrics.record_delivered({"error": {"message": "x"}})
    assert _delivered("completed", "chat_completions") == before[0] + 1
    assert _delivered("failed", "chat_completions") == before[1] + 1
    assert _delivered("completed", "responses") == responses_before


def test_prompt_cache_options_and_breakpoints_carry_over_to_the_responses_request() -> None:
    breakpoint = {"mode": "explicit"}
    request = chat(
        messages=[
            {
                "role": "system",
                "content": [{"type": "text", "text": "Rules.", "prompt_cache_breakpoint": breakpoint}],
            },
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        prompt_cache_options={"mode": "explicit", "ttl": "12h"},
    )
    translated = responses_request(request)
    assert translated.prompt_cache_options is not None
    # The parts become plain text; the breakpoint among them keeps explicit caching on.
    assert translated.prompt_cache_options.echo() == {
        "mode": "implicit",
        "ttl": "12h",
        "comparison_response_id": None,
    }
    items = [item.model_dump(exclude_none=True) for item in translated.input or []]
    assert items[0]["content"] == "Rules." and items[1]["content"] == "ab"
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for role, extra in (("assistant", {}), ("tool", {"tool_call_id": "c1"})):
        part = {"type": "text", "text": "x", "prompt_cache_breakpoint": breakpoint}
        messages: list[dict[str, Any]] = [{"role": "user", "content": "q"}]
        if role == "tool":
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        explicit = chat(
            messages=[*messages, {"role": role, "content": [part], **extra}],
            prompt_cache_options={"mode": "explicit"},
        )
        options = responses_request(explicit).prompt_cache_options
        assert options is not None and options.mode == "implicit", role
    unmarked = responses_request(chat(prompt_cache_options={"mode": "explicit"})).prompt_cache_options
    assert unmarked is not None and unmarked.mode == "explicit"
