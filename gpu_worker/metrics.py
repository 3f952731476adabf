"""GPU worker metrics: what the engine holds and how fast it produces tokens."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

ACTIVE_REQUESTS = Gauge(
    "resq_engine_active_requests", "Requests in the engine now (the continuous batch being decoded)."
)
MAX_BATCH = Gauge("resq_engine_max_batch", "Most requests the engine decodes at once (RESQ_MAX_BATCH).")
GENERATED_TOKENS = Counter(
    "resq_generated_tokens", "Tokens generated and published to token streams (rate: tokens per second)."
)
PROMPT_TOKENS = Counter("resq_prompt_tokens", "Prompt tokens of the requests admitted into the engine.")
CACHED_PROMPT_TOKENS = Counter(
    "resq_cached_prompt_tokens",
    "Prompt tokens the engine reused from its prefix cache instead of computing, counted as requests "
    "end (what their usage reports as cached_tokens).",
)
GRAMMAR_MASK_SECONDS = Histogram(
    "resq_grammar_mask_seconds",
    "Time to compute one engine step's grammar masks: of the rows masked before the choice (overlaps the "
    "forward pass), or of the rows whose token the grammar refused.",
    buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
)
GRAMMAR_TOKEN_CHECKS = Counter(
    "resq_grammar_token_checks",
    "Constrained tokens chosen without a mask and tried against their grammar: accepted as chosen, "
    "or refused (then masked and chosen again).",
    ["outcome"],
)
# Bound once: a step with constrained rows counts both, and labels() is a locked look-up each call.
GRAMMAR_TOKENS_ACCEPTED = GRAMMAR_TOKEN_CHECKS.labels(outcome="accepted")
GRAMMAR_TOKENS_REFUSED = GRAMMAR_TOKEN_CHECKS.labels(outcome="refused")
CONSTRAINED_TOKENS = Counter(
    "resq_constrained_tokens", "Tokens chosen under a grammar (structured outputs, strict tools)."
)


def watch_engine(active_requests: Callable[[], int], max_batch: int) -> None:
    """Report the engine's batch, read at scrape time (nothing on the hot path)."""
    ACTIVE_REQUESTS.set_function(active_requests)
    MAX_BATCH.set(max_batch)


def note_published(tokens: int) -> None:
    """Count ``tokens`` published in one round trip."""
    if tokens:
        GENERATED_TOKENS.inc(tokens)
