"""GPU worker metrics: what the engine holds and how fast it produces tokens."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge

ACTIVE_REQUESTS = Gauge(
    "resq_engine_active_requests", "Requests in the engine now (the continuous batch being decoded)."
)
MAX_BATCH = Gauge("resq_engine_max_batch", "Most requests the engine decodes at once (RESQ_MAX_BATCH).")
GENERATED_TOKENS = Counter(
    "resq_generated_tokens", "Tokens generated and published to token streams (rate: tokens per second)."
)
PROMPT_TOKENS = Counter("resq_prompt_tokens", "Prompt tokens of the requests admitted into the engine.")


def watch_engine(active_requests: Callable[[], int], max_batch: int) -> None:
    """Report the engine's batch, read at scrape time (nothing on the hot path)."""
    ACTIVE_REQUESTS.set_function(active_requests)
    MAX_BATCH.set(max_batch)


def note_published(tokens: int) -> None:
    """Count ``tokens`` published in one round trip."""
    if tokens:
        GENERATED_TOKENS.inc(tokens)
