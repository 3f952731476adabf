"""Reading a response's event log: replay, follow live events, stop after the terminal one.

Events are stored pre-encoded (type and JSON bytes), so relaying one is framing
bytes, with no JSON work in the API. Any API replica can relay any response,
from any position: the log lives in Redis, not in the process that created it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from redis.asyncio import Redis

from resq import keys
from resq.events import types
from resq.redis_types import optional_bytes, stream_entries

READ_BLOCK_MS = 1000
READ_COUNT = 256


def sse_frame(event_type: bytes, data: bytes) -> bytes:
    """One server-sent event: ``event:`` and ``data:`` lines and a blank line."""
    return b"event: " + event_type + b"\ndata: " + data + b"\n\n"


async def follow_events(
    redis: Redis, response_id: str, starting_after: int | None = None
) -> AsyncIterator[tuple[bytes, bytes]]:
    """``(type, data)`` of every event after ``starting_after``, ending with the terminal one.

    Ends early (without a terminal event) only when the response's keys vanish
    (deleted or expired) while it is followed.
    """
    events_key = keys.events(response_id)
    last_id: bytes | str = keys.event_entry_id(starting_after) if starting_after is not None else "0-0"
    while True:
        entries = stream_entries(
            await redis.xread({events_key: last_id}, count=READ_COUNT, block=READ_BLOCK_MS)
        )
        if not entries:
            if not await redis.exists(keys.record(response_id)):
                return
            continue
        for entry_id, fields in entries:
            last_id = entry_id
            event_type = fields[b"type"]
            yield event_type, fields[b"data"]
            if event_type in types.TERMINAL_TYPES_BYTES:
                return


async def wait_for_terminal(redis: Redis, response_id: str) -> bytes | None:
    """Wait until the response ends; return its stored final Response JSON (None if it vanished)."""
    async for event_type, _ in follow_events(redis, response_id):
        if event_type in types.TERMINAL_TYPES_BYTES:
            return optional_bytes(await redis.hget(keys.record(response_id), "response"))
    return None
