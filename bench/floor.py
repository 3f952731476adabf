"""The relay floor of B4: a bare Starlette ``StreamingResponse`` under the same uvicorn.

``POST /stream`` with ``{"tokens": n, "interval_s": s}`` answers ``n`` SSE frames
of a real ``response.output_text.delta`` event (pre-encoded once), one every
``s`` seconds, then a terminal frame. No Redis, no validation, no queue: the
least CPU per streamed token any SSE relay in Python can spend, to weigh the
resq API's CPU per token against.

Run as ``python -m bench.floor --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from resq.events import builders as build
from resq.events.emitter import EventEmitter


def _frame(event_type: str, data: bytes) -> bytes:
    return b"event: " + event_type.encode() + b"\ndata: " + data + b"\n\n"


def _delta_frame() -> bytes:
    event = EventEmitter(7).emit(
        build.output_text_delta("msg_0123456789abcdef0123456789abcdef", 0, 0, " the")
    )
    return _frame(event.type, event.data)


DELTA_FRAME = _delta_frame()
DONE_FRAME = _frame("response.completed", b'{"type":"response.completed","sequence_number":9999}')


async def _frames(tokens: int, interval_s: float) -> AsyncIterator[bytes]:
    for _ in range(tokens):
        if interval_s > 0:
            await asyncio.sleep(interval_s)
        yield DELTA_FRAME
    yield DONE_FRAME


async def stream(request: Request) -> Response:
    """The SSE stream of one fake response."""
    body = orjson.loads(await request.body())
    return StreamingResponse(
        _frames(int(body["tokens"]), float(body.get("interval_s", 0.0))), media_type="text/event-stream"
    )


async def health(_: Request) -> Response:
    """Always 200."""
    return Response(b"ok")


app = Starlette(routes=[Route("/stream", stream, methods=["POST"]), Route("/health", health)])


def main() -> None:
    """Serve the floor app on ``--port``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
