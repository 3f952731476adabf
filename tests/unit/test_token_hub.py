"""The post-process worker's token hub: one blocking read for every token stream, no entry lost or repeated."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from redis import Redis

from resq.postprocess.token_hub import DirectTokenSource, TokenSource, TokenStream, TokenStreamHub


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
