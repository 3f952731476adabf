"""The SSE response of the relay: sse-starlette's ``EventSourceResponse`` (thin subclass) driven as ASGI.

No server: the response is called with a recording ``send`` and a ``receive``
that reports a disconnect on demand, so framing, pings, the end of the body and
the cancellation on a hang-up are checked byte for byte.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from sse_starlette import EventSourceResponse
from sse_starlette import sse as sse_module
from starlette.types import Message, Receive, Scope, Send

from api.main import create_app
from api.relay import DONE_FRAME, RelayEventSourceResponse, event_stream_response, sse_chunks, sse_frame
from resq.settings import Settings

Batch = list[tuple[bytes, bytes]]
SCOPE: Scope = {"type": "http", "method": "POST", "path": "/v1/responses", "headers": []}
CREATED = (b"response.created", b'{"type":"response.created","sequence_number":0}')
DELTA = (b"response.output_text.delta", b'{"type":"response.output_text.delta","delta":"hi"}')
COMPLETED = (b"response.completed", b'{"type":"response.completed","sequence_number":9}')


async def _batches(items: list[Batch], pause_s: float = 0.0) -> AsyncIterator[Batch]:
    for batch in items:
        await asyncio.sleep(pause_s)
        yield batch


def _receiver(disconnect: asyncio.Event) -> Receive:
    async def receive() -> Message:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    return receive


def _recorder(messages: list[Message], on_body: Callable[[Message], None] | None = None) -> Send:
    async def send(message: Message) -> None:
        messages.append(message)
        if on_body is not None and message["type"] == "http.response.body":
            on_body(message)

    return send


async def _serve(response: EventSourceResponse, disconnect: asyncio.Event | None = None) -> list[Message]:
    messages: list[Message] = []
    receive = _receiver(disconnect or asyncio.Event())
    await asyncio.wait_for(response(SCOPE, receive, _recorder(messages)), timeout=10)
    return messages


def _bodies(messages: list[Message]) -> list[bytes]:
    return [m["body"] for m in messages if m["type"] == "http.response.body"]


def test_chunks_are_written_unchanged_one_per_batch_and_the_body_ends_after_the_terminal_event() -> None:
    batches = [[CREATED], [], [DELTA, DELTA], [DELTA, COMPLETED]]
    response = event_stream_response(sse_chunks(_batches(batches)), ping_s=60)

    messages = asyncio.run(_serve(response))

    start = messages[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-cache"
    assert headers[b"x-accel-buffering"] == b"no"
    # An empty batch writes nothing; every other batch is one write of its frames, as framed.
    assert _bodies(messages) == [
        sse_frame(*CREATED),
        sse_frame(*DELTA) + sse_frame(*DELTA),
        sse_frame(*DELTA) + sse_frame(*COMPLETED) + DONE_FRAME,
        b"",
    ]
    assert messages[-1]["more_body"] is False
    body = b"".join(_bodies(messages))
    # The terminal event, then `data: [DONE]` (Open Responses), then the end of the body.
    assert body.endswith(b"event: response.completed\ndata: " + COMPLETED[1] + b"\n\ndata: [DONE]\n\n")
    assert body.count(b"[DONE]") == 1


def test_an_idle_stream_gets_comment_pings_between_frames() -> None:
    batches = [[CREATED], [], [], [COMPLETED]]
    response = event_stream_response(sse_chunks(_batches(batches, pause_s=0.1)), ping_s=0.05)

    bodies = _bodies(asyncio.run(_serve(response)))

    pings = [body for body in bodies if body.startswith(b":")]
    assert pings, bodies
    assert set(pings) == {b": ping\n\n"}
    frames = [body for body in bodies if body and not body.startswith(b":")]
    assert frames == [sse_frame(*CREATED), sse_frame(*COMPLETED) + DONE_FRAME]
    assert bodies[-1] == b""


def test_a_client_that_hangs_up_cancels_the_body_iterator() -> None:
    cleaned_up: list[str] = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            yield sse_frame(*CREATED)
            await anyio.sleep_forever()
        finally:
            # What responses._stream_new_response does here: cancel the generation.
            cleaned_up.append("cancelled")

    async def scenario() -> list[Message]:
        disconnect = asyncio.Event()
        messages: list[Message] = []
        response = event_stream_response(endless(), ping_s=60)
        send = _recorder(messages, on_body=lambda _: disconnect.set())
        await asyncio.wait_for(response(SCOPE, _receiver(disconnect), send), timeout=10)
        return messages

    messages = asyncio.run(scenario())

    assert cleaned_up == ["cancelled"]
    assert _bodies(messages) == [sse_frame(*CREATED)]


@pytest.mark.parametrize(
    ("response_class", "scopes_per_write"), [(RelayEventSourceResponse, 0), (EventSourceResponse, 1)]
)
def test_writes_skip_the_per_write_cancel_scope(
    monkeypatch: pytest.MonkeyPatch, response_class: type[EventSourceResponse], scopes_per_write: int
) -> None:
    # Guards the subclass's one override: if sse-starlette stops writing through
    # ``_send_with_timeout`` or stops opening a scope there, this fails and the
    # override (and docs/benchmarks.md's B4 note) needs a second look.
    opened: list[float | None] = []
    move_on_after = anyio.move_on_after

    def counting(delay: float | None, *args: Any, **kwargs: Any) -> anyio.CancelScope:
        opened.append(delay)
        return move_on_after(delay, *args, **kwargs)

    monkeypatch.setattr(sse_module.anyio, "move_on_after", counting)
    chunks = sse_chunks(_batches([[CREATED], [DELTA], [COMPLETED]]))
    response = response_class(chunks, ping=60, sep="\n")

    asyncio.run(_serve(response))

    assert opened == [None] * (3 * scopes_per_write)


def test_the_api_leaves_open_streams_to_uvicorns_graceful_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    # sse-starlette's default would cut every stream at SIGTERM, cancelling foreground generations.
    monkeypatch.setattr(sse_module.AppStatus, "enable_automatic_graceful_drain", True)

    create_app(Settings())

    assert sse_module.AppStatus.enable_automatic_graceful_drain is False
