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

The read goes out on a connection the hub holds for itself, already in wire form
(:meth:`resq.followed_streams.FollowedStreams.xread_command`): a pool checkout, redis-py's
argument packing and its per-command bookkeeping, on every read, were a fifth of the API's
CPU at 64 streams. The client's retry policy still applies (a restarted Redis is read again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import RedisError

from resq import keys
from resq.followed_streams import FollowedStreams, entries_past
from resq.redis_types import StreamEntry, StreamId, format_id, multi_stream_entries, parse_id, range_entries

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
IDLE_S = 1.0
"""How often the waiting followers are swept: one that waited through a whole sweep gets an
empty batch (a relay then checks whether its log can still grow)."""
READ_COUNT = 512
WAKEUP_TTL_S = 60
RETRY_PAUSE_S = 0.2


class Follower:
    """One reader of one event log: entries after its position, in order, each once.

    A follower waits on a bare future rather than an ``asyncio.timeout`` around an event: a
    timer armed and cancelled on every wait was a tenth of the relay's per-frame CPU. The
    hub's idle sweep (:meth:`EventHub._sweep`) wakes, every ``idle_s``, each follower that
    waited through a whole sweep interval, with nothing.
    """

    __slots__ = ("_entries", "_idle", "_waiter", "position")

    def __init__(self, position: StreamId) -> None:
        self.position = position
        self._entries: list[StreamEntry] = []
        self._waiter: asyncio.Future[None] | None = None
        self._idle = False
        """Waiting since before the last sweep (the next sweep wakes it)."""

    def deliver(self, entries: list[StreamEntry]) -> None:
        """Take the entries past this follower's position (others were seen already)."""
        fresh, self.position = entries_past(self.position, entries)
        if fresh:
            self._entries += fresh
            self._wake()

    def sweep(self) -> None:
        """The hub's idle sweep: wake this follower if it waited since the sweep before."""
        if self._waiter is None:
            return
        if self._idle:
            self._wake()
        else:
            self._idle = True

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_batch(self, wait: bool = True) -> list[StreamEntry]:
        """Everything delivered since the last call; when there is nothing yet and ``wait``, waits
        for entries or for the hub's idle sweep (between one and two sweep intervals; then empty)."""
        if not self._entries and wait:
            self._waiter = asyncio.get_running_loop().create_future()
            self._idle = False
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch, self._entries = self._entries, []
        return batch


_HUBS: weakref.WeakKeyDictionary[Redis, EventHub] = weakref.WeakKeyDictionary()


class EventHub:
    """The event logs one API process follows, read with one blocking ``XREAD``."""

    def __init__(
        self, redis: Redis, block_ms: int = READ_BLOCK_MS, count: int = READ_COUNT, idle_s: float = IDLE_S
    ) -> None:
        """``idle_s``: how often waiting followers are swept (:meth:`Follower.next_batch`)."""
        self._redis = redis
        self._idle_s = idle_s
        self._sweeper: asyncio.Task[None] | None = None
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
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._drop_connection(disconnect=False)

    @contextlib.asynccontextmanager
    async def follow(self, key: str, after: bytes | str) -> AsyncIterator[Follower]:
        """A :class:`Follower` of stream ``key`` from just after entry id ``after``."""
        name = key.encode()
        follower = Follower(parse_id(after))
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
        if name not in self._reading:
            await self._wake()
        try:
            yield follower
        finally:
            self._streams.discard(name, follower)

    # --- the reader ----------------------------------------------------------------------------

    def _start(self) -> None:
        self._changed.set()
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="event-hub")
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep(), name="event-hub-sweep")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._idle_s)
            for follower in self._streams.readers():
                follower.sweep()

    async def _wake(self) -> None:
        if self._woken or not self._reading:
            return  # not blocked (it will include the new log), or a wake-up is on its way
        self._woken = True
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self._streams.wakeup_key, {"w": "1"}, maxlen=1, approximate=False)
        pipe.expire(self._streams.wakeup_key, WAKEUP_TTL_S)
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
