"""The bookkeeping of a stream hub: the streams one process reads with one blocking ``XREAD``.

The API's event hub (:mod:`api.event_hub`, asyncio) and a post-process worker's token hub
(:mod:`resq.postprocess.token_hub`, threads) both keep one read in flight on every stream
their readers wait on, plus a wake-up stream of their own that makes a blocked read return
when a stream joins. What they share has no I/O and no locking, and lives here: each stream's
position (the last entry id the hub read) and readers, the next ``XREAD`` (already in Redis'
wire form: :meth:`FollowedStreams.xread_command`), and which readers get which entries of its
reply. Each hub owns one instance and guards it its own way (the event loop, or a lock).

Why the wire form is built here: the read names every followed stream and its position, so
redis-py's generic packing (an encode, a length and a copy per argument, per read) was a tenth
of the API's CPU at 64 streams. Each stream's name is encoded once, when it joins, and its
position when it moves; a read is one join of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from resq.redis_types import StreamEntry, StreamId, format_id, parse_id

R = TypeVar("R")


def _bulk(value: bytes) -> bytes:
    """``value`` as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _id_bulk(position: StreamId) -> bytes:
    return _bulk(b"%d-%d" % position)


@dataclass
class _Followed(Generic[R]):
    name_bulk: bytes
    position: StreamId
    position_bulk: bytes
    readers: set[R] = field(default_factory=set)

    def move_to(self, position: StreamId) -> None:
        if position != self.position:
            self.position = position
            self.position_bulk = _id_bulk(position)


def entries_past(position: StreamId, entries: list[StreamEntry]) -> tuple[list[StreamEntry], StreamId]:
    """The entries after ``position`` (a reader's: it saw the others), and the new position."""
    fresh = []
    for entry in entries:
        entry_id = parse_id(entry[0])
        if entry_id > position:
            fresh.append(entry)
            position = entry_id
    return fresh, position


class FollowedStreams(Generic[R]):
    """The streams a hub follows, by name, with their readers; and its wake-up stream."""

    def __init__(self, wakeup_key: str) -> None:
        """``wakeup_key``: a fresh key, so that every entry on it is a wake-up (``$`` could miss
        one sent before the read lands)."""
        self.wakeup_key = wakeup_key
        self._wakeup_name = wakeup_key.encode()
        self._wakeup_position = "0-0"
        self._wakeup_name_bulk = _bulk(self._wakeup_name)
        self._wakeup_position_bulk = _bulk(b"0-0")
        self._followed: dict[bytes, _Followed[R]] = {}

    def __bool__(self) -> bool:
        return bool(self._followed)

    def position(self, name: bytes) -> StreamId | None:
        """How far the hub has read stream ``name`` (None: it does not follow it)."""
        followed = self._followed.get(name)
        return followed.position if followed is not None else None

    def add(self, name: bytes, reader: R, position: StreamId) -> StreamId:
        """Feed ``reader`` from stream ``name``, followed from ``position`` if it is new here; the
        hub's position on it (past the reader's when the hub read on: the caller fetches the gap)."""
        followed = self._followed.get(name)
        if followed is None:
            followed = self._followed[name] = _Followed(_bulk(name), position, _id_bulk(position))
        followed.readers.add(reader)
        return followed.position

    def discard(self, name: bytes, reader: R) -> None:
        """Stop feeding ``reader``; a stream left without readers is no longer read."""
        followed = self._followed.get(name)
        if followed is None:
            return
        followed.readers.discard(reader)
        if not followed.readers:
            del self._followed[name]

    def read_arguments(self) -> dict[bytes | str, str]:
        """The ``streams`` argument of the next ``XREAD``: every followed stream and the wake-up one."""
        streams: dict[bytes | str, str] = {
            name: format_id(followed.position) for name, followed in self._followed.items()
        }
        streams[self.wakeup_key] = self._wakeup_position
        return streams

    def names(self) -> frozenset[bytes]:
        """The streams followed now (what the next read covers, besides the wake-up stream)."""
        return frozenset(self._followed)

    def xread_command(self, count: int, block_ms: int) -> bytes:
        """The next ``XREAD COUNT count BLOCK block_ms STREAMS ...`` as Redis' wire protocol (RESP):
        the same bytes redis-py packs from :meth:`read_arguments`."""
        followed = self._followed.values()
        arguments = 6 + 2 * (len(self._followed) + 1)
        head = b"*%d\r\n$5\r\nXREAD\r\n$5\r\nCOUNT\r\n%s$5\r\nBLOCK\r\n%s$7\r\nSTREAMS\r\n" % (
            arguments,
            _bulk(b"%d" % count),
            _bulk(b"%d" % block_ms),
        )
        return b"".join(
            [
                head,
                *[stream.name_bulk for stream in followed],
                self._wakeup_name_bulk,
                *[stream.position_bulk for stream in followed],
                self._wakeup_position_bulk,
            ]
        )

    def route(
        self, replies: list[tuple[bytes, list[StreamEntry]]]
    ) -> list[tuple[list[R], list[StreamEntry]]]:
        """Take an ``XREAD`` reply: each stream's entries with the readers they go to (positions
        move on; wake-ups and streams no longer followed are dropped)."""
        deliveries: list[tuple[list[R], list[StreamEntry]]] = []
        for name, entries in replies:
            if not entries:
                continue
            if name == self._wakeup_name:
                self._wakeup_position = entries[-1][0].decode()
                self._wakeup_position_bulk = _bulk(entries[-1][0])
                continue
            followed = self._followed.get(name)
            if followed is None:
                continue
            followed.move_to(max(followed.position, parse_id(entries[-1][0])))
            deliveries.append((list(followed.readers), entries))
        return deliveries
