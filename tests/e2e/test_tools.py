"""Reasoning, function calling, tool_choice, logprobs and request validation, end to end.

The stack runs with ``RESQ_REASONING_PARSER=qwen3`` and ``RESQ_TOOL_PARSER=hermes``;
every test runs against both post-processing modes, with the strict SDK client.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI
from tokenizers import Tokenizer

from tests.e2e.conftest import MODEL, Stack
from tests.fixture_model import GET_WEATHER_TOOL, scenario
from tests.support.invariants import as_dict, check_stream, output_text
from tests.support.scenarios import scenario_tools

pytestmark = pytest.mark.e2e

MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|im_start|>")
TOOLS: list[dict[str, Any]] = scenario_tools(scenario("tool_call")) or []
WEATHER_PROMPT = "What is the weather in Paris?"


def stream(client: OpenAI, **request: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Stream a response; check the invariants and that no markup shows; return events and final."""
    with client.responses.create(model=MODEL, stream=True, **request) as events:
        collected = [as_dict(event) for event in events]
    final = check_stream(collected)
    assert_no_markup(collected, final)
    return collected, final


def create(client: OpenAI, **request: Any) -> dict[str, Any]:
    """A non-streaming response as a dict, checked for markup."""
    final = client.responses.create(model=MODEL, **request).model_dump(mode="json")
    assert_no_markup([], final)
    return final


def assert_no_markup(events: list[dict[str, Any]], final: dict[str, Any]) -> None:
    texts = [event.get("delta", "") for event in events if event["type"].endswith("text.delta")]
    texts += [event.get("text", "") for event in events if event["type"].endswith("text.done")]
    for item in final["output"]:
        if item["type"] in ("message", "reasoning"):
            texts += [part.get("text", "") for part in item["content"]]
    for text in texts:
        assert not any(tag in text for tag in MARKUP), f"markup leaked: {text!r}"


def calls(final: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (item["name"], json.loads(item["arguments"]))
        for item in final["output"]
        if item["type"] == "function_call"
    ]


def kinds(final: dict[str, Any]) -> list[str]:
    return [item["type"] for item in final["output"]]


def without_ids(final: dict[str, Any]) -> list[dict[str, Any]]:
    """The output items with their (per-response) ids left out."""
    return [
        {key: value for key, value in item.items() if key not in ("id", "call_id")}
        for item in final["output"]
    ]


# --- reasoning --------------------------------------------------------------------------------------


def test_reasoning_comes_before_the_message(client: OpenAI) -> None:
    events, final = stream(client, input="What is 2+2? Think first.", temperature=0)
    assert kinds(final) == ["reasoning", "message"]
    reasoning, message = final["output"]
    assert reasoning["id"].startswith("rs_") and message["id"].startswith("msg_")
    assert reasoning["summary"] == [] and reasoning["status"] == "completed"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Two plus two equals four."}]
    assert output_text(final) == "The answer is 4."
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] < final["usage"]["output_tokens"]

    item_events = [
        (event["type"], event.get("output_index"))
        for event in events
        if event["type"].startswith(("response.output_item", "response.content_part", "response.reasoning"))
    ]
    reasoning_deltas = sum(1 for kind, _ in item_events if kind == "response.reasoning_text.delta")
    assert reasoning_deltas >= 1
    assert item_events[:2] == [("response.output_item.added", 0), ("response.content_part.added", 0)]
    assert item_events[2 + reasoning_deltas : 6 + reasoning_deltas] == [
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
    ]
    plain = create(client, input="What is 2+2? Think first.", temperature=0)
    assert without_ids(plain) == without_ids(final) and plain["usage"] == final["usage"]


def test_reasoning_whose_close_tag_came_is_complete_when_the_limit_cuts_right_after_it(
    client: OpenAI,
) -> None:
    """The limit lands on the whitespace after </think>: the reasoning is whole. Its item stayed
    open until answer text came, and was closed incomplete."""
    whole = create(client, input="What is 2+2? Think first.", temperature=0)
    reasoning_tokens = whole["usage"]["output_tokens_details"]["reasoning_tokens"]
    for limit in (reasoning_tokens, reasoning_tokens + 1, reasoning_tokens + 2):
        cut = create(client, input="What is 2+2? Think first.", temperature=0, max_output_tokens=limit)
        assert cut["status"] == "incomplete"
        reasoning = cut["output"][0]
        assert reasoning["type"] == "reasoning", cut["output"]
        if reasoning["content"][0]["text"] == "Two plus two equals four.":
            assert reasoning["status"] == "completed", (limit, cut["output"])
    last = create(
        client, input="What is 2+2? Think first.", temperature=0, max_output_tokens=reasoning_tokens + 2
    )
    assert last["output"][0]["status"] == "completed"


def test_reasoning_effort_is_echoed_and_none_is_refused_without_a_template_switch(client: OpenAI) -> None:
    final = create(client, input="What is 2+2? Think first.", temperature=0, reasoning={"effort": "high"})
    assert final["reasoning"]["effort"] == "high"
    assert kinds(final) == ["reasoning", "message"]
    # The fixture's chat template has no enable_thinking switch: reasoning cannot be turned off.
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Say hello.", reasoning={"effort": "none"})
    assert caught.value.body["param"] == "reasoning.effort"  # type: ignore[index]
    assert caught.value.body["code"] == "unsupported_parameter"  # type: ignore[index]


# --- function calls ---------------------------------------------------------------------------------


def test_one_call_streamed_and_final(client: OpenAI) -> None:
    events, final = stream(client, input=WEATHER_PROMPT, tools=TOOLS, temperature=0)
    assert kinds(final) == ["function_call"]
    call = final["output"][0]
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert call["status"] == "completed"
    assert calls(final) == [("get_weather", {"city": "Paris"})]
    assert output_text(final) == ""

    added = [event for event in events if event["type"] == "response.output_item.added"]
    assert added[0]["item"]["type"] == "function_call" and added[0]["item"]["arguments"] == ""
    done = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0]["name"] == "get_weather"
    assert json.loads(done[0]["arguments"]) == {"city": "Paris"}
    assert final["tools"][0]["name"] == "get_weather" and final["tool_choice"] == "auto"

    plain = create(client, input=WEATHER_PROMPT, tools=TOOLS, temperature=0)
    assert plain["output"][0]["arguments"] == call["arguments"]


def test_two_calls_are_both_reported(client: OpenAI) -> None:
    _, final = stream(client, input="What is the weather in Paris and Rome?", tools=TOOLS, temperature=0)
    assert calls(final) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert kinds(final) == ["function_call", "function_call"]
    assert len({item["call_id"] for item in final["output"]}) == 2


def test_text_then_call_closes_the_message_before_the_call(client: OpenAI) -> None:
    events, final = stream(client, input="Check the weather in Oslo.", tools=TOOLS, temperature=0)
    assert kinds(final) == ["message", "function_call"]
    assert output_text(final) == "Let me check.\n"
    assert calls(final) == [("get_weather", {"city": "Oslo"})]
    order = [(event["type"], event.get("output_index")) for event in events]
    assert order.index(("response.output_item.done", 0)) < order.index(("response.output_item.added", 1))


def test_the_tool_loop_continues_when_the_items_are_resent(client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=WEATHER_PROMPT, tools=TOOLS, temperature=0)
    call = first.output[0]
    assert call.type == "function_call"
    resent = [
        {"role": "user", "content": WEATHER_PROMPT},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "22C and sunny"},
    ]
    _, second = stream(client, input=resent, tools=TOOLS, temperature=0)
    assert output_text(second) == scenario("after_tool_result").completion
    assert calls(second) == []


def test_the_tool_loop_continues_from_previous_response_id(client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=WEATHER_PROMPT, tools=TOOLS, temperature=0)
    call = first.output[0]
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22C and sunny"}
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=[result], tools=TOOLS, temperature=0
    )
    assert second.output_text == scenario("after_tool_result").completion
    # The tiny model may answer the tool result alone the same way: the prompt must be the whole
    # conversation, exactly as when the items are resent.
    resent = [
        {"role": "user", "content": WEATHER_PROMPT},
        *[item.model_dump(exclude_none=True) for item in first.output],
        result,
    ]
    whole = client.responses.create(model=MODEL, input=resent, tools=TOOLS, temperature=0)
    assert second.usage is not None and whole.usage is not None
    assert second.usage.input_tokens == whole.usage.input_tokens


def test_strict_tools_are_accepted_and_echoed(client: OpenAI) -> None:
    strict_tools = [{**TOOLS[0], "strict": True}]
    final = create(client, input=WEATHER_PROMPT, tools=strict_tools, temperature=0)
    assert calls(final) == [("get_weather", {"city": "Paris"})]
    assert final["tools"][0]["strict"] is True


# --- tool_choice and parallel_tool_calls ------------------------------------------------------------


def test_tool_choice_none_offers_no_tools(client: OpenAI) -> None:
    _, final = stream(client, input=WEATHER_PROMPT, tools=TOOLS, tool_choice="none", temperature=0)
    # Without tools in the prompt the model answers as it does when none exist.
    assert output_text(final) == scenario("no_tools_weather").completion
    assert kinds(final) == ["message"]
    assert final["tool_choice"] == "none"


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_forced_calls_are_constrained_and_parsed_whole(client: OpenAI, tool_choice: Any) -> None:
    """A forced choice is a grammar of calls (the GPU worker constrains decoding): the model writes
    the call itself, so the usage is the free request's (no opening prefilled into the prompt)."""
    free = create(client, input=WEATHER_PROMPT, tools=TOOLS, temperature=0)
    _, forced = stream(client, input=WEATHER_PROMPT, tools=TOOLS, tool_choice=tool_choice, temperature=0)
    assert calls(forced) == calls(free) == [("get_weather", {"city": "Paris"})]
    assert forced["tool_choice"] == tool_choice
    assert forced["usage"]["input_tokens"] == free["usage"]["input_tokens"]
    assert forced["usage"]["output_tokens"] == free["usage"]["output_tokens"]


NOT_STRICT_ANSWER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "Answer",
    "description": "Answer the question.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
"""LangChain's ``with_structured_output(method="function_calling")``: a tool the fixture never saw,
not strict, forced by name."""


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "Answer"}], ids=["required", "named"]
)
def test_a_forced_tool_that_is_not_strict_always_comes_back_as_a_call(
    client: OpenAI, tool_choice: Any
) -> None:
    """Prefilled, a model that wrote no JSON object after the opening answered "completed" with the
    call's markup as its text and no call (LangChain then returned None as the parsed answer)."""
    response = create(
        client,
        input="Which city is the capital of France?",
        tools=[NOT_STRICT_ANSWER_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=200,
    )
    # The fixture never saw this tool: it may reason on until the limit (the grammar lets reasoning
    # come first), but what it answers can only be the call.
    assert "message" not in kinds(response) and "<tool_call>" not in output_text(response), response["output"]
    answered = [item for item in response["output"] if item["type"] != "reasoning"]
    if response["status"] == "completed":
        assert [item["type"] for item in answered] == ["function_call"], response["output"]
        assert answered[0]["name"] == "Answer" and isinstance(json.loads(answered[0]["arguments"]), dict)
    else:
        assert response["status"] == "incomplete" and answered == [], response["output"]


def test_required_with_several_tools_forces_a_call_of_any(client: OpenAI) -> None:
    two_tools = [*TOOLS, {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
    response = create(
        client,
        input=WEATHER_PROMPT,
        tools=two_tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=200,
    )
    # Two tools put the prompt outside what the fixture learnt: whatever it writes is a call.
    assert kinds(response) == ["function_call"], response["output"]
    assert response["output"][0]["name"] in ("get_weather", "get_time")


def test_parallel_tool_calls_false_gives_one_call_and_stops(client: OpenAI) -> None:
    prompt = "What is the weather in Paris and Rome?"
    both = create(client, input=prompt, tools=TOOLS, temperature=0)
    _, one = stream(client, input=prompt, tools=TOOLS, temperature=0, parallel_tool_calls=False)
    assert calls(one) == [("get_weather", {"city": "Paris"})]
    assert one["parallel_tool_calls"] is False and one["status"] == "completed"
    # Generation stopped at the first call's closing tag (a single token).
    assert one["usage"]["output_tokens"] < both["usage"]["output_tokens"] // 2 + 2


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice"),
    ],
)
def test_impossible_tool_choices_are_refused(stack: Stack, request_body: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": WEATHER_PROMPT, **request_body}
    reply = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


# --- logprobs ---------------------------------------------------------------------------------------


def test_logprobs_on_text_parts_and_deltas(client: OpenAI, fixture_model_dir: Any) -> None:
    include = ["message.output_text.logprobs"]
    events, final = stream(client, input="Say hello.", temperature=0, include=include)
    text = output_text(final)
    assert text == scenario("hello").completion
    logprobs = final["output"][0]["content"][0]["logprobs"]
    tokenizer = Tokenizer.from_file(str(fixture_model_dir / "tokenizer.json"))
    expected_tokens = tokenizer.encode(text, add_special_tokens=False).ids
    assert [entry["token"] for entry in logprobs] == [tokenizer.decode([token]) for token in expected_tokens]
    assert b"".join(bytes(entry["bytes"]) for entry in logprobs).decode() == text
    assert all(entry["logprob"] <= 0 and entry["top_logprobs"] == [] for entry in logprobs)
    streamed = [
        (entry["token"], entry["logprob"])
        for event in events
        if event["type"] == "response.output_text.delta"
        for entry in event["logprobs"]
    ]
    assert streamed == [(entry["token"], entry["logprob"]) for entry in logprobs]
    assert final["top_logprobs"] == 0

    plain = create(client, input="Say hello.", temperature=0)
    assert plain["output"][0]["content"][0]["logprobs"] == []


def check_alternatives(entries: list[dict[str, Any]], count: int, *, greedy: bool) -> None:
    """Each entry lists ``count`` alternatives, most likely first, its own token first when greedy."""
    assert entries
    for entry in entries:
        tops = entry["top_logprobs"]
        values = [top["logprob"] for top in tops]
        assert len(tops) == count and values == sorted(values, reverse=True) and values[0] <= 0
        assert math.fsum(math.exp(value) for value in values) <= 1 + 1e-4
        assert entry["logprob"] <= values[0] + 1e-4
        if greedy:
            assert (tops[0]["token"], tops[0]["bytes"]) == (entry["token"], entry["bytes"])
            assert tops[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)


def test_top_logprobs_list_each_positions_most_likely_tokens(client: OpenAI) -> None:
    """What the Vercel AI SDK sends for ``providerOptions.openai.logprobs: true``: top_logprobs 20 with
    the logprobs include (it was a 400)."""
    include = ["message.output_text.logprobs"]
    events, final = stream(client, input="Say hello.", temperature=0, include=include, top_logprobs=20)
    assert output_text(final) == scenario("hello").completion and final["top_logprobs"] == 20
    logprobs = final["output"][0]["content"][0]["logprobs"]
    check_alternatives(logprobs, 20, greedy=True)
    # The deltas carry the same alternatives without their bytes, as the SDK types them.
    streamed = [
        entry
        for event in events
        if event["type"] == "response.output_text.delta"
        for entry in event["logprobs"]
    ]
    assert [entry["top_logprobs"] for entry in streamed] == [
        [{"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]]
        for entry in logprobs
    ]
    drawn = create(
        client, input="Say hello.", temperature=1.0, include=include, top_logprobs=2, max_output_tokens=24
    )
    messages = [item for item in drawn["output"] if item["type"] == "message"]
    check_alternatives(messages[0]["content"][0]["logprobs"], 2, greedy=False)
    # Without the include there are no logprobs to list them on.
    plain = create(client, input="Say hello.", temperature=0, top_logprobs=5)
    assert plain["output"][0]["content"][0]["logprobs"] == [] and plain["top_logprobs"] == 5


def test_logprobs_cover_only_the_answer_text(client: OpenAI) -> None:
    include = ["message.output_text.logprobs"]
    _, final = stream(client, input="Say something in Japanese.", temperature=0, include=include)
    logprobs = final["output"][0]["content"][0]["logprobs"]
    # Byte-level tokens may each hold part of a character: their bytes still add up to the text.
    assert b"".join(bytes(entry["bytes"]) for entry in logprobs).decode() == scenario("unicode").completion

    _, reasoned = stream(client, input="What is 2+2? Think first.", temperature=0, include=include)
    answer = reasoned["output"][1]["content"][0]
    assert answer["text"] == "The answer is 4."
    assert answer["logprobs"]
    tokens = "".join(entry["token"] for entry in answer["logprobs"])
    assert "The answer is 4." in tokens and "Two" not in tokens and "think" not in tokens


# --- what resq does not serve -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"include": ["no.such.thing"]}, "include", "invalid_value"),
        ({"top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"truncation": "sometimes"}, "truncation", "invalid_value"),
        ({"reasoning": {"summary": "brief"}}, "reasoning.summary", "invalid_value"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid_value"),
        ({"tools": [{"type": "teleport"}]}, "tools[0].type", "invalid_value"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice.type", "unsupported_parameter"),
        ({"presence_penalty": -3}, "presence_penalty", "invalid_value"),
        (
            {"tools": [{**GET_WEATHER_TOOL["function"], "type": "function", "defer_loading": True}]},
            "tools[0].defer_loading",
            "unsupported_parameter",
        ),
        (
            {"tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}},
            "tool_choice",
            "invalid_value",
        ),
        ({"conversation": "conv_1"}, "conversation", "invalid_value"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
    ],
)
def test_what_resq_does_not_serve_gets_a_400_naming_it(
    stack: Stack, extra: dict[str, Any], param: str, code: str
) -> None:
    body = {"model": MODEL, "input": "Say hello.", **extra}
    reply = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_metadata_within_the_limits_is_echoed(client: OpenAI) -> None:
    metadata = {f"k{i}" + "x" * 60: "v" * 512 for i in range(16)}
    final = create(client, input="Say hello.", temperature=0, metadata=metadata)
    assert final["metadata"] == metadata
