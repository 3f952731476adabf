"""Reading a response's event log: replay, follow live events, stop after the terminal one.

Events are stored pre-encoded (type and JSON bytes), so relaying one is framing
bytes, with no JSON work in the API. Any API replica can relay any response,
from any position: the log lives in Redis, not in the process that created it.
The process's :class:`~api.event_hub.EventHub` does the reading: one blocking
read for all the logs the process follows, not one per client
(``docs/benchmarks.md`` has the measurements).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from redis.asyncio import Redis
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Message, Send

from api import coalesce, metrics
from api.event_hub import EventHub, OpenedLog
from resq import keys, records
from resq.events import types
from resq.redis_types import optional_bytes, range_entries

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_SEPARATOR = "\n"


def sse_frame(event_type: bytes, data: bytes) -> bytes:
    """One server-sent event: ``event:`` and ``data:`` lines and a blank line."""
    return b"event: " + event_type + b"\ndata: " + data + b"\n\n"


class RelayEventSourceResponse(EventSourceResponse):
    """sse-starlette's ``EventSourceResponse`` without a cancel scope around each write.

    With ``send_timeout=None`` the base class still enters ``anyio.move_on_after(None)``
    for every chunk: two thirds of the class's own CPU under load, which drops from
    8.8% to 3.0% of the API's (``docs/benchmarks.md``, B4, change 5). Pings,
    disconnect and shutdown handling are the base class's.
    """

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def _ping() -> ServerSentEvent:
    # A fixed comment: the default one formats the current time into every ping.
    return ServerSentEvent(comment="ping", sep=SSE_SEPARATOR)


def event_stream_response(chunks: AsyncIterator[bytes], ping_s: float) -> EventSourceResponse:
    """The SSE response carrying ``chunks`` (from :func:`sse_chunks`), a comment ping every ``ping_s``.

    sse-starlette passes ``bytes`` through unchanged, so the relay's pre-framed
    chunks are written as they are; it pings, and it cancels the body iterator
    when the client hangs up (the creating request's ``finally`` then cancels the
    generation).
    """
    return RelayEventSourceResponse(
        chunks, ping=ping_s, sep=SSE_SEPARATOR, ping_message_factory=_ping, headers=SSE_HEADERS
    )


async def follow_event_batches(
    redis: Redis, response_id: str, starting_after: int | None = None, opened: OpenedLog | None = None
) -> AsyncIterator[list[tuple[bytes, bytes]]]:
    """``(type, data)`` of every event after ``starting_after``, in batches, ending with the terminal one.

    A batch holds every event that arrived since the previous one, so a consumer
    that writes a batch at once makes one write per wake-up, not one per event. An
    empty batch means nothing arrived for a while (the relay writes nothing for it;
    the response pings on its own clock). When the terminal event is at or before
    ``starting_after`` there is nothing to send and it returns at once. Ends early (without a terminal event) only when the
    response's keys vanish (deleted or expired) while it is followed. ``opened``: the log was
    opened for this relay as it was created (:meth:`api.event_hub.EventHub.open_new`), from its start.
    """
    after = keys.event_entry_id(starting_after) if starting_after is not None else "0-0"
    read_up_to: bytes | str = after
    hub = EventHub.of(redis)
    following = hub.following(opened) if opened is not None else hub.follow(keys.events(response_id), after)
    async with following as follower:
        # The first look does not wait: a log that already ended is answered at once.
        wait = False
        while True:
            entries = await follower.next_batch(wait)
            wait = True
            if not entries:
                if await _log_ended(redis, response_id, read_up_to):
                    return
                yield []
                continue
            batch = []
            for entry_id, fields in entries:
                read_up_to = entry_id
                event_type = fields[b"type"]
                batch.append((event_type, fields[b"data"]))
                if event_type in types.TERMINAL_TYPES_BYTES:
                    yield batch
                    return
            yield batch


async def coalesced_when_behind(
    batches: AsyncIterator[list[tuple[bytes, bytes]]], coalesce_after: int
) -> AsyncIterator[list[tuple[bytes, bytes]]]:
    """``batches`` (from :func:`follow_event_batches`), the deltas of a client's lag merged.

    A batch after the first that holds more than ``coalesce_after`` events (the client was
    slow to take the previous one, or the log grew by a burst) has each run of deltas of one
    target merged into one event (:mod:`api.coalesce`); the first batch (the catch-up, or the
    whole replay of an ended response) and every smaller one go out as logged.
    ``coalesce_after`` 0: unchanged.
    """
    first = True
    async for batch in batches:
        if coalesce.lagging(first, len(batch), coalesce_after):
            merged = coalesce.coalesce(batch)
            if len(merged) < len(batch):
                metrics.DELTAS_COALESCED.inc(len(batch) - len(merged))
            batch = merged
        first = False
        yield batch


async def follow_events(
    redis: Redis, response_id: str, starting_after: int | None = None
) -> AsyncIterator[tuple[bytes, bytes]]:
    """``(type, data)`` of every event after ``starting_after``, ending with the terminal one.

    When the terminal event is at or before ``starting_after`` there is nothing to
    send and it returns at once. Ends early (without a terminal event) only when the
    response's keys vanish (deleted or expired) while it is followed.
    """
    async for batch in follow_event_batches(redis, response_id, starting_after):
        for event in batch:
            yield event


DONE_FRAME = b"data: [DONE]\n\n"
"""What follows the terminal event, as the Open Responses spec (and Chat Completions) end a stream.

The OpenAI SDKs stop reading at it (openai-python's ``Stream`` breaks on a ``data`` of
``[DONE]``), so it costs them nothing; a stream cut short (keys deleted) never gets it."""


async def sse_chunks(batches: AsyncIterator[list[tuple[bytes, bytes]]]) -> AsyncIterator[bytes]:
    """The SSE body of :func:`follow_event_batches`: one chunk of frames per non-empty batch.

    The chunk holding the terminal event ends with :data:`DONE_FRAME`.
    """
    async for batch in batches:
        if batch:
            frames = [sse_frame(event_type, data) for event_type, data in batch]
            if batch[-1][0] in types.TERMINAL_TYPES_BYTES:
                frames.append(DONE_FRAME)
            yield b"".join(frames)


CHAT_DONE_BYTES = types.CHAT_DONE.encode()
CHAT_CREATED_BYTES = types.CHAT_CREATED.encode()


async def chat_sse_chunks(batches: AsyncIterator[list[tuple[bytes, bytes]]]) -> AsyncIterator[bytes]:
    """The SSE body of a chat completion: ``data:`` lines only, as OpenAI frames them.

    Chunks go out as logged; the API's first entry (``chat.completion.created``) is not sent, and
    the log's terminal event is never sent as it is: a completion
    ends with ``data: [DONE]``, a failed one with its ``{"error": ...}`` body (which the SDKs
    raise as an ``APIError``).
    """
    async for batch in batches:
        frames = [
            DONE_FRAME if event_type == CHAT_DONE_BYTES else b"data: " + data + b"\n\n"
            for event_type, data in batch
            if event_type != CHAT_CREATED_BYTES
        ]
        if frames:
            yield b"".join(frames)


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
            return optional_bytes(await redis.hget(keys.record(response_id), records.FINAL_OBJECT))
    return None
