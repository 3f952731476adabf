"""Typed views of redis-py replies.

resq never sets ``decode_responses``: every reply is bytes. redis-py annotates
replies as unions of bytes and str (and of sync and async shapes), so these
helpers state, in one place, what the replies are.
"""

from __future__ import annotations

from typing import Any, TypeAlias, cast

from redis.typing import EncodableT, FieldT

StreamEntry: TypeAlias = tuple[bytes, dict[bytes, bytes]]
StreamFields: TypeAlias = dict[FieldT, EncodableT]


def stream_entries(reply: Any) -> list[StreamEntry]:
    """The entries of an ``XREAD`` reply on one stream (empty when it timed out)."""
    if not reply:
        return []
    return cast(list[StreamEntry], reply[0][1])


StreamId: TypeAlias = tuple[int, int]
"""A stream entry id ``ms-seq`` as a comparable pair."""


def parse_id(entry_id: bytes | str) -> StreamId:
    """A stream id ``ms-seq`` as a comparable pair."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_id(stream_id: StreamId) -> str:
    """The text form of a stream id pair."""
    return f"{stream_id[0]}-{stream_id[1]}"


def multi_stream_entries(reply: Any) -> list[tuple[bytes, list[StreamEntry]]]:
    """``(key, entries)`` of an ``XREAD`` reply on several streams (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    pairs = reply.items() if isinstance(reply, dict) else reply
    return [(key, entries) for key, entries in pairs]


def range_entries(reply: Any) -> list[StreamEntry]:
    """The entries of an ``XRANGE``/``XREVRANGE`` reply."""
    return cast(list[StreamEntry], reply or [])


def optional_bytes(reply: Any) -> bytes | None:
    """A ``GET``/``HGET`` reply."""
    return cast(bytes | None, reply)


def scored_members(reply: Any) -> list[tuple[bytes, float]]:
    """A ``ZRANGE ... WITHSCORES`` reply."""
    return cast(list[tuple[bytes, float]], reply)


def optional_text(reply: Any) -> str | None:
    """A string reply (bytes or str, as the client decodes) as text, or None."""
    if reply is None:
        return None
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def texts(reply: Any) -> list[str]:
    """A reply of names (``HKEYS``, ``SMEMBERS``) as text."""
    return [name.decode() if isinstance(name, bytes) else str(name) for name in reply]
