"""The logic behind stored responses: ids, snapshots, conversation continuation, query values, and
the Redis scripts and log following they rely on (on the suite's real Redis)."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import redis

from api.caller import ANONYMOUS, Caller
from api.errors import OpenAIError
from api.event_hub import EventHub
from api.query import MAX_POSITION, boolean, non_negative_int
from api.relay import follow_events
from api.store import ResponseStore, StoredResponse, check_response_id
from resq import ids, item_index, jsonutil, keys
from resq.conversation import continue_conversation, items_to_messages
from resq.records import CANCEL_LUA, DELETE_LUA, FINALIZE_LUA
from resq.redis_client import async_redis

TTL_S = 600


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- ids -----------------------------------------------------------------------------------------------


def test_only_ids_resq_issues_are_well_formed() -> None:
    issued = ids.new_response_id()
    assert check_response_id(issued) == issued
    for malformed in ("", "resp_", "resp_abc", "resp_" + "A" * 32, "resp_" + "0" * 33, "msg_" + "0" * 32):
        with pytest.raises(OpenAIError) as caught:
            check_response_id(malformed, "previous_response_id")
        assert caught.value.status_code == 400
        assert caught.value.param == "previous_response_id"


# --- snapshots -----------------------------------------------------------------------------------------


def stored(status: str, response: dict[str, Any], final: bool, owner: str = "") -> StoredResponse:
    return StoredResponse(
        response_id="resp_" + "0" * 32,
        status=status,
        response_json=jsonutil.dumps(response),
        final=final,
        store=True,
        background=True,
        owner=owner,
    )


def test_a_final_response_is_returned_byte_for_byte() -> None:
    # Key order and spacing are whatever the post-processor wrote; they must survive untouched.
    raw = b'{"status":"completed","id":"x","output":[]}'
    record = StoredResponse("resp_" + "0" * 32, "completed", raw, True, True, False, "")
    assert record.current_json() is raw


def test_a_cancel_not_yet_finalised_shows_in_the_snapshot() -> None:
    snapshot = {"id": "x", "status": "in_progress", "output": []}
    assert jsonutil.loads(stored("cancelled", snapshot, final=False).current_json())["status"] == "cancelled"
    unchanged = stored("in_progress", snapshot, final=False)
    assert unchanged.current_json() == unchanged.response_json


def test_ownership_is_decided_in_one_place() -> None:
    assert ResponseStore.visible(stored("completed", {}, True, owner=""), ANONYMOUS)
    assert not ResponseStore.visible(stored("completed", {}, True, owner="alice"), Caller("bob"))
    assert ResponseStore.visible(stored("completed", {}, True, owner="alice"), Caller("alice"))


# --- conversation continuation ---------------------------------------------------------------------------

FIRST_INPUT: list[dict[str, Any]] = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}
]
FIRST_OUTPUT: list[dict[str, Any]] = [
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Call it."}],
        "status": "completed",
    },
    {
        "type": "message",
        "id": "msg_1",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}],
    },
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    },
]
SECOND_INPUT: list[dict[str, Any]] = [{"type": "function_call_output", "call_id": "call_1", "output": "22C"}]


def test_continuation_renders_like_the_whole_history_sent_by_hand() -> None:
    continued = continue_conversation(FIRST_INPUT, FIRST_OUTPUT, SECOND_INPUT)
    by_hand: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"role": "assistant", "content": "Checking."},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
    ]
    assert items_to_messages(continued, "New rules.") == items_to_messages(by_hand, "New rules.")
    messages = items_to_messages(continued, None)
    assert [message["role"] for message in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[1]["reasoning_content"] == "Call it."


def test_instructions_are_not_part_of_a_stored_conversation() -> None:
    # Instructions are applied at render time: the earlier ones never reach a continuation.
    continued = continue_conversation(FIRST_INPUT, FIRST_OUTPUT[1:2], [])
    assert items_to_messages(continued, "Newer.")[0] == {"role": "system", "content": "Newer."}
    assert [message["role"] for message in items_to_messages(continued, None)] == ["user", "assistant"]


def test_branches_share_their_root_only() -> None:
    before = copy.deepcopy((FIRST_INPUT, FIRST_OUTPUT))
    left = continue_conversation(FIRST_INPUT, FIRST_OUTPUT, SECOND_INPUT)
    right = continue_conversation(FIRST_INPUT, FIRST_OUTPUT, [{"role": "user", "content": "Other."}])
    assert left[: len(FIRST_INPUT) + len(FIRST_OUTPUT)] == right[: len(FIRST_INPUT) + len(FIRST_OUTPUT)]
    assert left[-1] != right[-1]
    left.append({"role": "user", "content": "More."})
    assert before == (FIRST_INPUT, FIRST_OUTPUT), "continuing must not change the earlier conversation"


# --- query values ----------------------------------------------------------------------------------------


def test_boolean_and_integer_query_values() -> None:
    assert boolean(None, "stream") is False
    assert boolean("true", "stream") is True and boolean("False", "stream") is False
    assert non_negative_int(None, "starting_after") is None
    assert non_negative_int("0", "starting_after") == 0
    for bad in ("yes", "", " true "):
        with pytest.raises(OpenAIError):
            boolean(bad, "stream")
    assert non_negative_int(str(MAX_POSITION), "starting_after") == MAX_POSITION
    # Only ASCII decimal digits: Python's int() also reads underscores, signs, spaces and the
    # digits of other scripts.
    for bad in ("-1", "1.5", "x", str(MAX_POSITION + 1), "9" * 40, "1_0", "+3", " 1", "０", "२"):
        with pytest.raises(OpenAIError) as caught:
            non_negative_int(bad, "starting_after")
        assert caught.value.param == "starting_after"


# --- Redis scripts ---------------------------------------------------------------------------------------


def make_record(client: redis.Redis, response_id: str, status: str = "in_progress") -> None:
    client.hset(keys.record(response_id), mapping={"status": status, "response": b"{}", "store": "1"})
    client.xadd(keys.events(response_id), {"type": "response.created", "data": b"{}"}, id="0-1")
    client.xadd(keys.tokens(response_id), {"t": "1"})
    client.set(keys.input_items(response_id), b"{}")


def delete(client: redis.Redis, response_id: str) -> Any:
    record, flag = keys.record(response_id), keys.cancel(response_id)
    others = [key for key in keys.all_keys(response_id) if key not in (record, flag)]
    return client.eval(DELETE_LUA, 2 + len(others), record, flag, *others, TTL_S)


def existing(client: redis.Redis, response_id: str) -> set[str]:
    return {key for key in keys.all_keys(response_id) if client.exists(key)}


def test_deleting_a_running_response_leaves_only_the_cancel_flag(redis_client: redis.Redis) -> None:
    response_id = ids.new_response_id()
    make_record(redis_client, response_id)
    assert delete(redis_client, response_id) == b"in_progress"
    assert existing(redis_client, response_id) == {keys.cancel(response_id)}
    assert 0 < redis_client.ttl(keys.cancel(response_id)) <= TTL_S
    assert delete(redis_client, response_id) is None


def test_deleting_a_finished_response_leaves_nothing(redis_client: redis.Redis) -> None:
    response_id = ids.new_response_id()
    make_record(redis_client, response_id)
    redis_client.set(keys.cancel(response_id), "1")
    finalised = redis_client.eval(
        FINALIZE_LUA,
        4,
        keys.record(response_id),
        keys.events(response_id),
        keys.input_items(response_id),
        keys.turn(response_id),
        "completed",
        b'{"status":"completed"}',
        TTL_S,
        b"[]",
    )
    assert finalised[0] == b"completed"
    assert delete(redis_client, response_id) == b"completed"
    assert existing(redis_client, response_id) == set()


def test_a_cancel_is_never_overwritten_by_a_late_completion(redis_client: redis.Redis) -> None:
    response_id = ids.new_response_id()
    make_record(redis_client, response_id)
    assert redis_client.eval(CANCEL_LUA, 2, keys.record(response_id), keys.cancel(response_id), TTL_S) == (
        b"cancelled"
    )
    args = (
        4,
        keys.record(response_id),
        keys.events(response_id),
        keys.input_items(response_id),
        keys.turn(response_id),
    )
    assert redis_client.eval(FINALIZE_LUA, *args, "completed", b"{}", TTL_S, b"[]")[0] == b"cancelled"
    assert redis_client.hget(keys.record(response_id), "final") is None
    assert redis_client.eval(FINALIZE_LUA, *args, "cancelled", b'{"c":1}', TTL_S, b"[]")[0] == b"cancelled"
    assert redis_client.eval(CANCEL_LUA, 2, keys.record(response_id), keys.cancel(response_id), TTL_S) == (
        b"cancelled"
    )
    assert redis_client.hget(keys.record(response_id), "response") == b'{"c":1}'
    # The post-processor's input items and event log keep the store TTL once final.
    assert 0 < redis_client.ttl(keys.input_items(response_id)) <= TTL_S


# --- following the event log -----------------------------------------------------------------------------


def log_events(client: redis.Redis, response_id: str, types: list[str]) -> None:
    start = client.xlen(keys.events(response_id))
    for offset, event_type in enumerate(types):
        number = start + offset
        client.xadd(
            keys.events(response_id),
            {"type": event_type, "data": jsonutil.dumps({"type": event_type, "sequence_number": number})},
            id=keys.event_entry_id(number),
        )


async def collect(events: AsyncIterator[tuple[bytes, bytes]]) -> list[int]:
    return [jsonutil.loads(data)["sequence_number"] async for _, data in events]


@pytest.mark.anyio
async def test_following_a_finished_log_gives_what_is_after_the_position_then_ends(
    redis_url: str, redis_client: redis.Redis
) -> None:
    response_id = ids.new_response_id()
    redis_client.hset(keys.record(response_id), "status", "completed")
    log_events(
        redis_client, response_id, ["response.created", "response.in_progress", "x", "response.completed"]
    )
    client = async_redis(redis_url)
    try:
        assert await collect(follow_events(client, response_id)) == [0, 1, 2, 3]
        assert await collect(follow_events(client, response_id, 1)) == [2, 3]
        assert await collect(follow_events(client, response_id, 3)) == []
        assert await collect(follow_events(client, response_id, 50)) == []
    finally:
        await EventHub.close_for(client)
        await client.aclose()


@pytest.mark.anyio
async def test_following_a_live_log_misses_nothing_appended_meanwhile(
    redis_url: str, redis_client: redis.Redis
) -> None:
    response_id = ids.new_response_id()
    redis_client.hset(keys.record(response_id), "status", "in_progress")
    log_events(redis_client, response_id, ["response.created"])
    client = async_redis(redis_url)
    try:
        received: list[int] = []

        async def follow() -> None:
            received.extend(await collect(follow_events(client, response_id, 0)))

        async with anyio.create_task_group() as group:
            group.start_soon(follow)
            await anyio.sleep(0.3)
            # Appended together, as the post-processor appends its last events and the terminal one.
            log_events(redis_client, response_id, ["a", "b", "c", "response.incomplete"])
        assert received == [1, 2, 3, 4]
    finally:
        await EventHub.close_for(client)
        await client.aclose()


@pytest.mark.anyio
async def test_following_ends_when_the_response_is_deleted(redis_url: str, redis_client: redis.Redis) -> None:
    response_id = ids.new_response_id()
    redis_client.hset(keys.record(response_id), "status", "in_progress")
    log_events(redis_client, response_id, ["response.created"])
    client = async_redis(redis_url)
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(collect, follow_events(client, response_id, 0))
                await anyio.sleep(0.2)
                delete(redis_client, response_id)
    finally:
        await EventHub.close_for(client)
        await client.aclose()


@pytest.mark.anyio
async def test_store_refuses_unstored_and_foreign_responses(
    redis_url: str, redis_client: redis.Redis
) -> None:
    client = async_redis(redis_url)
    store = ResponseStore(client, TTL_S)
    try:
        for flag, owner, visible in [("1", "", True), ("0", "", False), ("1", "someone", False)]:
            response_id = ids.new_response_id()
            redis_client.hset(
                keys.record(response_id),
                mapping={
                    "status": "completed",
                    "response": b"{}",
                    "store": flag,
                    "owner": owner,
                    "final": "1",
                },
            )
            if visible:
                assert (await store.get(response_id, ANONYMOUS)).status == "completed"
                continue
            with pytest.raises(OpenAIError) as caught:
                await store.get(response_id, ANONYMOUS)
            assert caught.value.status_code == 404
            assert caught.value.message == f"Response with id '{response_id}' not found."
            with pytest.raises(OpenAIError) as previous:
                await store.earlier_conversation(response_id, ANONYMOUS)
            assert previous.value.status_code == 400 and previous.value.code == "previous_response_not_found"
    finally:
        await EventHub.close_for(client)
        await client.aclose()


# --- item references ---------------------------------------------------------------------------------


def holding(
    client: redis.Redis, item: dict[str, Any], where: str, final: bool = True, owner: str = ""
) -> str:
    """A stored response holding ``item`` as output (``o``) or input (``i``), indexed as its latest holder."""
    response_id = ids.new_response_id()
    output = [item] if where == item_index.OUTPUT else []
    client.hset(
        keys.record(response_id),
        mapping={
            "status": "completed" if final else "in_progress",
            "response": jsonutil.dumps({"id": response_id, "output": output}),
            "store": "1",
            "owner": owner,
            "final": "1" if final else "0",
        },
    )
    client.set(keys.input_items(response_id), jsonutil.dumps({"items": [] if output else [item]}))
    pipe = client.pipeline()
    item_index.index_items(pipe, owner, response_id, [item], where, TTL_S)  # type: ignore[arg-type]
    pipe.execute()
    return response_id


async def resolve(redis_url: str, item_id: str) -> dict[str, Any]:
    client = async_redis(redis_url)
    try:
        resolved = await ResponseStore(client, TTL_S).referenced_items([(0, item_id)], ANONYMOUS)
    finally:
        await client.aclose()
    return resolved[0]


ITEM = {"type": "message", "id": "msg_shared", "role": "assistant", "content": []}


@pytest.mark.anyio
async def test_a_reference_outlives_the_deletion_of_the_latest_response_that_resent_its_item(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """The first response made the item, a later one resent it: deleting the later one leaves the
    item referable through the first (the index once kept the latest holder only)."""
    first = holding(redis_client, ITEM, item_index.OUTPUT)
    resent = holding(redis_client, ITEM, item_index.INPUT)
    assert redis_client.lrange(keys.item_holders("", "msg_shared"), 0, -1) == [
        f"{resent} i".encode(),
        f"{first} o".encode(),
    ]
    assert await resolve(redis_url, "msg_shared") == ITEM
    assert delete(redis_client, resent) == b"completed"
    assert await resolve(redis_url, "msg_shared") == ITEM
    assert delete(redis_client, first) == b"completed"
    with pytest.raises(OpenAIError) as caught:
        await resolve(redis_url, "msg_shared")
    assert caught.value.status_code == 400 and caught.value.param == "input[0].id"


@pytest.mark.anyio
async def test_a_reference_skips_a_holder_whose_output_has_not_ended(
    redis_url: str, redis_client: redis.Redis
) -> None:
    holding(redis_client, ITEM, item_index.INPUT)
    holding(redis_client, ITEM, item_index.OUTPUT, final=False)
    assert await resolve(redis_url, "msg_shared") == ITEM


@pytest.mark.anyio
async def test_an_entry_of_the_single_holder_index_still_resolves(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Entries written before the holder lists stay readable until they expire with their response."""
    response_id = holding(redis_client, ITEM, item_index.OUTPUT)
    redis_client.delete(keys.item_holders("", "msg_shared"))
    redis_client.set(keys.item_ref("", "msg_shared"), f"{response_id} o", ex=TTL_S)
    assert await resolve(redis_url, "msg_shared") == ITEM


def test_the_holders_are_bounded_and_a_holder_indexed_again_moves_first(redis_client: redis.Redis) -> None:
    holders = [holding(redis_client, ITEM, item_index.INPUT) for _ in range(item_index.HOLDERS_KEPT + 2)]
    key = keys.item_holders("", "msg_shared")
    kept = redis_client.lrange(key, 0, -1)
    assert kept == [f"{holder} i".encode() for holder in reversed(holders[2:])]
    assert 0 < redis_client.ttl(key) <= TTL_S
    pipe = redis_client.pipeline()
    item_index.index_items(pipe, "", holders[5], [ITEM], item_index.INPUT, TTL_S)
    pipe.execute()
    again = redis_client.lrange(key, 0, -1)
    assert again[0] == f"{holders[5]} i".encode() and again.count(again[0]) == 1
    assert len(again) == item_index.HOLDERS_KEPT
