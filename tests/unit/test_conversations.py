"""Conversations: ids, the items a conversation stores, the Lua scripts of resq.conversations (on a
Redis of the module's own) and the ownership checks of api.conversations.ConversationStore."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from openai.types.conversations import ConversationItem
from pydantic import TypeAdapter

from api.caller import Caller
from api.conversations import ConversationStore, check_conversation_id, check_item_id, prepare_items
from api.errors import OpenAIError
from api.input_items import PageRequest
from resq import conversations, ids, jsonutil, keys
from resq.redis_client import async_redis
from tests.support.redis_server import PrivateRedis

TTL_S = 600
ALICE = Caller("alice-fingerprint")
BOB = Caller("bob-fingerprint")
ITEM = TypeAdapter(ConversationItem)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def store(private_redis: PrivateRedis, r: redis.Redis) -> AsyncIterator[ConversationStore]:
    client = async_redis(private_redis.url)
    yield ConversationStore(client, TTL_S)
    await client.aclose()


def message(item_id: str, text: str = "hi") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
        "status": "completed",
    }


def run(r: redis.Redis, script: str, conversation_id: str, *args: str | int) -> Any:
    return r.eval(script, 4, *keys.conversation_keys(conversation_id), *args)


def create(r: redis.Redis, items: list[dict[str, Any]] | None = None, owner: str = "alice") -> str:
    conversation_id = ids.new_conversation_id()
    pairs = conversations.item_pairs(items or [])
    status = run(r, conversations.CREATE_LUA, conversation_id, TTL_S, owner, 1700000000, "{}", *pairs)
    assert status == b"created"
    return conversation_id


def append(r: redis.Redis, conversation_id: str, marker: str, items: list[dict[str, Any]]) -> bytes:
    reply: bytes = run(
        r, conversations.APPEND_LUA, conversation_id, *conversations.append_arguments(TTL_S, marker, items)
    )
    return reply


def stored_ids(r: redis.Redis, conversation_id: str) -> list[str]:
    values: list[bytes] = r.lrange(keys.conversation_items(conversation_id), 0, -1)  # type: ignore[assignment]
    return [value.decode() for value in values]


def texts(r: redis.Redis, conversation_id: str) -> dict[str, str]:
    data: dict[bytes, bytes] = r.hgetall(keys.conversation_item_data(conversation_id))  # type: ignore[assignment]
    return {key.decode(): jsonutil.loads(value)["content"][0]["text"] for key, value in data.items()}


def page(
    r: redis.Redis, conversation_id: str, limit: int, order: str, after: str = ""
) -> tuple[bool, list[str]]:
    reply = run(r, conversations.PAGE_LUA, conversation_id, TTL_S, limit, order, after)
    assert reply[0] == b"alice" and reply[1] in (b"0", b"1")
    return reply[1] == b"1", [jsonutil.loads(value)["id"] for value in reply[2:]]


# --- ids -----------------------------------------------------------------------------------------


def test_conversation_ids_are_conv_and_32_hex_digits() -> None:
    issued = ids.new_conversation_id()
    assert ids.is_conversation_id(issued) and check_conversation_id(issued) == issued
    assert issued != ids.new_conversation_id()
    for malformed in ("", "conv_", "conv_abc", "conv_" + "A" * 32, "conv_" + "0" * 33, "resp_" + "0" * 32):
        assert not ids.is_conversation_id(malformed)
        with pytest.raises(OpenAIError) as caught:
            check_conversation_id(malformed, "conversation")
        assert caught.value.status_code == 400 and caught.value.param == "conversation"


def test_item_ids_are_short_printable_and_without_whitespace() -> None:
    for good in ("msg_1", "a" * 256, "fc/with:punctuation", "ünïcödé"):
        assert conversations.is_item_id(good) and check_item_id(good) == good
    bad_ids = (
        "",
        "a" * 257,
        "a b",
        "a\tb",
        "a\nb",
        "nul\x00",
        "del\x7f",
        "zero\u200bwidth",
        "nbsp\u00a0",
        ".",
        "..",
    )
    for bad in bad_ids:
        assert not conversations.is_item_id(bad)
        with pytest.raises(OpenAIError) as caught:
            check_item_id(bad)
        assert caught.value.status_code == 400 and caught.value.param == "item_id"


def test_fresh_item_ids_carry_their_type_prefix() -> None:
    for item_type, prefix in conversations.ITEM_ID_PREFIXES.items():
        item_id = conversations.new_item_id(item_type)
        assert item_id.startswith(prefix + "_") and len(item_id) == len(prefix) + 1 + 32
    assert conversations.new_item_id("message") != conversations.new_item_id("message")


def test_append_arguments_need_an_id_on_every_item() -> None:
    items = [message("msg_a"), message("msg_b", "there")]
    arguments = conversations.append_arguments(60, "resp_x", items)
    assert arguments[:2] == [60, "resp_x"]
    assert arguments[2::2] == ["msg_a", "msg_b"]
    assert [jsonutil.loads(str(value)) for value in arguments[3::2]] == items
    assert conversations.append_arguments(60, "", []) == [60, ""]
    for missing in ({**message("x"), "id": ""}, {"type": "message", "role": "user", "content": []}):
        with pytest.raises(ValueError):
            conversations.append_arguments(60, "", [message("ok"), missing])


# --- prepared items --------------------------------------------------------------------------------


def test_prepared_items_have_the_sdk_conversation_item_shape() -> None:
    sent: list[dict[str, Any]] = [
        {"role": "user", "content": "Hello"},
        {"type": "message", "role": "assistant", "content": "Hi!", "id": "msg_mine"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "g", "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "y"},
        {"type": "reasoning", "summary": [], "encrypted_content": "sealed-blob"},
    ]
    prepared = prepare_items(sent)
    prefixes = ["msg_", "msg_mine", "fc_", "fco_", "ctc_", "ctco_", "rs_"]
    for item, prefix in zip(prepared, prefixes, strict=True):
        assert item["id"].startswith(prefix)
        ITEM.validate_python(item, strict=False)
    assert prepared[0]["content"] == [{"type": "input_text", "text": "Hello"}]
    assert prepared[1]["content"] == [{"type": "output_text", "text": "Hi!", "annotations": []}]
    assert prepared[6]["encrypted_content"] == "sealed-blob"  # stored as sent
    assert all(item["status"] == "completed" for item in prepared)


def test_references_bad_ids_and_repeated_ids_are_refused() -> None:
    cases = [
        ([{"type": "item_reference", "id": "msg_1"}], "items[0]"),
        ([{"role": "user", "content": "x", "id": "a b"}], "items[0].id"),
        (
            [{"role": "user", "content": "x", "id": "d"}, {"role": "user", "content": "y", "id": "d"}],
            "items[1].id",
        ),
    ]
    for items, param in cases:
        with pytest.raises(OpenAIError) as caught:
            prepare_items(items)
        assert caught.value.status_code == 400 and caught.value.param == param
    with pytest.raises(OpenAIError) as reference:
        prepare_items([{"type": "item_reference", "id": "msg_1"}])
    assert "item_reference" in reference.value.message


# --- the scripts -------------------------------------------------------------------------------------


def test_a_marker_appends_its_items_exactly_once(r: redis.Redis) -> None:
    conversation_id = create(r, [message("msg_0")])
    output = [message("msg_1", "one"), message("msg_2", "two")]
    assert append(r, conversation_id, "resp_a", output) == b"appended"
    assert append(r, conversation_id, "resp_a", output) == b"duplicate"
    assert append(r, conversation_id, "resp_a", [message("msg_9")]) == b"duplicate"  # nothing written
    assert stored_ids(r, conversation_id) == ["msg_0", "msg_1", "msg_2"]
    assert r.smembers(keys.conversation_appended(conversation_id)) == {b"resp_a"}
    assert append(r, conversation_id, "resp_b", [message("msg_3")]) == b"appended"
    # A client's own add has no marker: every add appends.
    assert append(r, conversation_id, "", [message("msg_4")]) == b"appended"
    assert append(r, conversation_id, "", [message("msg_5")]) == b"appended"
    assert stored_ids(r, conversation_id) == ["msg_0", "msg_1", "msg_2", "msg_3", "msg_4", "msg_5"]
    assert r.smembers(keys.conversation_appended(conversation_id)) == {b"resp_a", b"resp_b"}


def test_an_id_appended_again_keeps_its_place_and_takes_the_new_item(r: redis.Redis) -> None:
    conversation_id = create(r, [message("msg_a", "first"), message("msg_b", "second")])
    assert append(r, conversation_id, "", [message("msg_a", "replaced"), message("msg_c", "third")]) == (
        b"appended"
    )
    assert stored_ids(r, conversation_id) == ["msg_a", "msg_b", "msg_c"]
    assert texts(r, conversation_id) == {"msg_a": "replaced", "msg_b": "second", "msg_c": "third"}
    # Twice in one append: one place, the last item.
    assert append(r, conversation_id, "resp_x", [message("msg_d", "1"), message("msg_d", "2")]) == b"appended"
    assert stored_ids(r, conversation_id) == ["msg_a", "msg_b", "msg_c", "msg_d"]
    assert texts(r, conversation_id)["msg_d"] == "2"


def test_nothing_is_written_to_a_missing_conversation(r: redis.Redis) -> None:
    conversation_id = ids.new_conversation_id()
    assert append(r, conversation_id, "resp_a", [message("msg_1")]) == b"missing"
    assert append(r, conversation_id, "", [message("msg_1")]) == b"missing"
    assert run(r, conversations.UPDATE_LUA, conversation_id, TTL_S, "{}") == b"missing"
    assert run(r, conversations.DELETE_ITEM_LUA, conversation_id, TTL_S, "msg_1") == b"missing"
    assert run(r, conversations.DELETE_LUA, conversation_id) == b"missing"
    for script in (conversations.HEADER_LUA, conversations.ALL_ITEMS_LUA):
        assert run(r, script, conversation_id, TTL_S) is None
    assert run(r, conversations.PAGE_LUA, conversation_id, TTL_S, 20, "desc", "") is None
    assert run(r, conversations.ITEM_LUA, conversation_id, TTL_S, "msg_1") is None
    assert not any(r.exists(key) for key in keys.conversation_keys(conversation_id))


def test_create_starts_empty_and_never_overwrites(r: redis.Redis) -> None:
    conversation_id = ids.new_conversation_id()
    # Leftovers of nothing that exists (the hash is what makes a conversation) are cleared.
    r.rpush(keys.conversation_items(conversation_id), "stale")
    status = run(r, conversations.CREATE_LUA, conversation_id, TTL_S, "alice", 1700000000, '{"a":"b"}')
    assert status == b"created"
    assert stored_ids(r, conversation_id) == []
    header = run(r, conversations.HEADER_LUA, conversation_id, TTL_S)
    assert header == [b"alice", b"1700000000", b'{"a":"b"}']
    again = run(
        r,
        conversations.CREATE_LUA,
        conversation_id,
        TTL_S,
        "bob",
        1,
        "{}",
        *conversations.item_pairs([message("m")]),
    )
    assert again == b"exists"
    assert run(r, conversations.HEADER_LUA, conversation_id, TTL_S)[0] == b"alice"
    assert stored_ids(r, conversation_id) == []


def test_pages_follow_after_in_both_orders(r: redis.Redis) -> None:
    every = [f"msg_{index:02d}" for index in range(45)]
    conversation_id = create(r, [message(item_id) for item_id in every[:20]])
    assert append(r, conversation_id, "", [message(item_id) for item_id in every[20:40]]) == b"appended"
    assert append(r, conversation_id, "resp_z", [message(item_id) for item_id in every[40:]]) == b"appended"
    for order, expected in (("asc", every), ("desc", every[::-1])):
        seen: list[str] = []
        after = ""
        more = True
        while more:
            more, page_ids = page(r, conversation_id, 10, order, after)
            seen += page_ids
            after = page_ids[-1]
            assert len(page_ids) == 10 or not more
        assert seen == expected
    assert page(r, conversation_id, 100, "asc") == (False, every)
    assert page(r, conversation_id, 45, "desc") == (False, every[::-1])
    assert page(r, conversation_id, 44, "desc") == (True, every[:0:-1])
    assert page(r, conversation_id, 3, "asc", "msg_40") == (True, ["msg_41", "msg_42", "msg_43"])
    assert page(r, conversation_id, 3, "asc", "msg_41") == (False, ["msg_42", "msg_43", "msg_44"])
    assert page(r, conversation_id, 3, "asc", "msg_42") == (False, ["msg_43", "msg_44"])
    assert page(r, conversation_id, 3, "asc", "msg_44") == (False, [])
    assert page(r, conversation_id, 3, "desc", "msg_02") == (False, ["msg_01", "msg_00"])
    assert page(r, conversation_id, 2, "desc", "msg_02") == (False, ["msg_01", "msg_00"])
    assert page(r, conversation_id, 1, "desc", "msg_02") == (True, ["msg_01"])
    assert page(r, conversation_id, 5, "desc", "msg_00") == (False, [])
    missing = run(r, conversations.PAGE_LUA, conversation_id, TTL_S, 5, "asc", "msg_nope")
    assert missing == [b"alice", b"after_missing"]


def test_an_empty_conversation_has_empty_pages(r: redis.Redis) -> None:
    conversation_id = create(r)
    for order in ("asc", "desc"):
        assert page(r, conversation_id, 20, order) == (False, [])
    assert run(r, conversations.ALL_ITEMS_LUA, conversation_id, TTL_S) == [b"alice"]


def test_every_item_is_read_in_order_however_many(r: redis.Redis) -> None:
    conversation_id = create(r)
    every = [f"item_{index}" for index in range(2500)]  # more than one HMGET slice, more than unpack takes
    for start in range(0, len(every), 500):
        batch = [message(item_id) for item_id in every[start : start + 500]]
        assert append(r, conversation_id, "", batch) == b"appended"
    reply = run(r, conversations.ALL_ITEMS_LUA, conversation_id, TTL_S)
    assert reply[0] == b"alice"
    assert [jsonutil.loads(value)["id"] for value in reply[1:]] == every


def test_deleting_an_item_removes_it_from_the_list_and_the_data(r: redis.Redis) -> None:
    conversation_id = create(r, [message("msg_a"), message("msg_b"), message("msg_c")])
    assert run(r, conversations.DELETE_ITEM_LUA, conversation_id, TTL_S, "msg_b") == b"deleted"
    assert run(r, conversations.DELETE_ITEM_LUA, conversation_id, TTL_S, "msg_b") == b"no_item"
    assert run(r, conversations.DELETE_ITEM_LUA, conversation_id, TTL_S, "msg_zzz") == b"no_item"
    assert stored_ids(r, conversation_id) == ["msg_a", "msg_c"]
    assert set(texts(r, conversation_id)) == {"msg_a", "msg_c"}
    assert run(r, conversations.ITEM_LUA, conversation_id, TTL_S, "msg_b") == [b"alice"]
    item = run(r, conversations.ITEM_LUA, conversation_id, TTL_S, "msg_c")
    assert item[0] == b"alice" and jsonutil.loads(item[1]) == message("msg_c")
    # Appended again after its deletion, an item goes to the end.
    assert append(r, conversation_id, "", [message("msg_b")]) == b"appended"
    assert stored_ids(r, conversation_id) == ["msg_a", "msg_c", "msg_b"]


def test_deleting_the_conversation_removes_every_key(r: redis.Redis) -> None:
    conversation_id = create(r, [message("msg_a")])
    assert append(r, conversation_id, "resp_a", [message("msg_b")]) == b"appended"
    assert all(r.exists(key) for key in keys.conversation_keys(conversation_id))
    assert run(r, conversations.DELETE_LUA, conversation_id) == b"deleted"
    assert not any(r.exists(key) for key in keys.conversation_keys(conversation_id))
    # A post-processor arriving late writes nothing.
    assert append(r, conversation_id, "resp_b", [message("msg_c")]) == b"missing"
    assert not any(r.exists(key) for key in keys.conversation_keys(conversation_id))


def test_every_read_and_write_refreshes_the_ttl_of_every_key(r: redis.Redis) -> None:
    conversation_id = create(r, [message("msg_a")])
    assert append(r, conversation_id, "resp_a", [message("msg_b")]) == b"appended"
    every_key = keys.conversation_keys(conversation_id)
    assert all(0 < r.ttl(key) <= TTL_S for key in every_key)
    calls: list[tuple[str, tuple[str | int, ...]]] = [
        (conversations.HEADER_LUA, (TTL_S,)),
        (conversations.ALL_ITEMS_LUA, (TTL_S,)),
        (conversations.PAGE_LUA, (TTL_S, 1, "asc", "")),
        (conversations.PAGE_LUA, (TTL_S, 1, "desc", "msg_zzz")),
        (conversations.ITEM_LUA, (TTL_S, "msg_a")),
        (conversations.ITEM_LUA, (TTL_S, "msg_zzz")),
        (conversations.UPDATE_LUA, (TTL_S, '{"k":"v"}')),
        (conversations.APPEND_LUA, tuple(conversations.append_arguments(TTL_S, "", [message("msg_c")]))),
        (conversations.DELETE_ITEM_LUA, (TTL_S, "msg_c")),
        (conversations.DELETE_ITEM_LUA, (TTL_S, "msg_zzz")),
    ]
    for script, args in calls:
        for key in every_key:
            r.expire(key, 5)
        run(r, script, conversation_id, *args)
        assert all(TTL_S - 5 < r.ttl(key) <= TTL_S for key in every_key), script


# --- the store ------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_store_serves_its_owner_and_nobody_else(store: ConversationStore) -> None:
    created = await store.create(ALICE, prepare_items([{"role": "user", "content": "Hi"}]), {"a": "b"})
    conversation_id = created.conversation_id
    assert (await store.get(conversation_id, ALICE)).to_json() == {
        "id": conversation_id,
        "object": "conversation",
        "created_at": created.created_at,
        "metadata": {"a": "b"},
    }
    added = await store.add_items(
        conversation_id, ALICE, prepare_items([{"role": "assistant", "content": "Yo"}])
    )
    every = await store.prompt_items(conversation_id, ALICE)
    assert [item["role"] for item in every] == ["user", "assistant"] and every[1] == added[0]
    listed = await store.list_items(conversation_id, ALICE, PageRequest(limit=1, order="asc"))
    assert listed["first_id"] == listed["last_id"] == every[0]["id"] and listed["has_more"] is True

    unknown = ids.new_conversation_id()
    for other, target in ((BOB, conversation_id), (ALICE, unknown)):
        calls = [
            store.get(target, other),
            store.update(target, other, {}),
            store.delete(target, other),
            store.add_items(target, other, prepare_items([{"role": "user", "content": "x"}])),
            store.list_items(target, other, PageRequest()),
            store.get_item(target, every[0]["id"], other),
            store.delete_item(target, every[0]["id"], other),
        ]
        for call in calls:
            with pytest.raises(OpenAIError) as caught:
                await call
            assert caught.value.status_code == 404 and caught.value.param == "conversation_id"
            assert caught.value.message == f"Conversation with id '{target}' not found."
        with pytest.raises(OpenAIError) as prompt:
            await store.prompt_items(target, other, "conversation")
        assert prompt.value.status_code == 404 and prompt.value.param == "conversation"
    # Bob's attempts changed nothing.
    assert await store.prompt_items(conversation_id, ALICE) == every
    assert (await store.get(conversation_id, ALICE)).metadata == {"a": "b"}


@pytest.mark.anyio
async def test_the_store_checks_ids_before_touching_redis() -> None:
    class NoRedis:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"Redis was used ({name})")

    store = ConversationStore(NoRedis(), TTL_S)  # type: ignore[arg-type]
    good = ids.new_conversation_id()
    for call, param in (
        (store.get("conv_nope", ALICE), "conversation_id"),
        (store.prompt_items("resp_" + "0" * 32, ALICE), "conversation"),
        (store.prompt_items("x", ALICE, "conversation.id"), "conversation.id"),
        (store.list_items("conv_", ALICE, PageRequest()), "conversation_id"),
        (store.get_item(good, "a b", ALICE), "item_id"),
        (store.delete_item(good, "a\x00", ALICE), "item_id"),
        (store.delete_item("nope", "a\x00", ALICE), "conversation_id"),
    ):
        with pytest.raises(OpenAIError) as caught:
            await call
        assert caught.value.status_code == 400 and caught.value.param == param


@pytest.mark.anyio
async def test_items_of_the_store_can_be_read_one_by_one_and_deleted(store: ConversationStore) -> None:
    created = await store.create(ALICE, prepare_items([{"role": "user", "content": "a", "id": "one"}]), {})
    conversation_id = created.conversation_id
    assert (await store.get_item(conversation_id, "one", ALICE))["content"][0]["text"] == "a"
    assert (await store.delete_item(conversation_id, "one", ALICE)).conversation_id == conversation_id
    for call in (
        store.get_item(conversation_id, "one", ALICE),
        store.delete_item(conversation_id, "one", ALICE),
    ):
        with pytest.raises(OpenAIError) as caught:
            await call
        assert caught.value.status_code == 404 and caught.value.param == "item_id"
    empty = await store.list_items(conversation_id, ALICE, PageRequest())
    assert empty == {"object": "list", "data": [], "first_id": "", "last_id": "", "has_more": False}
    with pytest.raises(OpenAIError) as after:
        await store.list_items(conversation_id, ALICE, PageRequest(after="one"))
    assert after.value.status_code == 400 and after.value.param == "after"
    await store.delete(conversation_id, ALICE)
    with pytest.raises(OpenAIError):
        await store.get(conversation_id, ALICE)
