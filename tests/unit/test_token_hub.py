"""The post-process worker's token hub: one blocking read for every token stream, no entry lost or repeated."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from resq.events.emitter import EncodedEvent
from resq.postprocess.event_log import SharedAppends
from resq.postprocess.token_hub import (
    DirectTokenSource,
    SteadyBatch,
    TokenSource,
    TokenStream,
    TokenStreamHub,
)
from resq.redis_types import StreamEntry
from tests.support.redis_server import PrivateRedis


def _read_until(stream: TokenStream, last: bytes, after: bytes = b"0-0") -> list[bytes]:
    """What a post-processor does: read after the last id it took until ``last`` arrives."""
    seen: list[bytes] = []
    position = after
    deadline = time.monotonic() + 10
    while not seen or seen[-1] != last:
        assert time.monotonic() < deadline, f"stuck after {seen}"
        batch = stream.read(position, 512, 200)
        if batch:
            position = batch[-1][0]
            seen += [entry_id for entry_id, _ in batch]
    return seen


@pytest.fixture
def hub(redis_client: Redis) -> Iterator[TokenStreamHub]:
    hub = TokenStreamHub(redis_client, block_ms=200)
    yield hub
    hub.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source_kind", ["hub", "direct"])
def test_readers_of_many_streams_and_late_joiners_see_every_entry_once(
    redis_client: Redis, hub: TokenStreamHub, source_kind: str
) -> None:
    source: TokenSource = hub if source_kind == "hub" else DirectTokenSource(redis_client)
    streams = [f"test:token-hub:{index}" for index in range(16)]
    everything = [f"0-{number}".encode() for number in range(1, 7)]
    redis_client.delete(*streams)
    results: dict[int, list[bytes]] = {}

    def post_processor(index: int, key: str) -> None:
        reader = source.open(key)
        try:
            results[index] = _read_until(reader, everything[-1])
        finally:
            reader.close()

    try:
        threads = [threading.Thread(target=post_processor, args=(i, key)) for i, key in enumerate(streams)]
        for thread in threads[:8]:
            thread.start()
        for number in range(1, 4):
            for key in streams:
                redis_client.xadd(key, {"n": number}, id=f"0-{number}")
            time.sleep(0.05)
        for thread in threads[8:]:  # these join after half their stream was written
            thread.start()
        time.sleep(0.3)  # the hub is blocked on every stream by now
        for number in range(4, 7):
            for key in streams:
                redis_client.xadd(key, {"n": number}, id=f"0-{number}")
            time.sleep(0.05)
        for thread in threads:
            thread.join(20)
        assert results == {index: everything for index in range(len(streams))}
    finally:
        redis_client.delete(*streams)


@pytest.mark.timeout(30)
def test_a_reader_that_goes_back_reads_the_stream_again_from_there(
    redis_client: Redis, hub: TokenStreamHub
) -> None:
    key = "test:token-hub:rewind"
    redis_client.delete(key)
    try:
        for number in range(1, 4):
            redis_client.xadd(key, {"n": number}, id=f"0-{number}")
        reader = hub.open(key)
        assert _read_until(reader, b"0-3") == [b"0-1", b"0-2", b"0-3"]
        # A gap makes the runner read from the start again: the hub serves that position too.
        assert [entry_id for entry_id, _ in reader.read("0-0", 512, 200)] == [b"0-1", b"0-2", b"0-3"]
        redis_client.xadd(key, {"n": 4}, id="0-4")
        assert _read_until(reader, b"0-4", after=b"0-3") == [b"0-4"]
        # count bounds a read; the rest comes at the next one.
        assert [entry_id for entry_id, _ in reader.read("0-1", 2, 200)] == [b"0-2", b"0-3"]
        assert [entry_id for entry_id, _ in reader.read("0-3", 2, 200)] == [b"0-4"]
        reader.close()
    finally:
        redis_client.delete(key)


@pytest.mark.timeout(30)
def test_a_read_with_nothing_new_returns_empty_after_its_block_time(
    redis_client: Redis, hub: TokenStreamHub
) -> None:
    reader = hub.open("test:token-hub:silent")
    started = time.monotonic()
    assert reader.read("0-0", 512, 300) == []
    assert 0.25 <= time.monotonic() - started < 5
    reader.close()


@pytest.mark.timeout(30)
def test_a_new_stream_does_not_wait_for_the_blocked_read_to_time_out(redis_client: Redis) -> None:
    """The wake-up entry makes a read blocked on other streams start again with the new one."""
    hub = TokenStreamHub(redis_client, block_ms=20_000)
    busy, fresh = "test:token-hub:busy", "test:token-hub:fresh"
    redis_client.delete(busy, fresh)
    try:
        first = hub.open(busy)
        assert first.read("0-0", 512, 200) == []  # the hub now blocks on `busy` for 20 s
        time.sleep(0.2)
        second = hub.open(fresh)
        assert second.read("0-0", 512, 100) == []  # joined; the blocked read was woken
        redis_client.xadd(fresh, {"n": 1}, id="0-1")
        started = time.monotonic()
        assert [entry_id for entry_id, _ in second.read("0-0", 512, 5_000)] == [b"0-1"]
        assert time.monotonic() - started < 4  # far below the hub's 20 s block
        first.close()
        second.close()
    finally:
        hub.close()
        redis_client.delete(busy, fresh)


# --- the steady path: entries consumed on the hub's thread -----------------------------------------


class Counting:
    """A steady consumer (a fake of the runner's ``_Run``): takes entries whose ``n`` is even,
    and for each batch it takes appends one event to its log (``counter``) in the hub's shared
    appends."""

    def __init__(self, counter: str, hand_back_at: int | None = None) -> None:
        self.counter = counter
        self.taken: list[bytes] = []
        self.replies: list[Any] = []
        self.threads: set[str] = set()
        self.rounds: list[SharedAppends] = []
        """Per batch queued: the round's shared appends it joined."""
        self._hand_back_at = hand_back_at

    def step(self, entries: list[StreamEntry]) -> SteadyBatch | None:
        if any(int(fields[b"n"]) % 2 for _, fields in entries):
            return None
        self.threads.add(threading.current_thread().name)
        self.taken += [entry_id for entry_id, _ in entries]
        return _Increment(self, hand_back=int(entries[-1][1][b"n"]) == self._hand_back_at)


class _Increment:
    def __init__(self, consumer: Counting, hand_back: bool) -> None:
        self._consumer = consumer
        self._hand_back = hand_back

    def queue(self, appends: SharedAppends) -> int:
        consumer = self._consumer
        consumer.rounds.append(appends)
        sequence_number = len(consumer.rounds)  # after the log's opening event
        appends.add(consumer.counter, [EncodedEvent(sequence_number, "tick", b"{}")])
        return 1

    def settle(self, replies: list[Any]) -> bool:
        self._consumer.replies += replies
        return not self._hand_back


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_entries_a_steady_consumer_takes_never_wake_its_reader(redis_client: Redis) -> None:
    """Taken entries are consumed on the hub's thread, their writes share one transaction per round,
    and the waiting reader sleeps through them to the end of its block time; what the consumer
    declines wakes the reader at once, after what it took, in order."""
    hub = TokenStreamHub(redis_client, block_ms=200)
    keys = [f"test:token-hub:steady:{index}" for index in range(2)]
    counters = [f"{key}:count" for key in keys]
    redis_client.delete(*keys, *counters)
    for counter in counters:  # an append never brings a missing log back: each has its first event
        redis_client.xadd(counter, {"type": "opened", "data": "{}"}, id="0-1")
    consumers = [Counting(counter) for counter in counters]
    readers = [hub.open(key) for key in keys]
    results: dict[int, tuple[list[bytes], float]] = {}

    def read_once(index: int) -> None:
        readers[index].read("0-0", 512, 100)  # joins the hub
        started = time.monotonic()
        batch = readers[index].read("0-0", 512, 1500, consumers[index])
        results[index] = ([entry_id for entry_id, _ in batch], time.monotonic() - started)

    try:
        threads = [threading.Thread(target=read_once, args=(index,)) for index in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # both wait, consumers lent
        pipe = redis_client.pipeline(transaction=True)  # one round: both streams in one XREAD reply
        for key in keys:
            pipe.xadd(key, {"n": 2}, id="0-1")
        pipe.execute()
        _wait_until(lambda: all(consumer.taken for consumer in consumers))
        redis_client.xadd(keys[0], {"n": 4}, id="0-2")
        _wait_until(lambda: len(consumers[0].taken) == 2)
        redis_client.xadd(keys[0], {"n": 5}, id="0-3")  # odd: declined, for the reader
        for thread in threads:
            thread.join(10)
        assert consumers[0].taken == [b"0-1", b"0-2"]
        assert consumers[1].taken == [b"0-1"]
        # Each append's reply: the events its log held before it.
        assert consumers[0].replies == [1, 2] and consumers[1].replies == [1]
        assert redis_client.xlen(counters[0]) == 3 and redis_client.xlen(counters[1]) == 2
        assert consumers[0].threads == consumers[1].threads == {"token-hub"}
        # A round's appends are one script call (SharedAppends.send): the API's event hub, blocked
        # on every log they append to, wakes once for all of them (gpu_worker.publisher's rounds,
        # likewise); each round has its own.
        assert consumers[0].rounds[0] is not consumers[0].rounds[1]
        entries, waited = results[0]
        assert entries == [b"0-3"] and waited < 1.2  # woken by the declined entry
        entries, waited = results[1]
        assert entries == [] and waited >= 1.4  # nothing for it: slept through its block time
        # The reader goes on after what the consumer took.
        redis_client.xadd(keys[1], {"n": 7}, id="0-2")
        assert [entry_id for entry_id, _ in readers[1].read("0-1", 512, 2000)] == [b"0-2"]
    finally:
        for reader in readers:
            reader.close()
        hub.close()
        redis_client.delete(*keys, *counters)


@pytest.mark.timeout(30)
def test_a_batch_its_consumer_hands_back_wakes_the_reader(redis_client: Redis) -> None:
    hub = TokenStreamHub(redis_client, block_ms=200)
    key = "test:token-hub:hand-back"
    consumer = Counting(f"{key}:count", hand_back_at=2)
    redis_client.delete(key, consumer.counter)
    redis_client.xadd(consumer.counter, {"type": "opened", "data": "{}"}, id="0-1")
    reader = hub.open(key)
    try:
        assert reader.read("0-0", 512, 100) == []
        outcome: list[tuple[list[StreamEntry], float]] = []

        def read() -> None:
            started = time.monotonic()
            outcome.append((reader.read("0-0", 512, 5000, consumer), time.monotonic() - started))

        thread = threading.Thread(target=read)
        thread.start()
        time.sleep(0.3)
        redis_client.xadd(key, {"n": 2}, id="0-1")
        thread.join(10)
        assert consumer.taken == [b"0-1"] and consumer.replies == [1]
        assert outcome[0][0] == [] and outcome[0][1] < 4  # returned for the hand-back, not the timeout
        # Handed back: the consumer is no longer lent, so the next entry is the reader's.
        redis_client.xadd(key, {"n": 4}, id="0-2")
        assert [entry_id for entry_id, _ in reader.read("0-1", 512, 2000)] == [b"0-2"]
        assert consumer.taken == [b"0-1"]
    finally:
        reader.close()
        hub.close()
        redis_client.delete(key, consumer.counter)


def _blocked_hub(redis_client: Redis, busy: str) -> tuple[TokenStreamHub, TokenStream]:
    """A hub whose read blocks for 20 s on ``busy`` alone (a new stream needs a wake-up)."""
    hub = TokenStreamHub(redis_client, block_ms=20_000)
    first = hub.open(busy)
    assert first.read("0-0", 512, 200) == []
    time.sleep(0.2)
    return hub, first


@pytest.mark.timeout(30)
def test_a_stream_joined_before_the_lease_is_read_from_its_start_without_a_catch_up_read(
    redis_client: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A post-processor's opening: join, wake-up in its own round trip, no ``XRANGE``."""
    busy, fresh = "test:token-hub:joined-busy", "test:token-hub:joined"
    redis_client.delete(busy, fresh)
    redis_client.xadd(fresh, {"n": 1}, id="0-1")  # published before the post-processor came
    hub, first = _blocked_hub(redis_client, busy)
    ranges: list[Any] = []
    real_xrange = redis_client.xrange
    monkeypatch.setattr(redis_client, "xrange", lambda *a, **k: ranges.append(a) or real_xrange(*a, **k))
    try:
        source = hub.open_joined(fresh)
        pipe = redis_client.pipeline(transaction=False)
        pipe.exists(fresh)  # the caller's own commands (the lease's, in a post-process worker)
        source.stage_wake(pipe)
        assert len(pipe.execute()) == 3  # the wake-up rode along: two commands
        source.sent()
        reader = source.open(fresh)
        redis_client.xadd(fresh, {"n": 2}, id="0-2")
        started = time.monotonic()
        assert _read_until(reader, b"0-2") == [b"0-1", b"0-2"]
        assert time.monotonic() - started < 4  # woken: far below the hub's 20 s block
        assert ranges == []
        reader.close()
        source.close()
        # A second open of the same stream (a rebuild) is a fresh reader with its catch-up read.
        again = source.open(fresh)
        assert _read_until(again, b"0-2") == [b"0-1", b"0-2"]
        assert ranges != []
        again.close()
        first.close()
    finally:
        hub.close()
        redis_client.delete(busy, fresh)


@pytest.mark.timeout(30)
def test_a_wake_up_owed_by_a_joined_stream_that_was_never_read_is_sent_when_it_closes(
    redis_client: Redis,
) -> None:
    """A post-processor that found the response owned elsewhere must not leave the hub without
    the wake-up it owed: the next stream to join relies on it and does not send its own."""
    busy, dropped, later = "test:token-hub:owed-busy", "test:token-hub:owed", "test:token-hub:owed-later"
    redis_client.delete(busy, dropped, later)
    hub, first = _blocked_hub(redis_client, busy)
    try:
        hub.open_joined(dropped).close()  # nothing staged, nothing sent
        second = hub.open(later)
        assert second.read("0-0", 512, 100) == []  # joined, relying on the owed wake-up
        redis_client.xadd(later, {"n": 1}, id="0-1")
        started = time.monotonic()
        assert [entry_id for entry_id, _ in second.read("0-0", 512, 5_000)] == [b"0-1"]
        assert time.monotonic() - started < 4
        second.close()
        first.close()
    finally:
        hub.close()
        redis_client.delete(busy, dropped, later)


@pytest.mark.timeout(30)
def test_a_hub_closed_while_its_read_is_out_ends_quietly_when_its_redis_goes_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hub closed while its read is blocked ends within that read; when its Redis goes away under
    the read meanwhile (a test's private server stopping, a process exiting), the failure is the
    shutdown, not an error to report: it used to log "reading token streams failed; retrying"."""
    server = PrivateRedis(tmp_path)
    server.start()
    client = server.client()
    hubs_before = {thread for thread in threading.enumerate() if thread.name == "token-hub"}
    hub = TokenStreamHub(client, block_ms=5_000)
    reader = hub.open("test:token-hub:closing")
    try:
        assert reader.read("0-0", 512, 100) == []  # joined: the hub's read now blocks for 5 s
        (thread,) = {t for t in threading.enumerate() if t.name == "token-hub"} - hubs_before
        time.sleep(0.2)
        with caplog.at_level(logging.WARNING, logger="resq.postprocess.token_hub"):
            hub.close()
            server.stop()  # the read fails now, and so does every retry of it
            thread.join(10)
        assert not thread.is_alive()
        assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    finally:
        reader.close()
        hub.close()
        server.stop()
        client.close()
