"""The API's event hub: one blocking read shared by every follower, none of them missing an entry."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from api.event_hub import EventHub, Follower, IdleWakeups
from resq.events.emitter import EncodedEvent
from resq.redis_types import format_id, parse_id


def test_stream_ids_compare_numerically() -> None:
    assert parse_id(b"0-10") > parse_id("0-9")
    assert parse_id("1700000000000-0") > parse_id("0-99")
    assert format_id(parse_id("12-3")) == "12-3"


def test_a_follower_takes_each_entry_once_and_in_order() -> None:
    async def scenario() -> None:
        follower = Follower(parse_id("0-1"))
        follower.deliver([(b"0-1", {}), (b"0-2", {b"n": b"2"})])
        follower.deliver([(b"0-2", {b"n": b"2"}), (b"0-3", {b"n": b"3"})])
        batch = await follower.next_batch()
        assert [entry_id for entry_id, _ in batch] == [b"0-2", b"0-3"]
        assert await follower.next_batch(wait=False) == []

    asyncio.run(scenario())


def test_a_waiting_follower_wakes_on_entries_or_at_its_idle_deadline_never_with_a_timer() -> None:
    async def scenario() -> None:
        idle = IdleWakeups(idle_s=10)
        follower = Follower(parse_id("0-0"), idle)
        waiting = asyncio.create_task(follower.next_batch())
        await asyncio.sleep(0)
        assert asyncio.get_running_loop()._scheduled == []  # type: ignore[attr-defined]  # no timer armed
        began = time.monotonic()
        idle.wake_due(began + 5)  # not yet
        await asyncio.sleep(0)
        assert not waiting.done()
        follower.deliver([(b"0-1", {b"n": b"1"})])
        assert [entry_id for entry_id, _ in await waiting] == [b"0-1"]
        # The next wait has a deadline of its own: the first wait's, passing, does not end it.
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(follower.next_batch())
        await asyncio.sleep(0)
        idle.wake_due(began + 10.01)
        await asyncio.sleep(0)
        assert not waiting.done()
        idle.wake_due(time.monotonic() + 10.001)
        assert await asyncio.wait_for(waiting, 1) == []
        # A cancelled wait leaves nothing behind: its deadline finds no wait, entries are kept.
        waiting = asyncio.create_task(follower.next_batch())
        await asyncio.sleep(0)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        idle.wake_due(time.monotonic() + 20)
        follower.deliver([(b"0-2", {})])
        assert [entry_id for entry_id, _ in await follower.next_batch(wait=False)] == [b"0-2"]

    asyncio.run(scenario())


def test_idle_deadlines_come_due_in_the_order_the_waits_began_spread_out_not_all_at_once() -> None:
    async def scenario() -> None:
        idle = IdleWakeups(idle_s=0.2)
        followers = [Follower(parse_id("0-0"), idle) for _ in range(3)]
        waits = []
        for follower in followers:
            waits.append(asyncio.create_task(follower.next_batch()))
            await asyncio.sleep(0.05)
        first_due = time.monotonic() - 0.15 + 0.2
        idle.wake_due(first_due + 0.01)  # only the first wait is due
        await asyncio.sleep(0)
        assert [wait.done() for wait in waits] == [True, False, False]
        idle.wake_due(time.monotonic() + 0.2)
        assert await asyncio.gather(*waits[1:]) == [[], []]

    asyncio.run(scenario())


async def _read_until(follower: Follower, last: bytes) -> list[bytes]:
    seen: list[bytes] = []
    async with asyncio.timeout(5):  # the hub delivered everything within 5 s
        while not seen or seen[-1] != last:
            seen += [entry_id for entry_id, _ in await follower.next_batch()]
    return seen


@contextlib.asynccontextmanager
async def _hub_on(redis_url: str, *logs: str, **options: Any) -> AsyncIterator[tuple[Redis, EventHub]]:
    """A client and an :class:`EventHub` with ``options``, ``logs`` deleted before and after."""
    redis = Redis.from_url(redis_url)
    hub = EventHub(redis, **options)
    await redis.delete(*logs)
    try:
        yield redis, hub
    finally:
        await hub.close()
        await redis.delete(*logs)
        await redis.aclose()


@pytest.mark.timeout(60)
def test_followers_of_many_logs_and_late_joiners_see_every_entry(redis_url: str) -> None:
    async def scenario() -> None:
        logs = [f"test:hub:{index}" for index in range(20)]
        everything = [f"0-{number}".encode() for number in range(1, 6)]
        async with (
            _hub_on(redis_url, *logs, block_ms=200) as (redis, hub),
            contextlib.AsyncExitStack() as stack,
        ):
            followers = [await stack.enter_async_context(hub.follow(key, "0-0")) for key in logs]
            await asyncio.sleep(0.3)  # the hub is blocked on all 20 logs by now
            for number in range(1, 4):
                for key in logs:
                    await redis.xadd(key, {"n": number}, id=f"0-{number}")
            # A second follower of log 0 joins late, from the start: it catches up, then follows.
            late = await stack.enter_async_context(hub.follow(logs[0], "0-0"))
            for number in range(4, 6):
                for key in logs:
                    await redis.xadd(key, {"n": number}, id=f"0-{number}")
            for follower in [*followers, late]:
                assert await _read_until(follower, b"0-5") == everything
            # One that resumes after entry 3 gets only what follows it.
            resumed = await stack.enter_async_context(hub.follow(logs[1], "0-3"))
            assert await _read_until(resumed, b"0-5") == everything[3:]

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_the_hub_wakes_an_idle_follower_with_an_empty_batch(redis_url: str) -> None:
    async def scenario() -> None:
        key = "test:hub:idle"
        async with (
            _hub_on(redis_url, key, block_ms=200, idle_s=0.05) as (redis, hub),
            hub.follow(key, "0-0") as follower,
        ):
            started = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(follower.next_batch(), 2) == []
            # Woken at its idle deadline, within a tick of the hub's ticker.
            assert 0.05 <= asyncio.get_running_loop().time() - started < 1
            await redis.xadd(key, {"n": 1}, id="0-1")
            assert [entry_id for entry_id, _ in await asyncio.wait_for(follower.next_batch(), 2)] == [b"0-1"]

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_closing_the_hub_ends_it_even_when_a_read_swallowed_the_cancel(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's ``asyncio.wait_for`` (redis-py sends through one) returns normally when a
    cancel lands just as its inner future finished; the hub must still stop, not wait for new
    followers forever (that hung the API's shutdown, and the suite's event-loop teardown)."""
    reads_after_cancel: list[bytes] = []

    async def read_that_swallows_a_cancel(self: EventHub, command: bytes) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            reads_after_cancel.append(command)  # returned as if the read had completed
        return None

    monkeypatch.setattr(EventHub, "_read", read_that_swallows_a_cancel)

    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        hub = EventHub(redis)
        try:
            async with hub.follow("test:hub:swallowed", "0-0"):
                await asyncio.sleep(0.1)  # the hub is in its read
            started = time.monotonic()
            await asyncio.wait_for(hub.close(), 5)
            assert time.monotonic() - started < 2
            assert len(reads_after_cancel) == 1
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def _opening(count: int) -> list[EncodedEvent]:
    return [EncodedEvent(number, "response.created", b'{"n": %d}' % number) for number in range(count)]


@pytest.mark.timeout(30)
def test_a_log_opened_as_it_is_created_needs_no_catch_up_read_and_wakes_the_hub_in_its_own_step(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """:meth:`EventHub.open_new`: the follower holds the opening events, the hub's wake-up rides on
    the step that creates the log (no round trip of its own), and no ``XRANGE`` is made."""
    ranges: list[object] = []
    original_xrange = Redis.xrange

    async def spied_xrange(self: Redis, *args: object, **kwargs: object) -> object:
        ranges.append(args)
        return await original_xrange(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Redis, "xrange", spied_xrange)

    async def scenario() -> None:
        other, key = "test:hub:other", "test:hub:opened"
        async with _hub_on(redis_url, other, key, block_ms=5000) as (redis, hub), hub.follow(other, "0-0"):
            await asyncio.sleep(0.2)  # the hub is blocked on the other log, for 5 s
            opened = hub.open_new(key, _opening(2))
            pipe = redis.pipeline(transaction=True)
            for event in _opening(2):
                pipe.xadd(key, {"type": event.type, "data": event.data}, id=f"0-{event.sequence_number + 1}")
            opened.stage_wake(pipe)
            assert len(pipe) == 4  # the two events, and the wake-up's XADD and EXPIRE
            await pipe.execute()
            async with hub.following(opened) as follower:
                first = await follower.next_batch(wait=False)
                assert [entry_id for entry_id, _ in first] == [b"0-1", b"0-2"]
                assert first[1][1] == {b"type": b"response.created", b"data": b'{"n": 1}'}
                await redis.xadd(key, {"type": "x", "data": "3"}, id="0-3")
                # Well within the hub's 5 s block: the staged wake-up made it read the new log.
                batch = await asyncio.wait_for(follower.next_batch(), 2)
                assert [entry_id for entry_id, _ in batch] == [b"0-3"]
            assert hub._streams.position(key.encode()) is None  # closed: no longer followed
            assert ranges == [(other,)]  # the other log's follow caught up; the opened one never did

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_an_opened_log_whose_step_failed_or_whose_relay_never_ran_leaves_the_hub(redis_url: str) -> None:
    async def scenario() -> None:
        other = "test:hub:other"
        async with (
            _hub_on(redis_url, other, "test:hub:late", block_ms=5000) as (redis, hub),
            hub.follow(other, "0-0"),
        ):
            await asyncio.sleep(0.2)
            # The creating step failed: the follower leaves, and the wake-up the join owed
            # is still sent (a joiner meanwhile relied on it and sent none).
            failed = hub.open_new("test:hub:failed", _opening(1))
            late = hub.open_new("test:hub:late", _opening(1))
            late.stage_wake(pipe := redis.pipeline(transaction=False))
            assert len(pipe) == 0  # the first join owes the wake-up, this one none
            await failed.abandon()
            assert hub._streams.position(b"test:hub:failed") is None
            # Well within the hub's 5 s block, it reads the late joiner's log.
            await redis.xadd("test:hub:late", {"n": 1}, id="0-2")
            # The opening entry is held from the start, so it may come in a batch of its own.
            taken: list[bytes] = []
            while len(taken) < 2:
                batch = await asyncio.wait_for(late.follower.next_batch(), 2)
                taken += [entry_id for entry_id, _ in batch]
            assert taken == [b"0-1", b"0-2"]
            # A handle dropped unclosed (a relay that never started) leaves with it.
            assert hub._streams.position(b"test:hub:late") == (0, 2)
            del late
            gc.collect()
            assert hub._streams.position(b"test:hub:late") is None

    asyncio.run(scenario())
