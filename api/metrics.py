"""The API's metrics: HTTP requests, streams and what they deliver, and (at scrape) the queues.

Hot-path cost: one counter increment per HTTP request, and per relayed delta event one
clock read and one histogram observation. Nothing here parses an event except the
terminal one (once per response, for its token usage).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from resq import jsonutil
from resq.events import types

UNMATCHED_ROUTE = "<unmatched>"
"""Route label of requests that matched no route (their raw paths would explode cardinality)."""
CLIENT_CLOSED_REQUEST = 499
"""Status of a request whose client left before its answer (nginx's code; nobody receives it)."""

DELTA_TYPES = frozenset(
    {
        b"response.output_text.delta",
        b"response.reasoning_text.delta",
        b"response.function_call_arguments.delta",
        # Chat completions: every chunk carries answer (the role chunk goes out with the first).
        types.CHAT_CHUNK.encode(),
    }
)

REQUESTS = Counter(
    "resq_http_requests",
    "HTTP requests by route template, method and status (counted when the response ends).",
    ["route", "method", "status"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "resq_time_to_first_token_seconds",
    "Streamed responses: seconds from the request's arrival to relaying its first delta event.",
    buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
INTER_TOKEN = Histogram(
    "resq_inter_token_seconds",
    "Streamed responses: seconds between consecutive delta events relayed to the client.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
OUTPUT_TOKENS = Counter(
    "resq_output_tokens",
    "Output tokens of the responses this API delivered (streamed, or returned when done), by model.",
    ["model"],
)
RESPONSES_DELIVERED = Counter(
    "resq_responses_delivered",
    "Generations this API delivered to the end, by final status and endpoint (responses, chat_completions).",
    ["status", "endpoint"],
)
DELTAS_COALESCED = Counter(
    "resq_sse_deltas_coalesced",
    "Delta events saved by merging the runs of deltas a slow stream client fell behind on "
    "(SSE and WebSocket; RESQ_SSE_COALESCE_AFTER): events relayed as logged minus events sent.",
)
ACTIVE_STREAMS = Gauge("resq_active_streams", "SSE streams open on this API process.")
QUEUE_DEPTH = Gauge(
    "resq_queue_depth", "Messages waiting in a Celery queue (read from Redis at scrape time).", ["queue"]
)
WORKERS_ALIVE = Gauge(
    "resq_workers_alive", "Workers whose heartbeat is fresh (read from Redis at scrape time).", ["role"]
)
REDIS_UP = Gauge("resq_redis_up", "1 when Redis answered the last scrape's queries, else 0.")
GRAMMAR_CHECKS = Counter(
    "resq_grammar_checks",
    "Constrained requests' grammars checked before queueing, by result: compiled (checked now) or "
    "remembered (the model's vocabulary accepted the same grammar recently: no compile).",
    ["result"],
)
AFFINITY_ROUTED = Counter(
    "resq_affinity_routed",
    "Jobs with a routing key (prompt_cache_key, conversation, previous_response_id), by outcome: "
    "hit (sent to the GPU worker that served the prefix last), fallback (it was gone, full or "
    "serving another model: the shared queue), none (no worker recorded for the key).",
    ["outcome"],
)

_CHAT_TERMINAL_BYTES = frozenset({types.CHAT_DONE.encode(), types.CHAT_FAILED.encode()})

_REQUEST_STARTED: ContextVar[float | None] = ContextVar("resq_request_started", default=None)


class HTTPMetricsMiddleware:
    """Counts every HTTP request by route template, method and status; notes when it arrived."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets if the app raises before answering
        token = _REQUEST_STARTED.set(time.perf_counter())

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            route = getattr(scope.get("route"), "path", UNMATCHED_ROUTE)
            REQUESTS.labels(route, scope["method"], str(status)).inc()
            _REQUEST_STARTED.reset(token)


@contextlib.contextmanager
def request_timed() -> Iterator[None]:
    """Within it, a request that did not come as HTTP (a WebSocket message) started now: what
    its stream's time to first token counts from (:class:`HTTPMetricsMiddleware` notes HTTP's)."""
    token = _REQUEST_STARTED.set(time.perf_counter())
    try:
        yield
    finally:
        _REQUEST_STARTED.reset(token)


def record_delivered(response: dict[str, Any] | None) -> None:
    """Count a final Response (or chat completion) handed to a client: its status and output tokens."""
    if not response:
        return
    if response.get("object") == "chat.completion":
        RESPONSES_DELIVERED.labels("completed", "chat_completions").inc()
        output_tokens = (response.get("usage") or {}).get("completion_tokens")
    elif "error" in response and "object" not in response:  # a failed chat completion's body
        RESPONSES_DELIVERED.labels("failed", "chat_completions").inc()
        return
    else:
        RESPONSES_DELIVERED.labels(str(response.get("status")), "responses").inc()
        output_tokens = (response.get("usage") or {}).get("output_tokens")
    if isinstance(output_tokens, int) and output_tokens > 0:
        OUTPUT_TOKENS.labels(str(response.get("model"))).inc(output_tokens)


def record_delivered_json(response_json: bytes) -> None:
    """:func:`record_delivered` for a final object in its JSON form."""
    record_delivered(jsonutil.loads(response_json))


class _StreamTimer:
    """TTFT and inter-token observations of one stream, event by event."""

    def __init__(self, new_response: bool) -> None:
        self._started = _REQUEST_STARTED.get() or time.perf_counter()
        self._new_response = new_response
        self._last_delta: float | None = None

    def observe(self, event_type: bytes, data: bytes, now: float) -> None:
        if event_type in DELTA_TYPES:
            if self._last_delta is not None:
                INTER_TOKEN.observe(now - self._last_delta)
            elif self._new_response:
                TIME_TO_FIRST_TOKEN.observe(now - self._started)
            self._last_delta = now
        elif event_type in _CHAT_TERMINAL_BYTES:
            record_delivered(jsonutil.loads(data))
        elif event_type in types.TERMINAL_TYPES_BYTES:
            record_delivered(jsonutil.loads(data).get("response"))


async def measured_stream(
    events: AsyncIterator[tuple[bytes, bytes]], new_response: bool = True
) -> AsyncIterator[tuple[bytes, bytes]]:
    """``events`` unchanged, timed: the stream is active meanwhile; TTFT only for a ``new_response``."""
    timer = _StreamTimer(new_response)
    ACTIVE_STREAMS.inc()
    try:
        async for event_type, data in events:
            timer.observe(event_type, data, time.perf_counter())
            yield event_type, data
    finally:
        ACTIVE_STREAMS.dec()


async def measured_batches(
    batches: AsyncIterator[list[tuple[bytes, bytes]]], new_response: bool = True
) -> AsyncIterator[list[tuple[bytes, bytes]]]:
    """:func:`measured_stream` for batches of events (what :func:`api.relay.sse_chunks` relays)."""
    timer = _StreamTimer(new_response)
    ACTIVE_STREAMS.inc()
    try:
        async for batch in batches:
            now = time.perf_counter()
            for event_type, data in batch:
                timer.observe(event_type, data, now)
            yield batch
    finally:
        ACTIVE_STREAMS.dec()
