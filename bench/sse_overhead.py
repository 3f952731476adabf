"""What the SSE response class itself costs: CPU per written chunk and per stream, in one process.

B4 measures the whole API under load, where the response class is a few percent
and a busy machine's noise is larger than that. This drives the ASGI responses
directly (a ``send`` that does nothing, a ``receive`` that never reports a
disconnect, one event-loop wake-up per chunk as the event hub's) and compares
Starlette's plain ``StreamingResponse``, sse-starlette's ``EventSourceResponse``
as it comes (``send_timeout=None``) and the relay's
:func:`api.relay.event_stream_response`, in alternating order, medians of rounds.

Run as ``python -m bench.sse_overhead`` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Callable

import uvloop
from sse_starlette import EventSourceResponse
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Scope

from api.relay import event_stream_response
from bench.floor import DELTA_FRAME

# uvicorn's httptools protocol announces ASGI spec 2.3: Starlette then listens for the disconnect too.
SCOPE: Scope = {
    "type": "http",
    "method": "POST",
    "path": "/v1/responses",
    "headers": [],
    "asgi": {"version": "3.0", "spec_version": "2.3"},
}
PING_S = 15.0

Factory = Callable[[AsyncIterator[bytes]], Response]
RESPONSES: dict[str, Factory] = {
    "StreamingResponse": lambda body: StreamingResponse(body, media_type="text/event-stream"),
    "EventSourceResponse": lambda body: EventSourceResponse(body, ping=PING_S, sep="\n"),
    "resq relay": lambda body: event_stream_response(body, PING_S),
}


async def _body(chunks: int) -> AsyncIterator[bytes]:
    for _ in range(chunks):
        await asyncio.sleep(0)
        yield DELTA_FRAME


async def _cpu_s(factory: Factory, streams: int, chunks: int) -> float:
    never = asyncio.Event()

    async def receive() -> Message:
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        return None

    started = time.process_time()
    await asyncio.gather(*(factory(_body(chunks))(SCOPE, receive, send) for _ in range(streams)))
    return time.process_time() - started


async def measure(rounds: int, chunks: int, streams: int) -> dict[str, dict[str, float]]:
    """Median CPU microseconds per chunk (one long stream) and per stream (many one-chunk streams)."""
    names = list(RESPONSES)
    per_chunk: dict[str, list[float]] = {name: [] for name in names}
    per_stream: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            per_chunk[name].append(await _cpu_s(RESPONSES[name], 1, chunks) * 1e6 / chunks)
            per_stream[name].append(await _cpu_s(RESPONSES[name], streams, 1) * 1e6 / streams)
    return {
        name: {
            "chunk_us": statistics.median(per_chunk[name]),
            "stream_us": statistics.median(per_stream[name]),
        }
        for name in names
    }


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=20_000, help="Chunks of the long stream.")
    parser.add_argument("--streams", type=int, default=500, help="One-chunk streams run at once.")
    args = parser.parse_args()
    results = uvloop.run(measure(args.rounds, args.chunks, args.streams))
    floor = results["StreamingResponse"]
    print(f"{'response':<22}{'us/chunk':>10}{'extra':>8}{'us/stream':>11}{'extra':>8}")
    for name, result in results.items():
        print(
            f"{name:<22}{result['chunk_us']:>10.2f}{result['chunk_us'] - floor['chunk_us']:>+8.2f}"
            f"{result['stream_us']:>11.1f}{result['stream_us'] - floor['stream_us']:>+8.1f}"
        )


if __name__ == "__main__":
    main()
