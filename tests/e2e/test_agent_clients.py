"""What agent clients send, end to end: the official SDK shaped like Codex and the Vercel AI SDK,
and openai-agents and LangChain themselves, against the real stack and the fixture model.

- item_reference (the Vercel AI SDK's default ``store: true`` follow-up turn);
- ``include: ["reasoning.encrypted_content"]`` with ``store: false`` (Codex, openai-agents):
  the blob comes back, restores the reasoning, and a tampered one is a 400 naming the item;
- hosted tools and ``client_metadata`` (Codex's every turn), penalties, service tiers;
- reasoning summaries (what the Vercel AI SDK and LangChain show);
- streams ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import httpx
import litellm
import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    responses_websocket_session,
)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI, BadRequestError, OpenAI
from pydantic import BaseModel

from tests.e2e.conftest import MODEL, Stack
from tests.fixture_model import GET_WEATHER_TOOL, scenario
from tests.support.conformance import check_events
from tests.support.invariants import as_dict, check_stream, output_text
from tests.support.metrics import scrape, value
from tests.support.reasoning import (
    REASONING_PROMPT,
    REASONING_TEXT,
    reasoning_items,
    unstored_with_sealed_reasoning,
)
from tests.support.scenarios import scenario_tools

pytestmark = pytest.mark.e2e

TOOLS: list[dict[str, Any]] = scenario_tools(scenario("tool_call")) or []
WEATHER_PROMPT = "What is the weather in Paris?"
HOSTED_TOOLS: list[dict[str, Any]] = [
    {"type": "web_search", "external_web_access": False},
    {"type": "image_generation"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
]
CODEX_FIELDS: dict[str, Any] = {
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "reasoning": {"summary": "auto"},
    "prompt_cache_key": "session-1",
    "extra_body": {"client_metadata": {"originator": "codex_exec", "session": "s1"}},
}


# --- item_reference -------------------------------------------------------------------------------


def test_a_stored_turn_continues_from_item_references(client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0)
    assert first.output_text == scenario("introduce").completion
    message_id = first.output[-1].id
    second = client.responses.create(
        model=MODEL,
        temperature=0,
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"type": "item_reference", "id": message_id},
            {"role": "user", "content": "What is my name?"},
        ],
    )
    assert second.output_text == scenario("multi_turn").completion
    # The stored input shows the item the reference resolved to.
    listed = client.responses.input_items.list(second.id, order="asc").data
    assert listed[1].id == message_id and listed[1].type == "message"


def test_an_input_item_can_be_referenced_too(client: OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "My name is Ada.", "id": "msg_client_1"}]
    )
    second = client.responses.create(
        model=MODEL,
        temperature=0,
        input=[
            {"type": "item_reference", "id": "msg_client_1"},
            {"type": "item_reference", "id": first.output[-1].id},
            {"role": "user", "content": "What is my name?"},
        ],
    )
    assert second.output_text == scenario("multi_turn").completion


def test_an_item_reference_may_leave_its_type_out(client: OpenAI) -> None:
    """The SDK's ``ItemReference`` makes ``type`` optional: ``{"id": ...}`` alone is a reference."""
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0)
    for reference in ({"id": first.output[-1].id}, {"type": None, "id": first.output[-1].id}):
        second = client.responses.create(
            model=MODEL,
            temperature=0,
            input=[
                {"role": "user", "content": "My name is Ada."},
                reference,  # type: ignore[list-item]
                {"role": "user", "content": "What is my name?"},
            ],
        )
        assert second.output_text == scenario("multi_turn").completion


def test_duplicate_item_ids_are_refused_as_openai_refuses_them(client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
    duplicates = [
        # The same id twice in one input.
        {
            "input": [
                {"role": "user", "content": "a", "id": "msg_twice"},
                {"role": "user", "content": "b", "id": "msg_twice"},
            ]
        },
        # An item of the continued response sent again.
        {
            "input": [as_dict(first.output[-1]), {"role": "user", "content": "Again."}],
            "previous_response_id": first.id,
        },
    ]
    for body in duplicates:
        with pytest.raises(BadRequestError) as caught:
            client.responses.create(model=MODEL, **body)
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input"
        assert caught.value.body["message"].startswith("Duplicate item found with id ")


@pytest.mark.parametrize("reference", ["msg_does_not_exist", "rs_" + "0" * 32])
def test_an_unknown_reference_is_a_400_naming_it(client: OpenAI, reference: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "hi"}, {"type": "item_reference", "id": reference}],
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input[1].id"


def test_an_unstored_responses_items_cannot_be_referenced(client: OpenAI) -> None:
    unstored = client.responses.create(model=MODEL, input="Say hello.", store=False)
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": unstored.output[-1].id}])
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input[0].id"


def test_a_deleted_responses_items_are_gone(client: OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Say hello.")
    client.responses.delete(first.id)
    with pytest.raises(BadRequestError):
        client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": first.output[-1].id}])


def test_a_reference_survives_the_deletion_of_a_later_response_that_resent_its_item(client: OpenAI) -> None:
    """A chat app that deletes a regenerated turn: the item stays referable through the response
    that made it."""
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0)
    reference = {"type": "item_reference", "id": first.output[-1].id}
    turn = [
        {"role": "user", "content": "My name is Ada."},
        reference,
        {"role": "user", "content": "What is my name?"},
    ]
    regenerated = client.responses.create(model=MODEL, temperature=0, input=turn)  # type: ignore[arg-type]
    client.responses.delete(regenerated.id)
    again = client.responses.create(model=MODEL, temperature=0, input=turn)  # type: ignore[arg-type]
    assert again.output_text == scenario("multi_turn").completion


# --- encrypted reasoning --------------------------------------------------------------------------


def test_encrypted_reasoning_is_opaque_and_stored_as_sent(client: OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input=REASONING_PROMPT, temperature=0, include=["reasoning.encrypted_content"]
    )
    (reasoning,) = reasoning_items(first)
    blob = reasoning.encrypted_content
    assert blob and REASONING_TEXT not in blob and "Two" not in blob
    # The client sends the item back with its blob only (no content), as Codex does.
    echoed = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": blob}
    second = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": REASONING_PROMPT},
            echoed,
            *first_messages(first),
            _user("Thanks."),
        ],
    )
    assert reasoning.content[0].text.strip() == REASONING_TEXT
    # Stored as sent: the blob, not the text it seals (it was stored opened, readable at rest).
    listed = client.responses.input_items.list(second.id, order="asc").data
    stored = listed[1].model_dump()
    assert stored["encrypted_content"] == blob and not stored.get("content")
    # What the prompt gets of it (opened: the text the model wrote) is a unit test's
    # (tests/unit/test_sealed.py): the built-in template, as Qwen3's, drops earlier reasoning.


def first_messages(response: Any) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in response.output if item.type == "message"]


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_without_the_include_there_is_no_blob(client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=REASONING_PROMPT, temperature=0)
    (reasoning,) = reasoning_items(response)
    assert reasoning.encrypted_content is None


@pytest.mark.parametrize("tamper", ["flip", "foreign", "plain"])
def test_a_tampered_or_foreign_blob_is_a_400_naming_the_item(client: OpenAI, tamper: str) -> None:
    first = unstored_with_sealed_reasoning(client, MODEL)
    blob = reasoning_items(first)[0].encrypted_content
    assert blob is not None
    bad = {
        "flip": blob[:-6] + ("A" if blob[-6] != "A" else "B") + blob[-5:],
        "foreign": "gAAAAABpZ3Vlc3NlZC1ieS1hbm90aGVyLXNlcnZlcg==",
        "plain": REASONING_TEXT,
    }[tamper]
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(
            model=MODEL,
            input=[_user(REASONING_PROMPT), {"type": "reasoning", "summary": [], "encrypted_content": bad}],
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "input[1].encrypted_content"
    assert body["code"] == "invalid_encrypted_content"


# --- a Codex-shaped turn --------------------------------------------------------------------------


def test_a_hosted_tools_include_is_taken_with_the_tool(client: OpenAI) -> None:
    """A hosted tool is echoed and not run; what ``include`` asks of its calls is then nothing (it
    was a 400 while the tool itself was taken)."""
    response = client.responses.create(
        model=MODEL,
        input="Say hello.",
        tools=HOSTED_TOOLS,  # type: ignore[arg-type]
        include=["web_search_call.action.sources", "web_search_call.results", "file_search_call.results"],
        temperature=0,
    )
    assert response.output_text == scenario("hello").completion
    assert all(item.type == "message" for item in response.output)


def test_a_codex_shaped_tool_round_trip(client: OpenAI) -> None:
    """Hosted tools, client_metadata, store false, encrypted reasoning, a summary: every Codex turn."""
    tools = [*TOOLS, *HOSTED_TOOLS]
    with client.responses.create(
        model=MODEL, input=WEATHER_PROMPT, tools=tools, temperature=0, stream=True, **CODEX_FIELDS
    ) as events:
        sdk_events = list(events)
    collected = [as_dict(event) for event in sdk_events]
    final = check_stream(collected)
    # Codex resends the items as they came over the wire.
    wire_output = [
        item.model_dump(mode="json", by_alias=True, exclude_none=True)
        for item in sdk_events[-1].response.output  # type: ignore[union-attr]
    ]
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # Echoed as sent (the SDK's models add the keys they know as null).
    assert [{k: v for k, v in tool.items() if v is not None} for tool in final["tools"][1:]] == HOSTED_TOOLS
    assert final["store"] is False and final["service_tier"] == "default"
    history: list[dict[str, Any]] = [
        _user(WEATHER_PROMPT),
        *wire_output,
        {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "22C and sunny"},
    ]
    second = client.responses.create(model=MODEL, input=history, tools=tools, temperature=0, **CODEX_FIELDS)
    assert second.output_text == scenario("after_tool_result").completion


def test_the_stream_ends_with_done_after_the_terminal_event(stack: Stack) -> None:
    body = {"model": MODEL, "input": "Say hello.", "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{stack.base_url}/v1/responses", json=body, timeout=60) as reply:
        raw = b"".join(reply.iter_bytes())
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    frames = raw.split(b"\n\n")
    assert frames[-3].startswith(b"event: response.completed") and frames[-2] == b"data: [DONE]"
    # The events exactly as sent (no SDK model in between to fill in missing keys) conform.
    events = [json.loads(frame.split(b"\ndata: ", 1)[1]) for frame in frames[:-2]]
    check_events(events)
    check_stream(events)


# --- fields ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["auto", "default", "flex", "priority", "scale"])
def test_every_service_tier_is_accepted_and_the_served_one_echoed(client: OpenAI, tier: str) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", service_tier=tier, temperature=0)  # type: ignore[arg-type]
    assert response.service_tier == "default"


def test_penalties_are_on_every_response_and_zero_changes_nothing(client: OpenAI) -> None:
    plain = client.responses.create(model=MODEL, input="Count to twenty.", temperature=0)
    extra = plain.model_extra or {}
    assert (extra["presence_penalty"], extra["frequency_penalty"]) == (0.0, 0.0)
    zero = client.responses.create(
        model=MODEL,
        input="Count to twenty.",
        temperature=0,
        extra_body={"presence_penalty": 0, "frequency_penalty": 0},
    )
    assert zero.output_text == plain.output_text == scenario("count").completion


def test_a_frequency_penalty_changes_a_repetitive_answer(client: OpenAI) -> None:
    """ "ha ha ha ...": with every repetition penalised, greedy decoding has to leave the loop."""
    plain = client.responses.create(model=MODEL, input="Repeat forever.", temperature=0, max_output_tokens=40)
    penalised = client.responses.create(
        model=MODEL,
        input="Repeat forever.",
        temperature=0,
        max_output_tokens=40,
        extra_body={"frequency_penalty": 2.0, "presence_penalty": 2.0},
    )
    assert (penalised.model_extra or {})["frequency_penalty"] == 2.0
    assert plain.output_text.startswith("ha ha ha")
    assert penalised.output_text != plain.output_text


def test_allowed_tools_required_forces_the_one_allowed_call(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input=WEATHER_PROMPT,
        tools=[*TOOLS, *HOSTED_TOOLS],
        temperature=0,
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "get_weather"}],
        },
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"]


def test_a_namespace_tool_is_accepted_and_echoed_with_its_functions(client: OpenAI) -> None:
    namespace = {
        "type": "namespace",
        "name": "weather",
        "description": "Weather tools.",
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "parameters": GET_WEATHER_TOOL["function"]["parameters"],
            }
        ],
    }
    response = client.responses.create(model=MODEL, input="Say hello.", tools=[namespace], temperature=0)  # type: ignore[list-item]
    echoed = response.model_dump()["tools"][0]
    assert echoed["type"] == "namespace" and echoed["tools"][0]["name"] == "get_weather"
    assert "strict" in echoed["tools"][0]


# --- summaries ------------------------------------------------------------------------------------


def test_a_summary_request_streams_the_reasoning_as_its_summary(client: OpenAI) -> None:
    with client.responses.create(
        model=MODEL, input=REASONING_PROMPT, temperature=0, stream=True, reasoning={"summary": "detailed"}
    ) as events:
        collected = [as_dict(event) for event in events]
    final = check_stream(collected)
    summary_deltas = "".join(
        event["delta"] for event in collected if event["type"] == "response.reasoning_summary_text.delta"
    )
    (reasoning,) = [item for item in final["output"] if item["type"] == "reasoning"]
    assert summary_deltas == reasoning["summary"][0]["text"] == reasoning["content"][0]["text"]
    assert REASONING_TEXT in summary_deltas
    assert output_text(final) == scenario("reasoning").completion.split("\n\n", 1)[1]


# --- openai-agents --------------------------------------------------------------------------------


def weather_tool(calls: list[str]) -> FunctionTool:
    """get_weather exactly as the fixture model was trained on it, run by the agent."""

    async def invoke(_: RunContextWrapper[Any], arguments: str) -> str:
        calls.append(arguments)
        return "22C and sunny"

    function = GET_WEATHER_TOOL["function"]
    return FunctionTool(
        name=function["name"],
        description=function["description"],
        params_json_schema=function["parameters"],
        on_invoke_tool=invoke,
        strict_json_schema=False,
    )


def agent(stack: Stack, calls: list[str] | None, **settings: Any) -> Agent[Any]:
    """An agent on the stack; with the weather tool unless ``calls`` is None."""
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-test", max_retries=0)
    return Agent(
        name="weather",
        instructions=None,
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        tools=[] if calls is None else [weather_tool(calls)],
        model_settings=ModelSettings(temperature=0, **settings),
    )


def test_openai_agents_runs_its_tool_loop(stack: Stack) -> None:
    calls: list[str] = []
    result = asyncio.run(
        Runner.run(agent(stack, calls), WEATHER_PROMPT, run_config=RunConfig(tracing_disabled=True))
    )
    assert [json.loads(arguments) for arguments in calls] == [{"city": "Paris"}]
    assert result.final_output == scenario("after_tool_result").completion


def test_openai_agents_runs_its_tool_loop_over_a_websocket_session(stack: Stack) -> None:
    """openai-agents' WebSocket transport (``responses_websocket_session``): one socket for the
    session's runs, a run and a streamed run, each a tool loop of two model calls."""
    calls: list[str] = []
    posts = {"route": "/v1/responses", "method": "POST", "status": "200"}
    before = value(scrape(f"{stack.base_url}/metrics"), "resq_http_requests_total", **posts)

    async def run() -> tuple[Any, Any]:
        async with responses_websocket_session(api_key="sk-test", base_url=f"{stack.base_url}/v1") as session:
            weather = Agent(
                name="weather",
                model=MODEL,
                tools=[weather_tool(calls)],
                model_settings=ModelSettings(temperature=0),
            )
            ran = await session.run(weather, WEATHER_PROMPT)
            streamed = session.run_streamed(weather, WEATHER_PROMPT)
            async for _ in streamed.stream_events():
                pass
            return ran, streamed

    ran, streamed = asyncio.run(run())
    assert [json.loads(arguments) for arguments in calls] == [{"city": "Paris"}] * 2
    assert ran.final_output == streamed.final_output == scenario("after_tool_result").completion
    # All four model calls went over the socket: no POST /v1/responses (which one counts).
    after = value(scrape(f"{stack.base_url}/metrics"), "resq_http_requests_total", **posts)
    assert after == before
    stack.client().responses.create(model=MODEL, input="Say hello.", max_output_tokens=2)
    assert value(scrape(f"{stack.base_url}/metrics"), "resq_http_requests_total", **posts) == after + 1


def test_openai_agents_streams_its_tool_loop_unstored_with_encrypted_reasoning(stack: Stack) -> None:
    calls: list[str] = []

    async def run() -> Any:
        streamed = Runner.run_streamed(
            agent(stack, calls, store=False, response_include=["reasoning.encrypted_content"]),
            WEATHER_PROMPT,
            run_config=RunConfig(tracing_disabled=True),
        )
        async for _ in streamed.stream_events():
            pass
        return streamed

    streamed = asyncio.run(run())
    assert [json.loads(arguments) for arguments in calls] == [{"city": "Paris"}]
    assert streamed.final_output == scenario("after_tool_result").completion


def test_openai_agents_keeps_its_reasoning_across_unstored_turns(stack: Stack) -> None:
    first = asyncio.run(
        Runner.run(
            agent(stack, None, store=False, response_include=["reasoning.encrypted_content"]),
            REASONING_PROMPT,
            run_config=RunConfig(tracing_disabled=True),
        )
    )
    history = first.to_input_list()
    sent_reasoning = [item for item in history if item.get("type") == "reasoning"]
    assert sent_reasoning and sent_reasoning[0].get("encrypted_content")
    # The next turn sends the reasoning item back with its blob: accepted (a bad one is a 400).
    second = asyncio.run(
        Runner.run(
            agent(stack, None, store=False, response_include=["reasoning.encrypted_content"]),
            [*history, {"role": "user", "content": "Thanks."}],
            run_config=RunConfig(tracing_disabled=True),
        )
    )
    assert isinstance(second.final_output, str)


# --- LangChain ------------------------------------------------------------------------------------


def chat_model(stack: Stack, **options: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=f"{stack.base_url}/v1",
        api_key="sk-test",  # type: ignore[arg-type]
        use_responses_api=True,
        temperature=0,
        max_retries=0,
        **options,
    )


def test_langchain_runs_a_bind_tools_loop(stack: Stack) -> None:
    model = chat_model(stack).bind_tools([GET_WEATHER_TOOL])
    question = HumanMessage(WEATHER_PROMPT)
    called = model.invoke([question])
    assert isinstance(called, AIMessage)
    assert [(call["name"], call["args"]) for call in called.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    answer = model.invoke(
        [question, called, ToolMessage("22C and sunny", tool_call_id=called.tool_calls[0]["id"])]
    )
    assert answer.text == scenario("after_tool_result").completion


def test_langchain_continues_by_previous_response_id(stack: Stack) -> None:
    """``use_previous_response_id=True``: LangChain sends the last response's id and only the
    messages after it (here the tool result), and resq continues the stored turn."""
    model = chat_model(stack, use_previous_response_id=True).bind_tools([GET_WEATHER_TOOL])
    question = HumanMessage(WEATHER_PROMPT)
    called = model.invoke([question])
    assert isinstance(called, AIMessage) and called.tool_calls
    result = ToolMessage("22C and sunny", tool_call_id=called.tool_calls[0]["id"])
    answer = model.invoke([question, called, result])
    assert answer.text == scenario("after_tool_result").completion
    stored = stack.client().responses.retrieve(answer.response_metadata["id"])
    assert stored.previous_response_id == called.response_metadata["id"]


class WeatherReport(BaseModel):
    """What LangChain's structured output is asked for (bounded: an enum and a boolean)."""

    city: Literal["Paris", "London", "Tokyo"]
    sunny: bool


def test_langchain_structured_output_follows_its_schema(stack: Stack) -> None:
    """``with_structured_output(Model, method="json_schema")``: sent as ``text.format``, enforced by
    constrained decoding, parsed and validated by LangChain."""
    structured = chat_model(stack).with_structured_output(
        WeatherReport, method="json_schema", include_raw=True
    )
    answer = structured.invoke(WEATHER_PROMPT)
    assert answer["parsing_error"] is None
    assert isinstance(answer["parsed"], WeatherReport)
    stored = stack.client().responses.retrieve(answer["raw"].response_metadata["id"])
    assert stored.text is not None and stored.text.format.type == "json_schema"
    assert stored.status == "completed"


def test_langchain_streams_non_empty_reasoning(stack: Stack) -> None:
    model = chat_model(stack, reasoning={"summary": "auto"}, streaming=True)
    aggregate: Any = None
    for chunk in model.stream(REASONING_PROMPT):
        aggregate = chunk if aggregate is None else aggregate + chunk
    blocks = [
        block for block in aggregate.content if isinstance(block, dict) and block.get("type") == "reasoning"
    ]
    summary = "".join(part.get("text", "") for block in blocks for part in block.get("summary", []))
    assert REASONING_TEXT in summary
    assert aggregate.text.strip() == scenario("reasoning").completion.split("\n\n", 1)[1]


# --- litellm --------------------------------------------------------------------------------------


def test_litellm_passes_responses_through(stack: Stack) -> None:
    """litellm's Responses API client with an ``openai/`` model: a plain and a streamed turn."""
    options: dict[str, Any] = {
        "model": f"openai/{MODEL}",
        "api_base": f"{stack.base_url}/v1",
        "api_key": "sk-test",
        "temperature": 0,
    }
    answer = litellm.responses(input="Say hello.", **options)
    assert answer.output_text == scenario("hello").completion
    deltas = [
        event.delta
        for event in litellm.responses(input="Say hello.", stream=True, **options)
        if event.type == "response.output_text.delta"
    ]
    assert "".join(deltas) == scenario("hello").completion


# --- Chat Completions: LangChain ------------------------------------------------------------------


def chat_completions_model(stack: Stack, **options: Any) -> ChatOpenAI:
    """LangChain's default ChatOpenAI: Chat Completions, not the Responses API."""
    return ChatOpenAI(
        model=MODEL,
        base_url=f"{stack.base_url}/v1",
        api_key="sk-test",  # type: ignore[arg-type]
        temperature=0,
        max_retries=0,
        **options,
    )


def test_langchain_chat_completions_invoke(stack: Stack) -> None:
    answer = chat_completions_model(stack).invoke([HumanMessage("Say hello.")])
    assert isinstance(answer, AIMessage)
    assert answer.text == scenario("hello").completion
    # A chat completion (a ``chatcmpl-`` id), not a response.
    assert answer.response_metadata["id"].startswith("chatcmpl-")
    assert answer.response_metadata["finish_reason"] == "stop"


def test_langchain_chat_completions_stream(stack: Stack) -> None:
    chunks = list(chat_completions_model(stack).stream([HumanMessage("Say hello.")]))
    assert len(chunks) > 1
    assert "".join(chunk.text for chunk in chunks) == scenario("hello").completion


def test_langchain_chat_completions_bind_tools_loop(stack: Stack) -> None:
    model = chat_completions_model(stack).bind_tools([GET_WEATHER_TOOL])
    question = HumanMessage(WEATHER_PROMPT)
    called = model.invoke([question])
    assert isinstance(called, AIMessage)
    assert [(call["name"], call["args"]) for call in called.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert called.response_metadata["finish_reason"] == "tool_calls"
    answer = model.invoke(
        [question, called, ToolMessage("22C and sunny", tool_call_id=called.tool_calls[0]["id"])]
    )
    assert answer.text == scenario("after_tool_result").completion


# --- Chat Completions: litellm --------------------------------------------------------------------


def litellm_chat_options(stack: Stack) -> dict[str, Any]:
    """litellm's openai-compatible provider on the stack's Chat Completions endpoint."""
    return {
        "model": f"openai/{MODEL}",
        "api_base": f"{stack.base_url}/v1",
        "api_key": "sk-test",
        "temperature": 0,
    }


def test_litellm_chat_completion(stack: Stack) -> None:
    answer = litellm.completion(messages=[_user("Say hello.")], **litellm_chat_options(stack))
    assert answer.id.startswith("chatcmpl-")
    assert answer.choices[0].message.content == scenario("hello").completion
    assert answer.choices[0].finish_reason == "stop"


def test_litellm_chat_completion_streams(stack: Stack) -> None:
    chunks = list(
        litellm.completion(messages=[_user("Say hello.")], stream=True, **litellm_chat_options(stack))
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == scenario("hello").completion
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"


def test_litellm_chat_completion_runs_a_tool_loop(stack: Stack) -> None:
    history: list[Any] = [_user(WEATHER_PROMPT)]
    called = litellm.completion(messages=history, tools=[GET_WEATHER_TOOL], **litellm_chat_options(stack))
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # As litellm's function-calling guide does: the assistant message back, then the tool's result.
    history += [choice.message, {"role": "tool", "tool_call_id": calls[0].id, "content": "22C and sunny"}]
    answer = litellm.completion(messages=history, tools=[GET_WEATHER_TOOL], **litellm_chat_options(stack))
    assert answer.choices[0].message.content == scenario("after_tool_result").completion
