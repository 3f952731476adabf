"""A pipeline run as one guarded script writes what its MULTI wrote, or nothing when refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.client import Pipeline

from resq import conversations, item_index, keys, records, turns
from resq.guarded_step import GuardedStep, UnembeddedScriptError
from resq.recovery import generations
from resq.recovery.leases import register_lease
from tests.support.redis_server import PrivateRedis

RESPONSE = "resp_guarded"
PARENT = "resp_parent"
CONVERSATION = "conv_guarded"


def _stage(pipe: Pipeline, limit: int) -> None:
    """A step like the API's: the admission first, then a lease, a record, an event log, a
    turn continuing another (its script refreshes the ancestors), its input's item index, a
    message, a wake-up."""
    generations.admit(pipe, RESPONSE, 1_700_000_000.5, limit, "owner", 3)
    register_lease(pipe, RESPONSE, 30.0)
    pipe.hset(keys.record(RESPONSE), mapping={"status": "in_progress", "store": "1", "n": 7})
    pipe.expire(keys.record(RESPONSE), 600)
    for number, kind in enumerate(("response.created", "response.in_progress")):
        pipe.xadd(keys.events(RESPONSE), {"type": kind, "data": "{}"}, id=keys.event_entry_id(number))
    pipe.expire(keys.events(RESPONSE), 600)
    pipe.set(keys.input_items(RESPONSE), b'{"items": []}', ex=600)
    pipe.eval(
        turns.CREATE_LUA,
        1,
        keys.turn(RESPONSE),
        *turns.create_arguments(PARENT, [{"type": "message", "role": "user"}], 900, 1200),
    )
    item_index.index_items(pipe, "owner", RESPONSE, [{"id": "msg_1"}, {"id": "msg_2"}], item_index.INPUT, 900)
    # What a response recorded already ended adds: its final record, its conversation's items.
    pipe.eval(
        records.FINALIZE_LUA,
        4,
        keys.record(RESPONSE),
        keys.events(RESPONSE),
        keys.input_items(RESPONSE),
        keys.turn(RESPONSE),
        "completed",
        b'{"output": []}',
        700,
        "[]",
    )
    pipe.eval(
        conversations.APPEND_LUA,
        4,
        *keys.conversation_keys(CONVERSATION),
        *conversations.append_arguments(800, RESPONSE, [{"id": "msg_1", "type": "message"}]),
    )
    pipe.lpush("test:queue", b'{"body": "message"}')
    pipe.xadd("test:wake", {"w": "1"}, maxlen=1, approximate=False)
    pipe.expire("test:wake", 60)


def _contents(client: redis.Redis) -> dict[bytes, Any]:
    """Every key's type and value; stream ids made by Redis ('*') and times left out."""
    found: dict[bytes, Any] = {}
    for key in sorted(client.keys("*")):
        kind = client.type(key)
        if kind == b"hash":
            value: Any = client.hgetall(key)
        elif kind == b"stream":
            entries = client.xrange(key)
            value = [fields for _id, fields in entries] if key == b"test:wake" else entries
        elif kind == b"list":
            value = client.lrange(key, 0, -1)
        elif kind == b"zset":
            value = client.zrange(key, 0, -1)
        elif kind == b"set":
            value = sorted(client.smembers(key))
        else:
            value = client.get(key)
        found[key] = (kind, value, client.ttl(key) > 0)
    return found


def _seed(client: redis.Redis) -> None:
    """The parent turn the new one continues, the conversation its items join."""
    client.hset(keys.turn(PARENT), mapping={"parent": "", "input": "[]", "children": 0, "deleted": 0})
    client.expire(keys.turn(PARENT), 100)
    client.hset(keys.conversation_keys(CONVERSATION)[0], mapping={"owner": "owner", "created_at": 1})


def test_a_guarded_step_writes_what_the_multi_of_the_same_commands_wrote(private_redis: PrivateRedis) -> None:
    client = private_redis.client()

    async def run(guarded: bool) -> None:
        async_client = AsyncRedis.from_url(private_redis.url)
        pipe = async_client.pipeline(transaction=True)
        _stage(pipe, limit=10)
        if guarded:
            assert await GuardedStep(async_client).execute(pipe) is None
            assert pipe.command_stack == []  # reset: the pipeline itself never ran
        else:
            await pipe.execute()
        await async_client.aclose()

    client.flushdb()
    _seed(client)
    asyncio.run(run(guarded=False))
    by_multi = _contents(client)
    client.flushdb()
    _seed(client)
    asyncio.run(run(guarded=True))
    by_step = _contents(client)
    assert by_step == by_multi
    # The embedded scripts ran: the lease is registered, the turn linked to its parent (whose TTL
    # the turn's script raised to the ancestors' 1,200 s).
    assert by_step[keys.GENERATIONS.encode()][1] == [RESPONSE.encode()]
    assert client.hget(keys.turn(PARENT), "children") == b"1"
    assert client.ttl(keys.turn(PARENT)) > 1000
    assert client.zscore(keys.POSTPROCESS_LEASES, RESPONSE) is not None
    assert client.hget(keys.record(RESPONSE), "final") == b"1"
    assert client.lrange(keys.conversation_keys(CONVERSATION)[1], 0, -1) == [b"msg_1"]
    client.close()


def test_a_refusing_guard_leaves_nothing_written(private_redis: PrivateRedis) -> None:
    client = private_redis.client()
    client.flushdb()
    client.zadd(keys.GENERATIONS, {"resp_a": 1.0, "resp_b": 2.0})  # at a limit of 2 already
    before = _contents(client)

    async def run() -> int | None:
        async_client = AsyncRedis.from_url(private_redis.url)
        pipe = async_client.pipeline(transaction=True)
        _stage(pipe, limit=2)
        try:
            return await GuardedStep(async_client).execute(pipe)
        finally:
            await async_client.aclose()

    assert asyncio.run(run()) == 1
    assert _contents(client) == before
    client.close()


@pytest.mark.parametrize(
    ("parent_there", "limit", "refused"), [(False, 10, 1), (True, 2, 2), (True, 10, None)]
)
def test_a_step_of_two_guards_says_which_refused_and_a_refusal_writes_nothing(
    private_redis: PrivateRedis, parent_there: bool, limit: int, refused: int | None
) -> None:
    """The API's step for a continuation: the parent's turn must be there (a read), then the
    admission (which writes when it admits); a refusal by either leaves Redis as it was."""
    client = private_redis.client()
    client.flushdb()
    _seed(client)
    if not parent_there:
        client.delete(keys.turn(PARENT))  # the parent was deleted after the request read it
    client.zadd(keys.GENERATIONS, {"resp_a": 1.0, "resp_b": 2.0})
    before = _contents(client)

    async def run() -> int | None:
        async_client = AsyncRedis.from_url(private_redis.url)
        pipe = async_client.pipeline(transaction=True)
        turns.stage_parent_check(pipe, PARENT)
        _stage(pipe, limit=limit)
        try:
            return await GuardedStep(async_client).execute(pipe, guards=2)
        finally:
            await async_client.aclose()

    assert asyncio.run(run()) == refused
    if refused is None:
        assert client.exists(keys.turn(RESPONSE)) == 1
    else:
        assert _contents(client) == before
    client.close()


def test_a_step_survives_a_flushed_script_cache_and_refuses_scripts_it_cannot_inline(
    private_redis: PrivateRedis,
) -> None:
    client = private_redis.client()
    client.flushdb()

    async def run() -> None:
        async_client = AsyncRedis.from_url(private_redis.url)
        step = GuardedStep(async_client)
        try:
            client.script_flush()  # a restarted Redis: the script is loaded again (NOSCRIPT)
            pipe = async_client.pipeline(transaction=True)
            _stage(pipe, limit=10)
            assert await step.execute(pipe) is None
            pipe = async_client.pipeline(transaction=True)
            generations.admit(pipe, "resp_other", 1.0, 10)
            pipe.eval("return redis.call('DEL', KEYS[1])", 1, keys.record(RESPONSE))
            with pytest.raises(UnembeddedScriptError):
                await step.execute(pipe)
        finally:
            await async_client.aclose()

    asyncio.run(run())
    assert client.exists(keys.record(RESPONSE)) == 1  # the refused step sent nothing
    assert client.zscore(keys.GENERATIONS, "resp_other") is None
    client.close()
