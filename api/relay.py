"""Reading a response's event log: replay, follow live events, stop after the terminal one.

Events are stored pre-encoded (type and JSON bytes), so relaying one is framing
bytes, with no JSON work in the API. Any API replica can relay any response,
from any position: the log lives in Redis, not in the process that created it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from redis.asyncio import Redis
from sse_starlette import EventSourceResponse

from resq import keys
from resq.events import types
from resq.redis_types import optional_bytes, range_entries, stream_entries

READ_BLOCK_MS = 1000
READ_COUNT = 256
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_frame(event_type: bytes, data: bytes) -> bytes:
    """One server-sent event: ``event:`` and ``data:`` lines and a blank line."""
    return b"event: " + event_type + b"\ndata: " + data + b"\n\n"


def event_stream_response(frames: AsyncIterator[bytes], ping_s: float) -> EventSourceResponse:
    """The SSE response carrying ``frames`` (already framed by :func:`sse_frame`)."""
    return EventSourceResponse(frames, ping=ping_s, sep="\n", headers=SSE_HEADERS)


async def follow_events(
    redis: Redis, response_id: str, starting_after: int | None = None
) -> AsyncIterator[tuple[bytes, bytes]]:
    """``(type, data)`` of every event after ``starting_after``, ending with the terminal one.

    When the terminal event is at or before ``starting_after`` there is nothing to
    send and it returns at once. Ends early (without a terminal event) only when the
    response's keys vanish (deleted or expired) while it is followed.
    """
    events_key = keys.events(response_id)
    last_id: bytes | str = keys.event_entry_id(starting_after) if starting_after is not None else "0-0"
    # The first read does not block: a log that already ended is answered at once.
    block: int | None = None
    while True:
        entries = stream_entries(await redis.xread({events_key: last_id}, count=READ_COUNT, block=block))
        block = READ_BLOCK_MS
        if not entries:
            if await _log_ended(redis, response_id, last_id):
                return
            continue
        for entry_id, fields in entries:
            last_id = entry_id
            event_type = fields[b"type"]
            yield event_type, fields[b"data"]
            if event_type in types.TERMINAL_TYPES_BYTES:
                return


async def _log_ended(redis: Redis, response_id: str, read_up_to: bytes | str) -> bool:
    """Whether following the log past ``read_up_to`` can yield nothing: the response is gone, or
    its terminal event is at or before ``read_up_to`` (one appended since the last read is not)."""
    pipe = redis.pipeline(transaction=False)
    pipe.exists(keys.record(response_id))
    pipe.xrevrange(keys.events(response_id), count=1)
    exists, last = await pipe.execute()
    if not exists:
        return True
    entries = range_entries(last)
    if not entries:
        return False
    entry_id, fields = entries[0]
    terminal = fields.get(b"type") in types.TERMINAL_TYPES_BYTES
    return terminal and keys.sequence_number_of(entry_id) <= keys.sequence_number_of(read_up_to)


async def last_sequence_number(redis: Redis, response_id: str) -> int | None:
    """The ``sequence_number`` of the last logged event (None when the log is empty or gone)."""
    entries = range_entries(await redis.xrevrange(keys.events(response_id), count=1))
    return keys.sequence_number_of(entries[0][0]) if entries else None


async def wait_for_terminal(redis: Redis, response_id: str) -> bytes | None:
    """Wait until the response ends; return its stored final Response JSON (None if it vanished)."""
    async for event_type, _ in follow_events(redis, response_id):
        if event_type in types.TERMINAL_TYPES_BYTES:
            return optional_bytes(await redis.hget(keys.record(response_id), "response"))
    return None
