"""``python -m bench.structured``: what constrained decoding costs, structured vs plain, paired per round.

Each round runs 32 clients of json_schema requests and 32 clients of plain ones on the same
stack, back to back (the order alternates between rounds), and reports per round the
throughput ratio structured / plain, then the median of those ratios; the TTFT p50 and
p99 of both (what grammar set-up adds to the first token); and, from the GPU worker's
own metrics, the mask fill time per constrained token.

The schema is an array of at least 10,000 short strings, so a structured answer never
completes before ``max_output_tokens`` and both kinds stream exactly as many tokens.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import click
import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import clients
from bench.models import ensure_bench, ensure_tiny
from bench.procs import ProcGroup, free_port
from bench.stats import alternated, median, percentile
from bench.systems import ResqStack
from resq.embedded_redis import EmbeddedRedis

SCHEMA: dict[str, object] = {
    "type": "array",
    "items": {"type": "string", "maxLength": 16},
    "minItems": 10000,
}
TEXT: dict[str, object] = {
    "format": {"type": "json_schema", "name": "items", "schema": SCHEMA, "strict": True}
}
TARGET_RATIO = 0.85


def _samples(text: str) -> dict[str, float]:
    """Every unlabelled sample of a Prometheus exposition, by sample name."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


async def _round(
    client: httpx.AsyncClient, stack: ResqStack, kind: str, clients_count: int, tokens: int
) -> tuple[float, list[float], int]:
    text = TEXT if kind == "structured" else None
    timings, wall = await clients.concurrently(
        clients_count,
        lambda: clients.resq_stream(client, stack.base_url, stack.model.served_name, tokens, text),
    )
    good = [timing for timing in timings if timing.error is None]
    streamed = sum(timing.tokens for timing in good)
    short = sum(1 for timing in timings if timing.error is not None or timing.tokens != tokens)
    return streamed / wall, [timing.ttft_s * 1000 for timing in good], short


async def _measure(stack: ResqStack, rounds: int, clients_count: int, tokens: int, metrics_url: str) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        for kind in ("plain", "structured"):  # warm-up at full width
            await _round(client, stack, kind, clients_count, 16)
        before = _samples((await client.get(metrics_url)).text)
        ratios: list[float] = []
        ttft: dict[str, list[float]] = {"plain": [], "structured": []}
        for round_index in range(rounds):
            rates: dict[str, float] = {}
            for kind in alternated(["plain", "structured"], round_index):
                rate, first_tokens, short = await _round(client, stack, kind, clients_count, tokens)
                rates[kind] = rate
                ttft[kind].extend(first_tokens)
                flag = f" ({short} short or failed streams)" if short else ""
                click.echo(f"round {round_index + 1}: {kind:10s} {rate:8.1f} tok/s{flag}")
            ratios.append(rates["structured"] / rates["plain"])
            click.echo(f"round {round_index + 1}: structured / plain = {ratios[-1]:.3f}")
        after = _samples((await client.get(metrics_url)).text)

    def grown(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    mask_s = grown("resq_grammar_mask_seconds_sum")
    steps = grown("resq_grammar_mask_seconds_count")
    constrained = grown("resq_constrained_tokens_total")
    median_ratio = median(ratios)
    verdict = "met" if median_ratio >= TARGET_RATIO else f"MISSED by {TARGET_RATIO - median_ratio:.3f}"
    click.echo(f"per-round ratios: {', '.join(f'{value:.3f}' for value in ratios)}")
    click.echo(
        f"median structured / plain throughput: {median_ratio:.3f} (target >= {TARGET_RATIO}: {verdict})"
    )
    for kind, values in ttft.items():
        click.echo(
            f"TTFT {kind:10s} p50 {percentile(values, 50):7.1f} ms  p99 {percentile(values, 99):7.1f} ms"
        )
    if constrained:
        click.echo(
            f"mask fill: {mask_s / constrained * 1e6:.1f} us per constrained token "
            f"({mask_s / max(steps, 1) * 1e3:.3f} ms per step with constrained rows, overlapping the forward pass)"
        )


@click.command()
@click.option("--model", type=click.Choice(["tiny", "bench"]), default="bench", show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--clients", "clients_count", type=int, default=32, show_default=True)
@click.option("--tokens", type=int, default=128, show_default=True)
def main(model: str, rounds: int, clients_count: int, tokens: int) -> None:
    """Structured (json_schema) vs plain streaming throughput and TTFT, paired per round."""
    cache = Path.home() / ".cache" / "resq" / "bench-models"
    served = ensure_bench(cache) if model == "bench" else ensure_tiny(cache)
    redis = EmbeddedRedis()
    redis.start()
    group = ProcGroup(Path(tempfile.mkdtemp(prefix="resq-bench-structured-")))
    # Inline post-processing: the GPU worker is then the only process serving worker metrics.
    metrics_port = free_port()
    os.environ["RESQ_METRICS_PORT"] = str(metrics_port)
    stack = ResqStack(group, redis.url, served, postprocess_workers=0)
    try:
        stack.start()
        stack.wait_ready()
        click.echo(f"model {served.key}: {served.description}; {clients_count} clients x {tokens} tokens")
        asyncio.run(
            _measure(stack, rounds, clients_count, tokens, f"http://127.0.0.1:{metrics_port}/metrics")
        )
    finally:
        group.stop_all()
        redis.stop()


if __name__ == "__main__":
    main()
