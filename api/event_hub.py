"""One blocking ``XREAD`` per API process for every event log it relays.

Following each response with its own blocking ``XREAD`` costs a Redis
connection per open stream (the pool caps them: one API process held about a
hundred streams) and a command, a reply and a wake-up per event per client:
about half of the API's CPU per streamed token in the profile of
``docs/benchmarks.md``. The hub instead keeps one read in flight on all the
event logs its followers wait on and hands each follower the entries of its
log; a follower that fell behind gets everything pending in one batch.

A new follower first catches up from its own position with ``XRANGE`` (so a
resumed stream and a live one work the same way), then joins the hub; if the
hub's read is already blocked, an entry on this process's wake-up stream makes
it return and read again with the new log included.

A response this process creates and relays at once skips both round trips
(:meth:`EventHub.open_new`): its follower joins before the log exists, holding the opening
events the API is about to log, and the wake-up goes out in the step that creates the log.

The read goes out on a connection the hub holds for itself, already in wire form
(:meth:`resq.followed_streams.FollowedStreams.xread_command`): a pool checkout, redis-py's
argument packing and its per-command bookkeeping, on every read, were a fifth of the API's
CPU at 64 streams. The client's retry policy still applies (a restarted Redis is read again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import Connection
from redis.exceptions import RedisError

from resq import keys
from resq.events.emitter import EncodedEvent
from resq.followed_streams import FollowedStreams, entries_past
from resq.redis_types import StreamEntry, StreamId, format_id, multi_stream_entries, parse_id, range_entries

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
IDLE_S = 1.0
"""How long a follower waits without entries before it gets an empty batch (a relay then
checks whether its log can still grow)."""
IDLE_CHECKS_PER_S = 500
"""At most about this many idle wake-ups a second per API process: with more waiting followers
than ``IDLE_S`` allows, each waits longer (4,000 held streams: 8 s). Each idle wake-up costs
a Redis round trip; at one a second each, thousands of held streams would take the whole
event loop and the connection pool from the requests arriving."""
IDLE_TICK_S = 0.1
"""How often the hub wakes the followers whose idle wait ran out (their resolution)."""
READ_COUNT = 512
WAKEUP_TTL_S = 60
RETRY_PAUSE_S = 0.2


class IdleWakeups:
    """The followers' idle deadlines, woken by the hub's ticker instead of a timer per wait.

    Every wait lasts as long, so the deadlines come in the order the waits began: a FIFO, with
    one append per wait and one pop per deadline. A wait that ended with entries leaves its
    deadline behind, and popping it finds the follower's next wait (or none) and does nothing.
    Wake-ups stay spread as the waits began: all idle followers woken at once (thousands of
    held streams) would all check their logs in the same instant and empty the API's pool. With
    many followers waiting, each waits longer (:data:`IDLE_CHECKS_PER_S`): a deadline set later
    than the ones before it only delays those behind it a little, which the order tolerates.
    """

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self.idle_s = idle_s
        self._deadlines: deque[tuple[float, Follower, int]] = deque()

    def note(self, follower: Follower, wait: int) -> None:
        """``follower``'s wait number ``wait`` began now."""
        # The deadlines queued (waits going on, and some that ended) bound the waiting followers.
        idle_s = max(self.idle_s, len(self._deadlines) / IDLE_CHECKS_PER_S)
        self._deadlines.append((time.monotonic() + idle_s, follower, wait))

    def wake_due(self, now: float) -> None:
        """Wake, empty, every follower whose wait began ``idle_s`` before ``now`` and goes on."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, follower, wait = deadlines.popleft()
            follower.wake_idle(wait)


class Follower:
    """One reader of one event log: entries after its position, in order, each once.

    A follower waits on a bare future rather than an ``asyncio.timeout`` around an event: a
    timer armed and cancelled on every wait was a fifth of the relay's per-frame CPU. Its idle
    wake-up comes from the hub's :class:`IdleWakeups`.
    """

    __slots__ = ("_entries", "_idle", "_wait", "_waiter", "position")

    def __init__(self, position: StreamId, idle: IdleWakeups | None = None) -> None:
        """``idle``: what wakes a wait with no entries (None: only entries do)."""
        self.position = position
        self._entries: list[StreamEntry] = []
        self._waiter: asyncio.Future[None] | None = None
        self._idle = idle
        self._wait = 0
        """The number of the current (or last) wait: an idle deadline names the wait it is for."""

    def deliver(self, entries: list[StreamEntry]) -> None:
        """Take the entries past this follower's position (others were seen already)."""
        fresh, self.position = entries_past(self.position, entries)
        if fresh:
            self._entries += fresh
            self._wake()

    def wake_idle(self, wait: int) -> None:
        """Wait number ``wait`` ran out of time: wake it, if it is still going on."""
        if wait == self._wait:
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_batch(self, wait: bool = True) -> list[StreamEntry]:
        """Everything delivered since the last call; when there is nothing yet and ``wait``, waits
        for entries or for its idle deadline (then empty)."""
        if not self._entries and wait:
            self._waiter = asyncio.get_running_loop().create_future()
            self._wait += 1
            if self._idle is not None:
                self._idle.note(self, self._wait)
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch, self._entries = self._entries, []
        return batch


def _raise_if_cancel_swallowed() -> None:
    """Raise the cancellation of this task if a library swallowed it.

    Python 3.11's ``asyncio.wait_for`` returns its inner result instead of raising when the
    cancel lands after the inner future finished, and redis-py wraps every send in one
    (``socket_timeout`` is set by default). A cancel of the hub landing there let the read
    return normally; the hub then waited for new followers forever while ``close()`` (at the
    API's shutdown) or the event loop's teardown waited for it.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class OpenedLog:
    """A follower of an event log this process is about to create (:meth:`EventHub.open_new`).

    It is in the hub from the start, so the relay needs no catch-up read; the hub's wake-up, when
    the join owes one, rides on the step that creates the log (:meth:`stage_wake`). Close it once
    the relay is done (:meth:`close`), or with :meth:`abandon` when that step failed. A handle
    dropped unclosed (a response whose relay never started) leaves the hub when it is collected.
    """

    def __init__(self, hub: EventHub, name: bytes, follower: Follower, wake_owed: bool) -> None:
        self.follower = follower
        self._hub = hub
        self._wake_owed = wake_owed
        self._leave = weakref.finalize(self, hub.leave, name, follower)

    def stage_wake(self, pipe: Pipeline) -> None:
        """Queue the hub's wake-up on ``pipe`` (the step creating the log) if the join owes one."""
        if self._wake_owed:
            self._hub.stage_wake(pipe)

    def close(self) -> None:
        """Stop following (idempotent)."""
        self._leave()

    async def abandon(self) -> None:
        """Stop following after the step creating the log failed; the hub still gets the wake-up
        the join owed (other joiners counted on it and sent none)."""
        self.close()
        if self._wake_owed:
            self._wake_owed = False
            await self._hub.wake_now()


_HUBS: weakref.WeakKeyDictionary[Redis, EventHub] = weakref.WeakKeyDictionary()


class EventHub:
    """The event logs one API process follows, read with one blocking ``XREAD``."""

    def __init__(
        self, redis: Redis, block_ms: int = READ_BLOCK_MS, count: int = READ_COUNT, idle_s: float = IDLE_S
    ) -> None:
        """``idle_s``: how long a follower waits without entries before it gets an empty batch."""
        self._redis = redis
        self._idle = IdleWakeups(idle_s)
        self._ticker: asyncio.Task[None] | None = None
        self._block_ms = block_ms
        self._count = count
        self._streams: FollowedStreams[Follower] = FollowedStreams(keys.api_wakeup(uuid.uuid4().hex))
        self._reading: frozenset[bytes] = frozenset()
        self._woken = False
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._connection: Connection | None = None
        """The hub's own connection for its reads (taken from the client's pool, held)."""

    @classmethod
    def of(cls, redis: Redis) -> EventHub:
        """The hub of this Redis client (one per API process): every relay shares it."""
        hub = _HUBS.get(redis)
        if hub is None:
            hub = _HUBS[redis] = cls(redis)
        return hub

    @classmethod
    async def close_for(cls, redis: Redis) -> None:
        """Stop the hub of ``redis``, if it has one."""
        hub = _HUBS.pop(redis, None)
        if hub is not None:
            await hub.close()

    async def close(self) -> None:
        """Stop reading."""
        for task in (self._ticker, self._task):
            if task is not None:
                task.cancel()
                # wait(), not `await task` in suppress(CancelledError): that also swallowed a
                # cancel of the caller.
                await asyncio.wait({task})
        self._ticker = self._task = None
        await self._drop_connection(disconnect=False)

    @contextlib.asynccontextmanager
    async def follow(self, key: str, after: bytes | str) -> AsyncIterator[Follower]:
        """A :class:`Follower` of stream ``key`` from just after entry id ``after``."""
        name = key.encode()
        follower = Follower(parse_id(after), self._idle)
        follower.deliver(range_entries(await self._redis.xrange(key, min=f"({format_id(follower.position)}")))
        # The hub may be ahead of what this follower read: fetch the gap before joining, so the
        # follower misses nothing the hub already handed to others. No await between the last
        # check and joining, so nothing can slip in between.
        while (position := self._streams.position(name)) is not None and position > follower.position:
            gap = await self._redis.xrange(
                key, min=f"({format_id(follower.position)}", max=format_id(position)
            )
            follower.deliver(range_entries(gap))
        self._streams.add(name, follower, follower.position)
        self._start()
        if self._owe_wake(name):
            await self._send_wake()
        try:
            yield follower
        finally:
            self._streams.discard(name, follower)

    def open_new(self, key: str, opening: list[EncodedEvent]) -> OpenedLog:
        """Follow the log ``key`` that the caller is about to create with the events ``opening``.

        The follower holds ``opening`` already and the hub reads the log from after them, so the
        relay makes no catch-up read. The caller queues :meth:`OpenedLog.stage_wake` on the step
        that creates the log, which then wakes the hub's blocked read if it needs waking.
        """
        name = key.encode()
        follower = Follower((0, 0), self._idle)
        follower.deliver(
            [
                (
                    keys.event_entry_id(event.sequence_number).encode(),
                    {b"type": event.type.encode(), b"data": event.data},
                )
                for event in opening
            ]
        )
        self._streams.add(name, follower, follower.position)
        self._start()
        return OpenedLog(self, name, follower, self._owe_wake(name))

    @contextlib.asynccontextmanager
    async def following(self, opened: OpenedLog) -> AsyncIterator[Follower]:
        """The follower of ``opened`` (from :meth:`open_new`); it stops following on exit."""
        try:
            yield opened.follower
        finally:
            opened.close()

    def leave(self, name: bytes, follower: Follower) -> None:
        """Stop feeding ``follower`` from stream ``name``."""
        self._streams.discard(name, follower)

    def stage_wake(self, pipe: Pipeline) -> None:
        """Queue the wake-up of the hub's blocked read on ``pipe`` (two commands)."""
        pipe.xadd(self._streams.wakeup_key, {"w": "1"}, maxlen=1, approximate=False)
        pipe.expire(self._streams.wakeup_key, WAKEUP_TTL_S)

    async def wake_now(self) -> None:
        """Make the hub's blocked read return (best effort: it returns within its block time anyway)."""
        try:
            await self._send_wake()
        except RedisError:
            log.warning("could not wake the event hub; a new log joins within %d ms", self._block_ms)

    # --- the reader ----------------------------------------------------------------------------

    def _start(self) -> None:
        self._changed.set()
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="event-hub")
        if self._ticker is None or self._ticker.done():
            self._ticker = loop.create_task(self._tick(), name="event-hub-idle")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(IDLE_TICK_S)
            self._idle.wake_due(time.monotonic())

    def _owe_wake(self, name: bytes) -> bool:
        """Whether a follower of ``name`` that just joined must wake the hub's read (it is blocked
        without ``name``, and no wake-up is on its way); if so, the caller now owes it."""
        if name in self._reading or not self._reading or self._woken:
            return False  # not blocked without it (the next read includes it), or one is on its way
        self._woken = True
        return True

    async def _send_wake(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        self.stage_wake(pipe)
        await pipe.execute()

    async def _run(self) -> None:
        while True:
            if not self._streams:
                self._changed.clear()
                await self._changed.wait()
                continue
            command = self._streams.xread_command(self._count, self._block_ms)
            self._reading = self._streams.names()
            self._woken = False
            try:
                reply = await self._read(command)
            except RedisError:
                log.exception("reading event logs failed; retrying")
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            finally:
                self._reading = frozenset()
            _raise_if_cancel_swallowed()
            self._dispatch(multi_stream_entries(reply))

    async def _read(self, command: bytes) -> Any:
        """Send a packed ``XREAD`` on the hub's connection and parse its reply as redis-py would."""
        if self._connection is None:
            pool = self._redis.connection_pool
            self._connection = cast(Connection, await pool.get_connection())  # type: ignore[no-untyped-call]
        connection = self._connection

        async def send_and_read() -> Any:
            await connection.send_packed_command(command)
            return await self._redis.parse_response(connection, "XREAD")

        try:
            return await connection.retry.call_with_retry(send_and_read, lambda _: connection.disconnect())
        except BaseException:
            # Failed past the retries, or cancelled mid-read: the connection may hold half a reply.
            await self._drop_connection(disconnect=True)
            raise

    async def _drop_connection(self, disconnect: bool) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if disconnect:
            await connection.disconnect()
        await self._redis.connection_pool.release(connection)

    def _dispatch(self, replies: list[tuple[bytes, list[StreamEntry]]]) -> None:
        for followers, entries in self._streams.route(replies):
            for follower in followers:
                follower.deliver(entries)
