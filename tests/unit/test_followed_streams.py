"""The shared bookkeeping of the event hub and the token hub: positions, readers, routing."""

from __future__ import annotations

from redis.connection import Connection

from resq.followed_streams import FollowedStreams, entries_past
from resq.redis_types import StreamEntry


def entry(entry_id: str) -> StreamEntry:
    return (entry_id.encode(), {b"n": entry_id.encode()})


def test_entries_past_keep_only_what_follows_the_position_in_order() -> None:
    fresh, position = entries_past((1, 5), [entry("1-4"), entry("1-5"), entry("1-6"), entry("2-0")])
    assert [e[0] for e in fresh] == [b"1-6", b"2-0"] and position == (2, 0)
    assert entries_past((3, 0), [entry("2-9")]) == ([], (3, 0))


def test_the_next_read_names_every_followed_stream_and_the_wakeup_stream() -> None:
    streams: FollowedStreams[str] = FollowedStreams("wake:1")
    assert not streams and streams.read_arguments() == {"wake:1": "0-0"}
    assert streams.add(b"a", "reader-1", (0, 0)) == (0, 0)
    # A second reader joins at its own position, but the stream is read from the hub's.
    assert streams.add(b"a", "reader-2", (7, 0)) == (0, 0)
    assert streams.add(b"b", "reader-3", (3, 1)) == (3, 1)
    assert streams.read_arguments() == {b"a": "0-0", b"b": "3-1", "wake:1": "0-0"}


def test_a_reply_is_routed_to_the_readers_of_each_stream_and_moves_the_positions_on() -> None:
    streams: FollowedStreams[str] = FollowedStreams("wake:1")
    streams.add(b"a", "r1", (0, 0))
    streams.add(b"a", "r2", (0, 0))
    streams.add(b"b", "r3", (0, 0))
    routed = streams.route(
        [
            (b"a", [entry("1-0"), entry("2-0")]),
            (b"wake:1", [entry("5-0")]),
            (b"c", [entry("1-0")]),
            (b"b", []),
        ]
    )
    assert [(sorted(readers), [e[0] for e in entries]) for readers, entries in routed] == [
        (["r1", "r2"], [b"1-0", b"2-0"])
    ]
    assert streams.position(b"a") == (2, 0) and streams.position(b"b") == (0, 0)
    assert streams.position(b"c") is None
    # The wake-up stream is read on from its last entry: an old wake-up never returns again.
    assert streams.read_arguments()["wake:1"] == "5-0"


def test_a_stream_without_readers_is_no_longer_read() -> None:
    streams: FollowedStreams[str] = FollowedStreams("wake:1")
    streams.add(b"a", "r1", (0, 0))
    streams.add(b"a", "r2", (0, 0))
    streams.discard(b"a", "r1")
    assert streams.position(b"a") == (0, 0)
    streams.discard(b"a", "r2")
    streams.discard(b"a", "r2")  # twice: nothing
    assert streams.position(b"a") is None and not streams
    assert streams.route([(b"a", [entry("1-0")])]) == []


def test_the_packed_read_is_the_command_redis_py_packs_from_the_read_arguments() -> None:
    streams: FollowedStreams[str] = FollowedStreams("wake:1")
    assert_packs_like_redis_py(streams)
    streams.add(b"resq:{resp_a}:events", "r1", (0, 0))
    streams.add(b"resq:{resp_b}:events", "r2", (1796228314365, 12))
    assert_packs_like_redis_py(streams)
    # Positions move with the reply (the wake-up stream's too); a stream left is no longer read.
    streams.route([(b"resq:{resp_a}:events", [entry("17-3")]), (b"wake:1", [entry("18-0")])])
    streams.discard(b"resq:{resp_b}:events", "r2")
    assert_packs_like_redis_py(streams)
    assert streams.names() == frozenset({b"resq:{resp_a}:events"})


def assert_packs_like_redis_py(streams: FollowedStreams[str]) -> None:
    arguments = streams.read_arguments()
    packed = Connection().pack_command(
        "XREAD", "COUNT", 128, "BLOCK", 5000, "STREAMS", *arguments.keys(), *arguments.values()
    )
    assert streams.xread_command(128, 5000) == b"".join(packed)
