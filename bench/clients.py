"""HTTP load: concurrent streaming clients that time the first and last token of each stream.

One light SSE reader serves every system (resq's Responses API, ``transformers
serve``'s chat completions, the relay floor), so the client costs the same
whichever server it measures. Token counts come from each server's own final
usage, never from counting chunks: a server that packs several tokens into one
chunk is neither favoured nor penalised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import orjson

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."

_RESQ_DELTA = b"event: response.output_text.delta"
_RESQ_TERMINAL = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed")


@dataclass
class StreamTiming:
    """What one client saw of one stream."""

    ttft_s: float
    """Request sent to first token received."""
    decode_s: float
    """First token to last token."""
    total_s: float
    tokens: int
    error: str | None = None
    frames: int = 0
    """Frames that carried tokens (a server that sends several tokens per delta sends fewer)."""
    max_gap_s: float = 0.0
    """The longest wait between two frames that carried tokens (a stall of the server shows here)."""

    @property
    def itl_s(self) -> float | None:
        """Mean time between tokens after the first (None for a single token)."""
        if self.tokens < 2:
            return None
        return self.decode_s / (self.tokens - 1)


def new_client(connections: int = 256) -> httpx.AsyncClient:
    """A pooled client whose pool admits ``connections`` simultaneous streams."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        timeout=httpx.Timeout(600.0, connect=60.0),
    )


class _Frames:
    """Splits a byte stream into SSE frames (separated by a blank line)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        frames = self._buffer.split(b"\n\n")
        self._buffer = frames.pop()
        return frames


def _data_of(frame: bytes) -> bytes:
    start = frame.find(b"data: ")
    return frame[start + 6 :] if start >= 0 else b""


def _timing(
    started: float, first: float | None, last: float | None, tokens: int, frames: int, max_gap_s: float = 0.0
) -> StreamTiming:
    first = first if first is not None else time.perf_counter()
    last = last if last is not None else first
    return StreamTiming(
        first - started, last - first, last - started, tokens, frames=frames, max_gap_s=max_gap_s
    )


async def _timed_stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, object],
    is_token: Callable[[bytes], bool],
    usage_tokens: Callable[[bytes], int | None] | None,
) -> StreamTiming:
    """Time one streaming POST: ``is_token`` marks frames carrying tokens; ``usage_tokens`` reads the
    server's own output-token count from a frame (None: not in this frame); without it, token frames
    are counted."""
    started = time.perf_counter()
    first: float | None = None
    last: float | None = None
    counted = 0
    max_gap_s = 0.0
    reported: int | None = None
    frames = _Frames()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return StreamTiming(0, 0, 0, 0, f"HTTP {response.status_code}: {response.text[:200]}")
        async for chunk in response.aiter_raw():
            now = time.perf_counter()
            for frame in frames.feed(chunk):
                if is_token(frame):
                    first = first or now
                    if last is not None:
                        max_gap_s = max(max_gap_s, now - last)
                    last = now
                    counted += 1
                # The last report wins: a server may send ``"usage": null`` before the real one.
                found = usage_tokens(frame) if usage_tokens is not None else None
                if found is not None:
                    reported = found
    tokens = counted if usage_tokens is None else (reported or 0)
    return _timing(started, first, last, tokens, counted, max_gap_s)


def _is_resq_delta(frame: bytes) -> bool:
    return frame.startswith(_RESQ_DELTA)


def _resq_usage_tokens(frame: bytes) -> int | None:
    if not frame.startswith(_RESQ_TERMINAL):
        return None
    usage = orjson.loads(_data_of(frame))["response"]["usage"] or {}
    return int(usage.get("output_tokens", 0))


def _is_chat_delta(frame: bytes) -> bool:
    return b'"delta":{"content":' in frame


def _chat_usage_tokens(frame: bytes) -> int | None:
    if b'"usage":' not in frame:
        return None
    usage = orjson.loads(_data_of(frame)).get("usage") or {}
    return int(usage.get("completion_tokens", 0))


async def resq_stream(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    max_tokens: int,
    text: dict[str, object] | None = None,
) -> StreamTiming:
    """One greedy streaming ``POST /v1/responses`` (``text``: e.g. a ``text.format`` to constrain it)."""
    body: dict[str, object] = {
        "model": model,
        "input": PROMPT,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if text is not None:
        body["text"] = text
    return await _timed_stream(client, f"{base_url}/v1/responses", body, _is_resq_delta, _resq_usage_tokens)


async def serve_stream(client: httpx.AsyncClient, base_url: str, model: str, max_tokens: int) -> StreamTiming:
    """One greedy streaming ``POST /v1/chat/completions`` (``transformers serve``)."""
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # Its final usage is what counts the tokens: transformers >= 5.25 sends it only when asked.
        "stream_options": {"include_usage": True},
    }
    return await _timed_stream(
        client, f"{base_url}/v1/chat/completions", body, _is_chat_delta, _chat_usage_tokens
    )


async def floor_stream(
    client: httpx.AsyncClient, base_url: str, tokens: int, interval_s: float
) -> StreamTiming:
    """One stream of the relay floor (it reports no usage: its token frames are counted)."""
    body: dict[str, object] = {"tokens": tokens, "interval_s": interval_s}
    return await _timed_stream(client, f"{base_url}/stream", body, _is_resq_delta, None)


async def concurrently(
    count: int, one: Callable[[], Awaitable[StreamTiming]], repeats: int = 1
) -> tuple[list[StreamTiming], float]:
    """Run ``count`` clients at once, each making ``repeats`` requests in a row.

    Returns every request's timing and the wall time until the last one ended.
    """

    async def guarded() -> StreamTiming:
        try:
            return await one()
        except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:
            return StreamTiming(0, 0, 0, 0, f"{type(exc).__name__}: {exc}")

    async def client_loop() -> list[StreamTiming]:
        return [await guarded() for _ in range(repeats)]

    started = time.perf_counter()
    per_client = await asyncio.gather(*(client_loop() for _ in range(count)))
    return [timing for timings in per_client for timing in timings], time.perf_counter() - started
