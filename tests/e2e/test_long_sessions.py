"""Long agent sessions, end to end: ``conversation`` on create, ``input_tokens``, ``truncation: "auto"``
and compaction, with the official SDK (strict) and openai-agents' sessions, on the fixture model
(a 1,024-token context).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
from agents.memory import OpenAIConversationsSession, SQLiteSession
from agents.memory import openai_responses_compaction_session as compaction_session
from openai import AsyncOpenAI, OpenAI

from tests.e2e.conftest import MODEL, Stack
from tests.support.invariants import as_dict, check_stream
from tests.support.responses import wait_ended

pytestmark = pytest.mark.e2e

FIXTURE_CONTEXT = 1024


def turn(index: int, words: int = 40) -> list[dict[str, Any]]:
    """One user/assistant exchange of about ``words * 2`` tokens, numbered so it can be recognised."""
    filler = " ".join(f"w{index}" for _ in range(words))
    return [
        {"type": "message", "role": "user", "content": f"Turn {index}: {filler}"},
        {"type": "message", "role": "assistant", "content": f"Noted {index}."},
    ]


def long_history(turns: int) -> list[dict[str, Any]]:
    return [item for index in range(turns) for item in turn(index)]


def count(client: OpenAI, **body: Any) -> int:
    counted = client.responses.input_tokens.count(model=MODEL, **body)
    assert counted.object == "response.input_tokens"
    return counted.input_tokens


# --- conversation on create ------------------------------------------------------------------------


def test_responses_in_a_conversation_see_and_extend_it(stack: Stack) -> None:
    client = stack.client()
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}], metadata={"topic": "names"}
    )
    first = client.responses.create(
        model=MODEL, conversation=conversation.id, input="Say hello.", temperature=0, max_output_tokens=24
    )
    assert first.status == "completed"
    assert first.conversation is not None and first.conversation.id == conversation.id
    after_first = [item.id for item in client.conversations.items.list(conversation.id, order="asc")]
    # The seeded item, then the response's input item, then its output items, each once.
    assert after_first[2:] == [item.id for item in first.output]
    assert len(after_first) == 2 + len(first.output)

    # The next response sees everything before it: its prompt is longer than the input alone.
    alone = count(client, input="Say hello.")
    in_conversation = count(client, input="Say hello.", conversation=conversation.id)
    assert in_conversation > alone
    events = list(
        client.responses.create(
            model=MODEL,
            conversation={"id": conversation.id},
            input="Say hello.",
            temperature=0,
            max_output_tokens=24,
            stream=True,
        )
    )
    check_stream([as_dict(event) for event in events])
    second = events[-1].response  # type: ignore[union-attr]
    assert second.usage is not None and second.usage.input_tokens == in_conversation
    after_second = [
        item.id for item in client.conversations.items.list(conversation.id, order="asc", limit=100)
    ]
    assert after_second[: len(after_first)] == after_first
    assert after_second[len(after_first) + 1 :] == [item.id for item in second.output]


def test_two_responses_at_once_append_whole_in_completion_order(stack: Stack) -> None:
    client = stack.client()
    conversation = client.conversations.create()
    started = [
        client.responses.create(
            model=MODEL,
            conversation=conversation.id,
            input=prompt,
            background=True,
            temperature=0,
            max_output_tokens=budget,
        )
        for prompt, budget in (("Tell me a long story.", 64), ("Say hello.", 8))
    ]
    finished = [wait_ended(client, response.id) for response in started]
    listed = [item.id for item in client.conversations.items.list(conversation.id, order="asc", limit=100)]
    blocks = {
        response.id: [input_id(client, response.id), *[item.id for item in response.output]]
        for response in finished
    }
    assert sorted(listed) == sorted(item for block in blocks.values() for item in block)
    # Each response's items are contiguous (appended in one step), blocks in completion order.
    starts = sorted((listed.index(block[0]), response_id) for response_id, block in blocks.items())
    for position, response_id in starts:
        assert listed[position : position + len(blocks[response_id])] == blocks[response_id]
    by_completion = sorted(finished, key=lambda response: response.completed_at or 0)
    if (by_completion[0].completed_at or 0) < (by_completion[1].completed_at or 0):
        assert [response_id for _, response_id in starts] == [response.id for response in by_completion]


def input_id(client: OpenAI, response_id: str) -> str:
    items = client.responses.input_items.list(response_id)
    return items.data[0].id


def test_a_response_in_a_deleted_conversation_still_completes(stack: Stack) -> None:
    client = stack.client()
    conversation = client.conversations.create()
    started = client.responses.create(
        model=MODEL,
        conversation=conversation.id,
        input="Tell me a long story.",
        background=True,
        max_output_tokens=48,
    )
    client.conversations.delete(conversation.id)
    assert wait_ended(client, started.id).status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.list(conversation.id)


# --- input_tokens ----------------------------------------------------------------------------------


def test_input_tokens_is_what_the_engine_is_given(stack: Stack) -> None:
    client = stack.client()
    body: dict[str, Any] = {
        "input": "What is the weather in Paris?",
        "instructions": "Answer briefly.",
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
    }
    counted = count(client, **body)
    created = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16, **body)
    assert created.usage is not None and created.usage.input_tokens == counted
    # Continuing from it counts the history too, exactly as the next create sees it.
    follow = {"input": "Thanks.", "previous_response_id": created.id}
    counted_next = count(client, **follow)
    assert counted_next > count(client, input="Thanks.")
    continued = client.responses.create(model=MODEL, temperature=0, max_output_tokens=8, **follow)
    assert continued.usage is not None and continued.usage.input_tokens == counted_next
    # `model` may be left out: the server serves one.
    assert client.responses.input_tokens.count(input="What is the weather in Paris?").input_tokens > 0


def test_input_tokens_counts_past_the_context(stack: Stack) -> None:
    client = stack.client()
    history = long_history(20)
    over = count(client, input=history)
    assert over > FIXTURE_CONTEXT
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=history, max_output_tokens=16)
    assert caught.value.code == "context_length_exceeded"


# --- truncation: auto ------------------------------------------------------------------------------


def test_truncation_auto_drops_the_oldest_turns_only(stack: Stack) -> None:
    client = stack.client()
    history = long_history(20)
    last = {"type": "message", "role": "user", "content": "Say hello."}
    items = [*history, last]
    auto = count(client, input=items, truncation="auto", extra_body={"max_output_tokens": 64})
    assert auto + 64 <= FIXTURE_CONTEXT
    # The count equals that of the conversation without its k oldest turns, for the smallest such k
    # that fits: the dropped turns are the oldest ones, and no more of them than needed.
    kept_counts = {k: count(client, input=[*history[2 * k :], last]) for k in range(len(history) // 2)}
    fitting = [k for k, tokens in kept_counts.items() if tokens + 64 <= FIXTURE_CONTEXT]
    assert kept_counts[min(fitting)] == auto

    response = client.responses.create(
        model=MODEL, input=items, truncation="auto", max_output_tokens=64, temperature=0
    )
    assert response.status in ("completed", "incomplete")
    assert response.truncation == "auto"
    assert response.usage is not None and response.usage.input_tokens == auto
    # input_items are what the client sent, not what the model saw.
    listed = client.responses.input_items.list(response.id, limit=100, order="asc")
    assert len(listed.data) == len(items)


def test_truncation_auto_in_a_conversation_longer_than_the_context(stack: Stack) -> None:
    client = stack.client()
    conversation = client.conversations.create()
    for start in range(0, 24, 2):
        client.conversations.items.create(conversation.id, items=long_history(24)[start * 2 : start * 2 + 4])
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model=MODEL, conversation=conversation.id, input="Say hello.", max_output_tokens=32
        )
    response = client.responses.create(
        model=MODEL, conversation=conversation.id, input="Say hello.", truncation="auto", max_output_tokens=32
    )
    assert response.status in ("completed", "incomplete")
    assert response.usage is not None and response.usage.input_tokens + 32 <= FIXTURE_CONTEXT


# --- compaction ------------------------------------------------------------------------------------


def test_compaction_shortens_the_next_prompt_and_refuses_tampering(stack: Stack) -> None:
    client = stack.client()
    history = long_history(6)
    # Every parameter the SDK's compact takes and resq serves (safety_identifier was refused).
    compacted = client.responses.compact(model=MODEL, input=history, safety_identifier="user-123")
    assert compacted.object == "response.compaction"
    assert compacted.output[-1].type == "compaction"
    assert compacted.usage.input_tokens > 0 and compacted.usage.output_tokens > 0
    item = as_dict(compacted.output[-1])
    assert item["encrypted_content"].startswith("rq1_") and "Turn" not in item["encrypted_content"]

    follow = {"type": "message", "role": "user", "content": "Say hello."}
    before = count(client, input=[*history, follow])
    after = count(client, input=[*history, item, follow])
    assert after < before
    # The compaction item stands for everything before it: sending the history too changes nothing.
    assert after == count(client, input=[item, follow])
    response = client.responses.create(model=MODEL, input=[item, follow], temperature=0, max_output_tokens=16)
    assert response.status in ("completed", "incomplete")
    assert response.usage is not None and response.usage.input_tokens == after

    blob = item["encrypted_content"]
    forged = blob[:-4] + ("AAAA" if not blob.endswith("AAAA") else "BBBB")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[{**item, "encrypted_content": forged}, follow])
    assert caught.value.code == "invalid_encrypted_content"
    assert caught.value.param == "input[0].encrypted_content"


def test_compaction_of_a_stored_chain(stack: Stack) -> None:
    client = stack.client()
    first = client.responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=16)
    compacted = client.responses.compact(model=MODEL, previous_response_id=first.id, input="Thanks.")
    assert [item.type for item in compacted.output] == ["compaction"]


def test_compaction_of_a_stored_chain_alone(stack: Stack) -> None:
    """What openai-agents' compaction session sends in its ``previous_response_id`` mode (and in
    ``auto`` after a stored response): the chain, and no input. Counting it needs none either."""
    client = stack.client()
    first = client.responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=16)
    compacted = client.responses.compact(model=MODEL, previous_response_id=first.id)
    assert [item.type for item in compacted.output] == ["compaction"]
    assert count(client, previous_response_id=first.id) > count(client, input="Say hello.")
    with pytest.raises(openai.BadRequestError) as caught:  # with nothing to continue, input is required
        client.responses.input_tokens.count(model=MODEL)
    assert caught.value.param == "input"


def test_a_listed_compaction_item_goes_back_as_input_and_is_compacted_again(stack: Stack) -> None:
    """Items as resq lists them are input resq takes: the compaction item has no ``status`` (the
    SDK's has none), and a history holding one can be compacted again (it was a 500)."""
    client = stack.client()
    item = as_dict(client.responses.compact(model=MODEL, input=long_history(2)).output[-1])
    conversation = client.conversations.create(
        items=[item, {"type": "message", "role": "user", "content": "Go on."}]
    )
    listed = [as_dict(entry) for entry in client.conversations.items.list(conversation.id, order="asc").data]
    assert listed[0]["type"] == "compaction" and "status" not in listed[0]
    replayed = client.responses.create(model=MODEL, input=listed, max_output_tokens=4)  # type: ignore[arg-type]
    assert replayed.status in ("completed", "incomplete")
    again = client.responses.create(
        model=MODEL,
        input="Say hello.",
        conversation=conversation.id,
        context_management=[{"type": "compaction", "compact_threshold": 1}],
        max_output_tokens=4,
    )
    assert again.output[0].type == "compaction"


def test_a_history_of_the_most_items_input_takes_is_compacted(stack: Stack) -> None:
    """The summary's request is the history and its prompt: one item more than a client may send."""
    client = stack.client()
    most = [{"type": "message", "role": "user", "content": f"{index}"} for index in range(4096)]
    compacted = client.responses.compact(model=MODEL, input=most)  # type: ignore[arg-type]
    assert [item.type for item in compacted.output] == ["compaction"]


def test_a_last_turn_longer_than_the_context_is_not_compacted_into_nothing(stack: Stack) -> None:
    """Truncated to fit, the summary's request would have held only its own prompt: the answer was
    a 200 whose summary stood for a conversation it never saw."""
    client = stack.client()
    huge = " ".join(f"w{index}" for index in range(3 * FIXTURE_CONTEXT))
    conversation = [
        {"type": "message", "role": "user", "content": "Plan a trip to Lisbon."},
        {"type": "message", "role": "user", "content": huge},
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.compact(model=MODEL, input=conversation)  # type: ignore[arg-type]
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "input")
    # What does fit is summarised as before, the oldest turns dropped first.
    compacted = client.responses.compact(model=MODEL, input=[*long_history(12), conversation[0]])  # type: ignore[list-item]
    assert [item.type for item in compacted.output] == ["compaction"]


def test_a_response_may_not_resend_an_item_its_conversation_holds(stack: Stack) -> None:
    """OpenAI refuses it; resq's conversation would have kept one item per id, overwritten."""
    client = stack.client()
    original = {"type": "message", "role": "user", "content": "The original.", "id": "msg_original"}
    conversation = client.conversations.create(items=[original])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=MODEL,
            conversation=conversation.id,
            input=[{"type": "message", "role": "user", "content": "Changed.", "id": "msg_original"}],
        )
    assert caught.value.param == "input"
    stored = client.conversations.items.list(conversation.id).data
    assert [as_dict(entry)["content"][0]["text"] for entry in stored] == ["The original."]


def test_context_management_compacts_past_its_threshold(stack: Stack) -> None:
    client = stack.client()
    history = long_history(4)
    last = {"type": "message", "role": "user", "content": "Say hello."}
    below = client.responses.create(
        model=MODEL,
        input="Say hello.",
        context_management=[{"type": "compaction", "compact_threshold": 500}],
        temperature=0,
        max_output_tokens=16,
    )
    assert all(item.type != "compaction" for item in below.output)

    events = list(
        client.responses.create(
            model=MODEL,
            input=[*history, last],
            context_management=[{"type": "compaction", "compact_threshold": 100}],
            temperature=0,
            max_output_tokens=16,
            stream=True,
        )
    )
    check_stream([as_dict(event) for event in events])
    compacted = events[-1].response  # type: ignore[union-attr]
    assert compacted.output[0].type == "compaction"
    assert compacted.usage is not None and compacted.usage.input_tokens < count(
        client, input=[*history, last]
    )
    # A continuation goes on from the compaction, not from the whole history.
    follow = {"input": "Thanks.", "previous_response_id": compacted.id}
    plain = client.responses.create(model=MODEL, input=[*history, last], temperature=0, max_output_tokens=16)
    assert count(client, **follow) < count(client, input="Thanks.", previous_response_id=plain.id)


# --- prefix caching -------------------------------------------------------------------------------


def session_instructions(word: str) -> str:
    """Instructions of ~700 tokens no other test sends (a fresh session tag first): nothing cached."""
    return f"Session {uuid.uuid4().hex}. " + " ".join(f"{word}{index}" for index in range(150))


def prewarm(client: OpenAI, instructions: str, input: Any, **fields: Any) -> Any:
    """A ``prompt_cache_options.prewarm`` of ``instructions`` and ``input``, ``fields`` added."""
    return client.responses.create(
        model=MODEL, instructions=instructions, input=input, prompt_cache_options={"prewarm": True}, **fields
    )


def test_a_repeated_prefix_is_reused_and_reported_as_cached_tokens(stack: Stack) -> None:
    """An agent's next turn resends its instructions and history: the engine reuses their KV blocks,
    and ``cached_tokens`` says how many prompt tokens it did not compute (whole 64-token pages)."""
    client = stack.client()
    instructions = session_instructions("rule")
    first = client.responses.create(
        model=MODEL, instructions=instructions, input="Say hello.", temperature=0, max_output_tokens=4
    )
    second = client.responses.create(
        model=MODEL, instructions=instructions, input="Say hello again.", temperature=0, max_output_tokens=4
    )
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > 0 and cached % 64 == 0 and cached < second.usage.input_tokens, second.usage


def test_prompt_cache_options_explicit_without_a_breakpoint_caches_nothing(stack: Stack) -> None:
    """``prompt_cache_options.mode: "explicit"`` with no breakpoint uses no prompt cache, as OpenAI's:
    it reuses no page and leaves none reusable; a breakpoint, or the implicit mode, caches again.
    The Response echoes the options (the SDK validates it strictly)."""
    client = stack.client()
    instructions = session_instructions("rule")

    def cached(input: Any, **options: Any) -> int:
        response = client.responses.create(
            model=MODEL,
            instructions=instructions,
            input=input,
            temperature=0,
            max_output_tokens=4,
            **({"prompt_cache_options": options} if options else {}),
        )
        assert response.usage is not None
        if options:
            assert response.prompt_cache_options is not None
            assert response.prompt_cache_options.mode == options.get("mode", "implicit")
            assert response.prompt_cache_options.ttl == options.get("ttl", "30m")
        else:
            assert response.prompt_cache_options is None
        return response.usage.input_tokens_details.cached_tokens

    assert cached("Say hello.", mode="explicit") == 0
    assert cached("Say hello.", mode="explicit", ttl="12h") == 0  # reused nothing of the first
    assert cached("Say hello.") == 0  # neither explicit request left a page to reuse
    assert cached("Say hello.", mode="implicit") > 0
    marked = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Say hello.", "prompt_cache_breakpoint": {"mode": "explicit"}}
            ],
        }
    ]
    assert cached(marked, mode="explicit") > 0
    breakpoint = {"mode": "explicit"}
    in_a_tool_output = [
        {"role": "user", "content": "Run it."},
        {"type": "function_call", "call_id": "c1", "name": "run", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_text", "text": "done", "prompt_cache_breakpoint": breakpoint}],
        },
    ]
    assert cached(in_a_tool_output, mode="explicit") > 0
    on_an_assistant_part = [
        {"role": "user", "content": "Say hello."},
        {
            "role": "assistant",
            "content": [{"type": "input_text", "text": "Hello.", "prompt_cache_breakpoint": breakpoint}],
        },
        {"role": "user", "content": "Again."},
    ]
    assert cached(on_an_assistant_part, mode="explicit") > 0
    # A compaction's summary follows its request's options too (the same one twice: 0 both times).
    shorter = instructions[:600]
    for _ in range(2):
        compacted = client.responses.compact(
            model=MODEL, instructions=shorter, input="Summarise.", prompt_cache_options={"mode": "explicit"}
        )
        assert compacted.usage is not None and compacted.usage.input_tokens_details.cached_tokens == 0
    implicit = [
        client.responses.compact(model=MODEL, instructions=shorter, input="Summarise.") for _ in range(2)
    ]
    assert implicit[1].usage is not None and implicit[1].usage.input_tokens_details.cached_tokens > 0


def test_prompt_cache_options_prewarm_caches_the_prompt_and_generates_nothing(stack: Stack) -> None:
    """A prewarm computes the prompt and generates nothing: the response completes with no output and
    no output tokens, and the next turn finds the prompt's pages in the cache, which nothing else
    computed (its first request would otherwise report 0 cached tokens)."""
    client = stack.client()
    instructions = session_instructions("rule")
    warmed = prewarm(client, instructions, "Get ready.", max_output_tokens=64)
    assert warmed.status == "completed" and warmed.output == [], warmed
    assert warmed.usage is not None and warmed.usage.output_tokens == 0
    assert warmed.usage.input_tokens > 128
    assert warmed.usage.input_tokens_details.cached_tokens == 0
    assert warmed.prompt_cache_options is not None and warmed.prompt_cache_options.mode == "implicit"
    assert warmed.max_output_tokens == 64
    turn = client.responses.create(
        model=MODEL,
        previous_response_id=warmed.id,
        instructions=instructions,
        input="Say hello.",
        temperature=0,
        max_output_tokens=4,
    )
    assert turn.usage is not None
    cached = turn.usage.input_tokens_details.cached_tokens
    assert cached >= 128 and cached % 64 == 0, turn.usage
    # Streamed, a prewarm is a valid stream with no output events.
    events = list(
        client.responses.create(
            model=MODEL,
            instructions=instructions,
            input="Get ready again.",
            stream=True,
            prompt_cache_options={"prewarm": True, "ttl": "12h"},
        )
    )
    final = check_stream([as_dict(event) for event in events])
    assert final["status"] == "completed" and final["output"] == []
    # A session's start: its instructions alone, before the first message.
    session = session_instructions("step")
    alone = prewarm(client, session, [])
    first = client.responses.create(
        model=MODEL, previous_response_id=alone.id, instructions=session, input="Hi.", max_output_tokens=4
    )
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens >= 128, first.usage
    with pytest.raises(openai.BadRequestError):  # nothing to prewarm
        client.responses.create(model=MODEL, input=[], prompt_cache_options={"prewarm": True})
    # Whatever the request's own limit, the prompt's pages are kept (a request the engine ended in
    # the step computing its prompt would leave none); a compaction is not a prewarm's to generate.
    other = session_instructions("task")
    short = prewarm(
        client,
        other,
        "Ready.",
        max_output_tokens=1,
        context_management=[{"type": "compaction", "compact_threshold": 100}],
    )
    assert short.status == "completed" and short.output == [], short.output
    follow = client.responses.create(
        model=MODEL, previous_response_id=short.id, instructions=other, input="Hi.", max_output_tokens=4
    )
    assert follow.usage is not None and follow.usage.input_tokens_details.cached_tokens >= 128, follow.usage
    with pytest.raises(openai.BadRequestError) as refused:  # explicit, no breakpoint: nothing to prepare
        client.responses.create(
            model=MODEL, input="Ready.", prompt_cache_options={"prewarm": True, "mode": "explicit"}
        )
    assert refused.value.param == "prompt_cache_options.mode"
    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]


# --- openai-agents sessions ------------------------------------------------------------------------


def sessions_agent(stack: Stack) -> tuple[Agent[Any], AsyncOpenAI]:
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-test", max_retries=0)
    agent: Agent[Any] = Agent(
        name="chat",
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(temperature=0),
    )
    return agent, client


def test_openai_agents_conversations_session_across_three_runs(stack: Stack) -> None:
    agent, client = sessions_agent(stack)

    async def run() -> list[Any]:
        session = OpenAIConversationsSession(openai_client=client)
        for prompt in ("Say hello.", "What is 2+2? Think first.", "Say hello."):
            await Runner.run(agent, prompt, session=session, run_config=RunConfig(tracing_disabled=True))
        return await session.get_items()

    items = asyncio.run(run())
    users = [item for item in items if item.get("role") == "user"]
    assert len(users) == 3
    assert sum(1 for item in items if item.get("role") == "assistant") >= 3


@pytest.mark.parametrize("mode", ["input", "previous_response_id"])
def test_openai_agents_compaction_session_past_its_threshold(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # The session refuses model names that are not OpenAI's (only OpenAI served /compact until now).
    monkeypatch.setattr(compaction_session, "is_openai_model_name", lambda name: True)
    agent, client = sessions_agent(stack)

    async def run() -> list[Any]:
        session = compaction_session.OpenAIResponsesCompactionSession(
            session_id="long",
            underlying_session=SQLiteSession("long"),
            client=client,
            model=MODEL,
            compaction_mode=mode,  # type: ignore[arg-type]
            should_trigger_compaction=lambda context: len(context["compaction_candidate_items"]) >= 2,
        )
        for prompt in ("Say hello.", "Say hello.", "Say hello."):
            await Runner.run(agent, prompt, session=session, run_config=RunConfig(tracing_disabled=True))
        return await session.get_items()

    items = asyncio.run(run())
    assert any(item.get("type") == "compaction" for item in items)
