"""Reading token streams: one ``XREAD`` per read, or one blocking ``XREAD`` per process for all.

A post-processor waits on its response's token stream, and the GPU publisher appends
to every running response's stream at each engine step. Read with one blocking
``XREAD`` per response, a post-process worker holding 32 responses makes 32 reads, 32
replies and 32 thread wake-ups per step: in the B7 profile of ``docs/benchmarks.md``
its threads spent most of their CPU in socket I/O and wake-ups, outside Python.
:class:`TokenStreamHub` keeps one read in flight on every token stream the process
follows and hands each post-processor the entries of its own stream, as the API's
:class:`api.event_hub.EventHub` does for event logs.

A stream that starts following (or reads again from an earlier position, after a gap)
first catches up with ``XRANGE`` from its own position, then joins the hub; if the
hub's read is blocked without it, an entry on this process's wake-up stream makes the
read return and start again with the new stream included. Every entry reaches its
reader once and in order: a reader's buffer only takes entries past its position.

A post-processor opening a response joins before anything is read
(:meth:`TokenStreamHub.open_joined`): the hub follows the stream from its start, so no catch-up
read is needed, and the wake-up it may owe goes out in the round trip that takes the response's
lease (:meth:`TokenStreamHub.stage_wake`). That is two round trips fewer per response.

The common case never wakes the reader's thread: while a post-processor waits in
:meth:`_HubStream.read` it lends the hub a :class:`SteadyConsumer`, and entries that merely
continue its stream (tokens at the position it expects) are consumed on the hub's thread,
their events appended for every such response in one pipelined round trip per read
(:meth:`TokenStreamHub._flush`). Anything else (a start or finish entry, a gap, a stop
sequence, an append Redis did not take as expected) goes to the reader's thread as before,
which handles it with the full, retrying path. Per round that is one ``XREAD``, one
pipeline and no thread wake-ups, instead of a wake-up and a round trip per response.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Protocol

from redis import Redis
from redis.client import Pipeline
from redis.connection import Connection
from redis.exceptions import RedisError

from resq import keys
from resq.followed_streams import FollowedStreams, entries_past
from resq.postprocess import event_log
from resq.redis_types import (
    StreamEntry,
    StreamId,
    format_id,
    multi_stream_entries,
    parse_id,
    range_entries,
    stream_entries,
)

log = logging.getLogger(__name__)

HUB_BLOCK_MS = 1000
HUB_COUNT = 512
WAKEUP_TTL_S = 60
RETRY_PAUSE_S = 0.2


class SteadyBatch(Protocol):
    """Entries a :class:`SteadyConsumer` took on the hub's thread, and the appends they need."""

    def queue(self, appends: event_log.SharedAppends) -> int:
        """Add its event-log appends to the round's shared ones; how many."""
        ...

    def settle(self, replies: list[Any]) -> bool:
        """Take the replies of its appends (an exception for each when the round's call failed).
        False: the consumer's thread must go on from here."""
        ...


class SteadyConsumer(Protocol):
    """What a waiting post-processor lends the hub: its handling of the expected entries."""

    def step(self, entries: list[StreamEntry]) -> SteadyBatch | None:
        """Consume ``entries`` (the next of its stream, in order) when they are the common case.

        None: not taken and nothing changed; they go to the reader's thread.
        """
        ...


class TokenStream(Protocol):
    """The token stream of one response, as one post-processor reads it."""

    def read(
        self, after: bytes | str, count: int, block_ms: int, steady: SteadyConsumer | None = None
    ) -> list[StreamEntry]:
        """Up to ``count`` entries after id ``after``, waiting up to ``block_ms`` for the first.

        While it waits, ``steady`` may consume entries on the reader's behalf (the hub's
        reader does; a direct read ignores it): the call then returns only for what ``steady``
        did not take, for what it handed back, or at the end of ``block_ms``.
        """
        ...

    def close(self) -> None:
        """Stop following the stream."""
        ...


class TokenSource(Protocol):
    """Where post-processors get their :class:`TokenStream`."""

    def open(self, key: str) -> TokenStream:
        """Follow the stream at ``key``."""
        ...


class DirectTokenSource:
    """One ``XREAD`` per read, on the caller's thread."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    def open(self, key: str) -> TokenStream:
        """A reader of ``key`` that reads it directly."""
        return _DirectStream(self._redis, key)


class _DirectStream:
    def __init__(self, redis: Redis, key: str) -> None:
        self._redis = redis
        self._key = key

    def read(
        self, after: bytes | str, count: int, block_ms: int, steady: SteadyConsumer | None = None
    ) -> list[StreamEntry]:
        return stream_entries(self._redis.xread({self._key: after}, count=count, block=block_ms))

    def close(self) -> None:
        pass


class _HubStream:
    """One reader's buffer of one stream, filled by the hub (and by its own catch-up reads)."""

    def __init__(self, hub: TokenStreamHub, key: str) -> None:
        self._hub = hub
        self.key = key
        self.name = key.encode()
        self._ready = threading.Condition()
        self._entries: list[StreamEntry] = []
        self.position: StreamId = (0, 0)
        """The last entry id buffered (or handed out)."""
        self._consumed: StreamId | None = None
        """The last entry id handed to the reader (or to its steady consumer); None before its first read."""
        self._steady: SteadyConsumer | None = None
        """Lent by the reader while it waits with nothing buffered; None otherwise."""
        self._in_flight = False
        """The steady consumer's batch of this round is not settled yet (the reader waits for it)."""
        self._handed_back = False
        """The steady consumer left work to the reader's thread."""
        self._deadline = 0.0
        """When the waiting reader's block time ends (monotonic)."""

    def offer(self, entries: list[StreamEntry]) -> SteadyBatch | None:
        """Hub: the entries past this reader's position, to its steady consumer when it can
        take them (the batch to flush is returned), else into the buffer for its thread."""
        with self._ready:
            fresh, self.position = entries_past(self.position, entries)
            if not fresh:
                return None
            steady = self._steady
            if steady is not None and not self._entries and not self._in_flight:
                try:
                    batch = steady.step(fresh)
                except Exception:  # a broken contract (step does not raise): the thread reads them
                    log.exception("a steady consumer of %s failed; its thread takes the entries", self.key)
                    batch = None
                if batch is not None:
                    self._in_flight = True
                    self._consumed = parse_id(fresh[-1][0])
                    return batch
            self._steady = None  # its thread has work now: nothing more is consumed for it
            self._entries += fresh
            self._ready.notify_all()
            return None

    def settle(self, batch: SteadyBatch, replies: list[Any]) -> None:
        """Hub: give the steady consumer's batch its replies; wake the reader only if needed."""
        with self._ready:
            self._in_flight = False
            try:
                done = batch.settle(replies)
            except Exception:  # a broken contract: its thread must not wait for nothing
                log.exception("settling a steady batch of %s failed", self.key)
                done = False
            if not done:
                self._steady = None
                self._handed_back = True
                self._ready.notify_all()
            elif time.monotonic() >= self._deadline:
                self._ready.notify_all()  # its block time is up: it waited only for this batch

    def _take(self, entries: list[StreamEntry]) -> None:
        fresh, self.position = entries_past(self.position, entries)
        self._entries += fresh
        if self._entries:
            self._ready.notify_all()

    def read(
        self, after: bytes | str, count: int, block_ms: int, steady: SteadyConsumer | None = None
    ) -> list[StreamEntry]:
        after_id = parse_id(after)
        if after_id != self._consumed:
            self._restart_from(after_id)
        with self._ready:
            self._deadline = time.monotonic() + block_ms / 1000
            self._steady = steady if not self._entries else None
            try:
                while self._in_flight or not (self._entries or self._handed_back):
                    remaining = self._deadline - time.monotonic()
                    if remaining <= 0 and not self._in_flight:
                        break
                    self._ready.wait(max(remaining, 0.001))
            finally:
                self._steady = None
                self._handed_back = False
            batch = self._entries[:count]
            del self._entries[:count]
            if batch:
                self._consumed = parse_id(batch[-1][0])
            return batch

    def join_at_start(self) -> bool:
        """Follow the stream from its start, before the first read and without a catch-up read.

        The hub's next ``XREAD`` reads it from the start, so the reader's first ``read("0-0")``
        gets every entry. Returns whether the hub owes a wake-up for it (its read is blocked
        without this stream): stage one with :meth:`TokenStreamHub.stage_wake`, or the stream
        joins at the hub's next read, within its block time.
        """
        return self._restart_from((0, 0), catch_up=False, send_wake=False)

    def _restart_from(self, after_id: StreamId, catch_up: bool = True, send_wake: bool = True) -> bool:
        """Catch up from ``after_id`` (the first read, or a reader that went back) and join the hub;
        whether the hub's blocked read needed a wake-up (sent unless ``send_wake`` is false).

        ``catch_up`` false skips the ``XRANGE`` from ``after_id``: for a stream the hub will read
        from there itself. Holds this reader's lock throughout, so the hub's deliveries wait and
        land after the catch-up, in order; the hub never holds its own lock while it delivers.
        """
        with self._ready:
            self._entries.clear()
            self.position = after_id
            self._consumed = after_id
            if catch_up:
                self._take(range_entries(self._hub.redis.xrange(self.key, min=f"({format_id(after_id)}")))
            hub_position, wake = self._hub.join(self, send_wake)
            if hub_position > self.position:
                # The hub read past this reader's position before it joined: fetch the gap.
                gap = self._hub.redis.xrange(
                    self.key, min=f"({format_id(self.position)}", max=format_id(hub_position)
                )
                self._take(range_entries(gap))
        return wake

    def close(self) -> None:
        self._hub.leave(self)


class TokenStreamHub:
    """The token streams one process follows, read by one thread with one blocking ``XREAD``."""

    def __init__(self, redis: Redis, block_ms: int = HUB_BLOCK_MS, count: int = HUB_COUNT) -> None:
        self.redis = redis
        self._append_many = redis.register_script(event_log.APPEND_MANY_LUA)
        """The round's steady appends, all in one call (:meth:`_flush`)."""
        self._block_ms = block_ms
        self._count = count
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._streams: FollowedStreams[_HubStream] = FollowedStreams(
            keys.postprocess_wakeup(uuid.uuid4().hex)
        )
        self._reading: frozenset[bytes] = frozenset()
        self._woken = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._connection: Connection | None = None
        """The reading thread's own connection (taken from the client's pool, held)."""

    def open(self, key: str) -> TokenStream:
        """A reader of ``key`` fed by the hub (it joins at its first read)."""
        return _HubStream(self, key)

    def open_joined(self, key: str) -> JoinedTokenSource:
        """A reader of ``key`` that follows it from its start already (no catch-up read), as a
        :class:`TokenSource` for one post-processor; close it when the post-processor is done.

        Stage the hub's wake-up in the caller's next round trip with its
        :meth:`JoinedTokenSource.stage_wake`.
        """
        stream = _HubStream(self, key)
        return JoinedTokenSource(self, stream, stream.join_at_start())

    def stage_wake(self, pipe: Pipeline) -> None:
        """Queue the wake-up of this hub's blocked read on ``pipe`` (two commands)."""
        pipe.xadd(self._streams.wakeup_key, {"w": "1"}, maxlen=1, approximate=False)
        pipe.expire(self._streams.wakeup_key, WAKEUP_TTL_S)

    def join(self, reader: _HubStream, send_wake: bool = True) -> tuple[StreamId, bool]:
        """Add ``reader`` to its stream's readers; the hub's position on that stream, and whether
        its blocked read needed a wake-up (sent here unless ``send_wake`` is false)."""
        with self._lock:
            position = self._streams.add(reader.name, reader, reader.position)
            wake = reader.name not in self._reading and bool(self._reading) and not self._woken
            if wake:
                self._woken = True
            self._changed.notify_all()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="token-hub", daemon=True)
                self._thread.start()
        if wake and send_wake:
            self.wake()
        return position, wake

    def leave(self, reader: _HubStream) -> None:
        """Stop feeding ``reader``."""
        with self._lock:
            self._streams.discard(reader.name, reader)

    def close(self) -> None:
        """Stop the reading thread (within one blocking read)."""
        with self._lock:
            self._stopped = True
            self._changed.notify_all()

    def wake(self) -> None:
        """Make the hub's blocked read return (it starts again with the streams followed now)."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            self.stage_wake(pipe)
            pipe.execute()
        except RedisError:
            # The blocked read returns within its block time anyway.
            log.warning("could not wake the token hub; the new stream joins within %d ms", self._block_ms)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._streams and not self._stopped:
                    self._changed.wait()
                if self._stopped:
                    self._drop_connection(disconnect=False)
                    return
                command = self._streams.xread_command(self._count, self._block_ms)
                self._reading = self._streams.names()
                self._woken = False
            try:
                reply = self._read(command)
            except Exception:  # the thread must outlive any failure: every reader depends on it
                with self._lock:
                    closed = self._stopped
                if not closed:
                    log.exception("reading token streams failed; retrying")
                    time.sleep(RETRY_PAUSE_S)
                # Closed while the read was out, its failure is the shutdown (the process, or its
                # Redis client, going away under it): the loop's top ends the thread.
                continue
            finally:
                with self._lock:
                    self._reading = frozenset()
            try:
                self._dispatch(multi_stream_entries(reply))
            except Exception:  # a consumer broke its contract (step and settle do not raise)
                log.exception("handing out token-stream entries failed")

    def _read(self, command: bytes) -> Any:
        """Send a packed ``XREAD`` on the hub's own connection (see :mod:`api.event_hub` for why)
        and parse its reply as redis-py would; the client's retry policy applies."""
        if self._connection is None:
            self._connection = self.redis.connection_pool.get_connection()
        connection = self._connection

        def send_and_read() -> Any:
            connection.send_packed_command([command])  # type: ignore[no-untyped-call]
            return self.redis.parse_response(connection, "XREAD")  # type: ignore[no-untyped-call]

        try:
            return connection.retry.call_with_retry(
                send_and_read,
                lambda _: connection.disconnect(),  # type: ignore[no-untyped-call]
            )
        except BaseException:
            # Failed past the retries: the connection may hold half a reply.
            self._drop_connection(disconnect=True)
            raise

    def _drop_connection(self, disconnect: bool) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if disconnect:
            connection.disconnect()  # type: ignore[no-untyped-call]
        self.redis.connection_pool.release(connection)

    def _dispatch(self, replies: list[tuple[bytes, list[StreamEntry]]]) -> None:
        with self._lock:
            deliveries = self._streams.route(replies)
        # Outside the hub's lock: a reader catching up holds its own lock and may wait for ours.
        staged: list[tuple[_HubStream, SteadyBatch]] = []
        try:
            for readers, entries in deliveries:
                for reader in readers:
                    batch = reader.offer(entries)
                    if batch is not None:
                        staged.append((reader, batch))
        finally:
            if staged:  # whatever happened, a reader waiting for its batch gets it settled
                self._flush(staged)

    def _flush(self, staged: list[tuple[_HubStream, SteadyBatch]]) -> None:
        """Send the round's steady appends as one script call and settle each batch with its replies."""
        # One call, one execution unit: the API's event hub, blocked on every log of the round,
        # wakes once for all of them (and from Redis 7.2 on reads them in one reply), as the GPU
        # worker's rounds do (gpu_worker.publisher). A refused call (out of memory, NOSCRIPT twice,
        # a lost connection) settles every batch with the error: their readers write again, one by
        # one, and each append skips what its log already holds.
        appends = event_log.SharedAppends(self._append_many)
        counts = [batch.queue(appends) for _, batch in staged]
        replies: list[Any] = []
        if len(appends):
            try:
                replies = appends.send()
            except Exception as error:  # RedisError, or anything: every batch must be settled
                log.warning("a steady round's writes failed (%s); their readers write again", error)
                replies = [error] * len(appends)
        at = 0
        for (reader, batch), count in zip(staged, counts, strict=True):
            reader.settle(batch, replies[at : at + count])
            at += count


class JoinedTokenSource:
    """The token source of one post-processor whose stream joined the hub before the lease.

    Its first :meth:`open` of that stream returns the joined reader; any later one (a rebuild
    after the event log went back) opens afresh. The hub's wake-up, when the join owes one, goes
    out in the caller's round trip (:meth:`stage_wake`, then :meth:`sent` once it went out); a
    wake-up still owed at :meth:`close` is sent then, since the hub's other joiners rely on it.
    """

    def __init__(self, hub: TokenStreamHub, stream: _HubStream, wake_owed: bool) -> None:
        self._hub = hub
        self._joined: _HubStream | None = stream
        self._wake_owed = wake_owed
        self._wake_staged = False

    def stage_wake(self, pipe: Pipeline) -> None:
        """Queue the hub's wake-up on ``pipe`` if the join owes one."""
        if self._wake_owed:
            self._hub.stage_wake(pipe)
            self._wake_staged = True

    def sent(self) -> None:
        """The round trip :meth:`stage_wake` queued on went out."""
        if self._wake_staged:
            self._wake_owed = False

    def open(self, key: str) -> TokenStream:
        """The joined reader the first time ``key`` is opened; a fresh one otherwise."""
        joined, self._joined = self._joined, None
        if joined is not None:
            if joined.key == key:
                return joined
            joined.close()
        return self._hub.open(key)

    def close(self) -> None:
        """Stop following the stream if no post-processor opened it; send a wake-up still owed."""
        joined, self._joined = self._joined, None
        if joined is not None:
            joined.close()
        if self._wake_owed:
            self._wake_owed = False
            self._hub.wake()
