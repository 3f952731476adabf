"""``POST /v1/chat/completions`` over the wire, with the official SDK in strict mode.

Chat completions run through the same queue, GPU worker, post-processors and event
log as responses; these tests check what a Chat Completions client sees: the chunk
stream (role first, deltas, ``finish_reason``, the usage chunk, ``[DONE]``), the final
completion, tool calls and a tool loop, reasoning as ``reasoning_content``, logprobs,
stop sequences, ``response_format``, the 400s, and a client that hangs up. Every test
runs against both post-processing modes (the ``stack`` fixture).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
import redis
from openai import OpenAI
from pydantic import BaseModel
from tokenizers import Tokenizer

from resq import keys
from tests.e2e.conftest import MODEL, Stack
from tests.fixture_model import GET_WEATHER_TOOL, scenario
from tests.support.processes import RoleProcess, wait_until

pytestmark = pytest.mark.e2e

MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>")


def messages(name: str) -> list[dict[str, Any]]:
    """A fixture scenario's messages as Chat Completions messages (tool calls with ids)."""
    out: list[dict[str, Any]] = []
    call_ids: list[str] = []
    for message in scenario(name).messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                call_ids.append(f"call_{len(call_ids)}")
                arguments = call["function"]["arguments"]
                calls.append(
                    {
                        "id": call_ids[-1],
                        "type": "function",
                        "function": {"name": call["function"]["name"], "arguments": json.dumps(arguments)},
                    }
                )
            out.append({"role": "assistant", "content": message.get("content") or None, "tool_calls": calls})
        elif message["role"] == "tool":
            out.append({"role": "tool", "tool_call_id": call_ids.pop(0), "content": message["content"]})
        else:
            out.append(dict(message))
    return out


def stream_chunks(client: OpenAI, **request: Any) -> list[dict[str, Any]]:
    """A streamed completion's chunks, as dicts, checked for the order every stream must keep."""
    chunks = [
        chunk.model_dump(mode="json")
        for chunk in client.chat.completions.create(model=MODEL, stream=True, **request)
    ]
    check_chunks(chunks, include_usage=bool((request.get("stream_options") or {}).get("include_usage")))
    return chunks


def check_chunks(chunks: list[dict[str, Any]], include_usage: bool) -> None:
    """One id and object throughout, the role first, exactly one finish_reason, the usage last."""
    assert chunks, "no chunk"
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]}
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    with_choices = [chunk for chunk in chunks if chunk["choices"]]
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in with_choices]
    assert finishes[-1] is not None and all(reason is None for reason in finishes[:-1])
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] is not None
        assert all(chunk["usage"] is None for chunk in chunks[:-1])
    else:
        assert all(chunk["choices"] for chunk in chunks)
    for chunk in with_choices:
        for text in (chunk["choices"][0]["delta"].get(key) for key in ("content", "reasoning_content")):
            assert not any(tag in (text or "") for tag in MARKUP), f"markup leaked: {text!r}"


def content(chunks: list[dict[str, Any]]) -> str:
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])


def delta_field(chunks: list[dict[str, Any]], name: str) -> str:
    """A non-standard delta field (``reasoning_content``) concatenated over the chunks."""
    return "".join((chunk["choices"][0]["delta"].get(name) or "") for chunk in chunks if chunk["choices"])


def finish_reason(chunks: list[dict[str, Any]]) -> str:
    return [chunk for chunk in chunks if chunk["choices"]][-1]["choices"][0]["finish_reason"]


def test_a_completion_answers_like_the_responses_api(client: OpenAI) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=messages("hello"), temperature=0)
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == scenario("hello").completion
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    usage = completion.usage
    assert usage is not None and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    same = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
    assert same.output_text == choice.message.content
    assert same.usage is not None and same.usage.input_tokens == usage.prompt_tokens


def test_a_stream_adds_up_to_the_completion_and_ends_with_usage(client: OpenAI, stack: Stack) -> None:
    chunks = stream_chunks(
        client, messages=messages("count"), temperature=0, stream_options={"include_usage": True}
    )
    assert content(chunks) == scenario("count").completion
    assert len([chunk for chunk in chunks if chunk["choices"]]) > 5, "not streamed"
    assert finish_reason(chunks) == "stop"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0
    # The raw body: data lines only (no `event:`), ending with [DONE].
    body = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages("hello"), "stream": True, "temperature": 0},
        headers={"Authorization": "Bearer sk-test"},
        timeout=60,
    ).text
    frames = [frame for frame in body.split("\n\n") if frame.strip() and not frame.startswith(":")]
    assert all(frame.startswith("data: ") for frame in frames), frames[:3]
    assert frames[-1] == "data: [DONE]"


def test_max_tokens_cuts_with_finish_reason_length(client: OpenAI) -> None:
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        completion = client.chat.completions.create(
            model=MODEL, messages=messages("count"), temperature=0, **limit
        )
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None and completion.usage.completion_tokens == 3
    chunks = stream_chunks(client, messages=messages("count"), temperature=0, max_tokens=3)
    assert finish_reason(chunks) == "length"


def test_reasoning_is_reasoning_content(client: OpenAI) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=messages("reasoning"), temperature=0)
    message = completion.choices[0].message.model_dump()
    assert message["reasoning_content"] == "Two plus two equals four."
    assert message["content"] == "The answer is 4."
    usage = completion.usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens > 0
    chunks = stream_chunks(client, messages=messages("reasoning"), temperature=0)
    assert delta_field(chunks, "reasoning_content") == message["reasoning_content"]
    assert content(chunks) == "The answer is 4."


def test_a_tool_loop(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=messages("tool_call"), tools=[GET_WEATHER_TOOL], temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None
    # The call answered: the model sees the result and says what it was.
    follow_up = client.chat.completions.create(
        model=MODEL,
        messages=[
            *messages("tool_call"),
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "22C and sunny"},
        ],
        tools=[GET_WEATHER_TOOL],
        temperature=0,
    )
    assert follow_up.choices[0].message.content == scenario("after_tool_result").completion
    assert follow_up.choices[0].finish_reason == "stop"


def test_parallel_calls_stream_with_an_index_each(client: OpenAI) -> None:
    chunks = stream_chunks(
        client, messages=messages("two_tool_calls"), tools=[GET_WEATHER_TOOL], temperature=0
    )
    deltas = [
        call
        for chunk in chunks
        if chunk["choices"]
        for call in chunk["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert [call["index"] for call in deltas] == [0, 1]
    assert [json.loads(call["function"]["arguments"]) for call in deltas] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert len({call["id"] for call in deltas}) == 2
    assert finish_reason(chunks) == "tool_calls"
    one = client.chat.completions.create(
        model=MODEL,
        messages=messages("two_tool_calls"),
        tools=[GET_WEATHER_TOOL],
        temperature=0,
        parallel_tool_calls=False,
    )
    assert len(one.choices[0].message.tool_calls or []) == 1


def test_tool_choice_none_offers_no_tools_and_a_named_choice_forces_the_call(client: OpenAI) -> None:
    none = client.chat.completions.create(
        model=MODEL,
        messages=messages("tool_call"),
        tools=[GET_WEATHER_TOOL],
        tool_choice="none",
        temperature=0,
    )
    assert none.choices[0].message.content == scenario("no_tools_weather").completion
    assert none.choices[0].message.tool_calls is None
    free = client.chat.completions.create(
        model=MODEL, messages=messages("tool_call"), tools=[GET_WEATHER_TOOL], temperature=0
    )
    forced = client.chat.completions.create(
        model=MODEL,
        messages=messages("tool_call"),
        tools=[GET_WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    calls = forced.choices[0].message.tool_calls or []
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert forced.choices[0].finish_reason == "tool_calls"
    # The grammar forced the call: the model wrote it all, nothing was prefilled into the prompt.
    assert forced.usage is not None and free.usage is not None
    assert forced.usage.prompt_tokens == free.usage.prompt_tokens


def streamed_logprobs(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every logprob entry of a streamed completion's chunks, in order."""
    return [
        entry
        for chunk in chunks
        if chunk["choices"] and chunk["choices"][0]["logprobs"]
        for entry in chunk["choices"][0]["logprobs"]["content"]
    ]


def test_logprobs_cover_the_content_token_by_token(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=messages("hello"), temperature=0, logprobs=True
    )
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content
    assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
    chunks = stream_chunks(client, messages=messages("hello"), temperature=0, logprobs=True)
    streamed = streamed_logprobs(chunks)
    assert [entry["token"] for entry in streamed] == [entry.token for entry in choice.logprobs.content]


def check_alternatives(entry: dict[str, Any], count: int) -> None:
    """``count`` alternatives, most likely first, the (greedy) token itself first."""
    tops = entry["top_logprobs"]
    values = [top["logprob"] for top in tops]
    assert len(values) == count and values == sorted(values, reverse=True)
    assert (tops[0]["token"], tops[0]["bytes"]) == (entry["token"], entry["bytes"])
    assert tops[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)


def test_top_logprobs_list_each_positions_most_likely_tokens(client: OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=messages("hello"), temperature=0, logprobs=True, top_logprobs=3
    )
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    for entry in choice.logprobs.content:
        check_alternatives(entry.model_dump(), 3)
    chunks = stream_chunks(client, messages=messages("hello"), temperature=0, logprobs=True, top_logprobs=3)
    streamed = streamed_logprobs(chunks)
    # Another request: the same greedy tokens (its logprobs may round apart in another batch).
    assert [entry["token"] for entry in streamed] == [entry.token for entry in choice.logprobs.content]
    for streamed_entry in streamed:
        check_alternatives(streamed_entry, 3)


def test_stop_sequences_end_the_answer_before_them(client: OpenAI, fixture_model_dir: Path) -> None:
    full = scenario("count").completion  # "1 2 3 ... 20"
    completion = client.chat.completions.create(
        model=MODEL, messages=messages("count"), temperature=0, stop=[" 5", "never"]
    )
    assert completion.choices[0].message.content == full[: full.index(" 5")]
    assert completion.choices[0].finish_reason == "stop"
    # The usage counts the answer up to the stop, not what the GPU worker wrote before it was told
    # to stop (a stop of several tokens is found by the post-processor, which then stops it).
    early = client.chat.completions.create(
        model=MODEL, messages=messages("count"), temperature=0, stop="2 3 4"
    )
    assert early.choices[0].message.content == full[: full.index("2 3 4")] and early.usage is not None
    ids = (
        Tokenizer.from_file(str(fixture_model_dir / "tokenizer.json"))
        .encode(full, add_special_tokens=False)
        .ids
    )
    decode = Tokenizer.from_file(str(fixture_model_dir / "tokenizer.json")).decode
    through_stop = next(n for n in range(len(ids) + 1) if "2 3 4" in decode(ids[:n]))
    assert early.usage.completion_tokens == through_stop, (early.usage, through_stop)
    chunks = stream_chunks(client, messages=messages("count"), temperature=0, stop="7")
    assert content(chunks) == full[: full.index("7")]
    assert finish_reason(chunks) == "stop"


@pytest.mark.parametrize("stop", [".", "Rome"])
def test_a_stop_string_of_one_token_passes_reasoning_and_calls(client: OpenAI, stop: str) -> None:
    """Stop strings are searched in the answer only, whatever their tokens: one that was a whole
    token of the vocabulary stopped the engine itself, in reasoning and in a tool call's markup."""
    reasoned = client.chat.completions.create(
        model=MODEL, messages=messages("reasoning"), temperature=0, stop=stop
    ).choices[0]
    assert reasoned.message.model_dump()["reasoning_content"] == "Two plus two equals four."
    answer = "The answer is 4."
    assert reasoned.message.content == (answer[: answer.index(stop)] if stop in answer else answer)
    called = client.chat.completions.create(
        model=MODEL, messages=messages("two_tool_calls"), tools=[GET_WEATHER_TOOL], temperature=0, stop=stop
    ).choices[0]
    assert called.finish_reason == "tool_calls" and not called.message.content
    calls = called.message.tool_calls or []
    assert [json.loads(call.function.arguments)["city"] for call in calls] == ["Paris", "Rome"]  # type: ignore[union-attr]


class Answer(BaseModel):
    answer: Literal[4]


def test_response_format_json_schema_and_parse(client: OpenAI) -> None:
    parsed = client.chat.completions.parse(
        model=MODEL, messages=messages("reasoning"), temperature=0, response_format=Answer
    )
    assert parsed.choices[0].message.parsed == Answer(answer=4)
    loose = client.chat.completions.create(
        model=MODEL,
        messages=messages("reasoning"),
        temperature=0,
        max_tokens=120,
        response_format={"type": "json_object"},
    )
    text = loose.choices[0].message.content or ""
    if loose.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize(
    ("request_body", "param", "code"),
    [
        ({"n": 2}, "n", "unsupported_parameter"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"metadata": {"a": "b"}}, "metadata", "unsupported_parameter"),
        ({"logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),  # without logprobs: true
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"messages": []}, "messages", "invalid_value"),
        (
            {"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]},
            "messages[0].tool_call_id",
            "invalid_value",
        ),
        (
            {"messages": [{"role": "function", "name": "f", "content": "x"}]},
            "messages[0].role",
            "unsupported_parameter",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
                ]
            },
            "messages[0].content[0].type",
            "unsupported_parameter",
        ),
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
            "response_format.json_schema.name",
            "invalid_value",
        ),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "invalid_value"),
    ],
)
def test_bad_requests_are_400s_naming_the_parameter(
    stack: Stack, request_body: dict[str, Any], param: str, code: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **request_body}
    answer = httpx.post(
        f"{stack.base_url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-test"}
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["code"] == code, error


def test_an_unknown_model_is_a_404_through_the_sdk(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert raised.value.code == "model_not_found"


def test_a_client_that_hangs_up_cancels_the_generation(
    stack: Stack, redis_url: str, gpu_worker: RoleProcess
) -> None:
    r = redis.Redis.from_url(redis_url)
    completion_id = None
    with httpx.stream(
        "POST",
        f"{stack.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages("endless"), "stream": True, "max_tokens": 600},
        headers={"Authorization": "Bearer sk-test"},
        timeout=60,
    ) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                completion_id = chunk["id"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    break
    assert completion_id is not None
    response_id = "resp_" + completion_id.removeprefix("chatcmpl-")
    # Unstored: once the client left, its keys go, and the cancel flag stops the GPU worker.
    wait_until(lambda: not r.exists(keys.record(response_id)), 30, "the completion's keys to go")
    # The GPU worker stops at its next step: its claim went with the keys (or the flag says so).
    pattern = re.compile(rf"(cancelled|no longer own) {response_id}")
    wait_until(lambda: pattern.search(gpu_worker.log_tail(2000)) is not None, 30, "the generation to stop")
    assert "generation ended: length, 600 tokens" not in gpu_worker.log_tail(2000)


def test_a_seed_reproduces_a_sampled_completion(client: OpenAI) -> None:
    request: dict[str, Any] = {"messages": messages("count"), "temperature": 1.8, "max_tokens": 24}
    first = client.chat.completions.create(model=MODEL, seed=7, **request).choices[0].message.content
    again = client.chat.completions.create(model=MODEL, seed=7, **request).choices[0].message.content
    streamed = content(stream_chunks(client, seed=7, **request))
    assert first == again == streamed
    others = {
        client.chat.completions.create(model=MODEL, seed=seed, **request).choices[0].message.content
        for seed in range(8, 12)
    }
    assert others - {first}, "every seed drew the same completion"
