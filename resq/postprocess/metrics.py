"""Post-processing metrics (in post-process workers, or in the API when post-processing is inline)."""

from __future__ import annotations

import time
from typing import Literal

from prometheus_client import Counter, Gauge, Histogram

from resq.metrics import stream_entry_age_s

EVENTS_LOGGED = Counter(
    "resq_postprocess_events", "Response events appended to event logs (rate: events per second)."
)
LAG = Histogram(
    "resq_postprocess_lag_seconds",
    "Per batch of a response's token chunks: seconds from the oldest chunk reaching Redis to its "
    "events being logged.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
BATCHES = Counter(
    "resq_postprocess_batches",
    "Batches of token chunks turned into logged events, by the thread that did it: 'hub' (the "
    "common case, on the worker's token-stream thread, appends shared in one pipeline) or "
    "'thread' (the response's own thread: starts, ends, gaps, stop sequences, refused writes).",
    ["path"],
)
ACTIVE = Gauge("resq_postprocess_active_responses", "Responses being post-processed now.")
RESPONSES = Counter(
    "resq_postprocess_responses", "Responses post-processed to their end, by final status.", ["status"]
)


def note_events_logged(count: int) -> None:
    """Count ``count`` events appended to an event log."""
    EVENTS_LOGGED.inc(count)


def note_batch_logged(oldest_entry_id: bytes | str, path: Literal["hub", "thread"]) -> None:
    """Count a batch logged on ``path``; observe its lag from its oldest entry ``oldest_entry_id``."""
    BATCHES.labels(path).inc()
    LAG.observe(stream_entry_age_s(oldest_entry_id, time.time()))
