"""B5: what constrained decoding costs, structured vs plain streaming, paired per round.

Each round runs ``clients`` streaming clients of json_schema requests and as many of plain
ones on the same stack, back to back (the order alternates between rounds). Reported per
round: the throughput ratio structured / plain, then the median of those ratios; the TTFT
p50 and p99 of both (what grammar set-up adds to the first token); and, from the GPU
worker's own metrics, the mask time per constrained token.

The schema is an array of at least 10,000 short strings, so a structured answer never
completes before ``max_output_tokens`` and both kinds stream exactly as many tokens.

``resq bench`` runs this as scenario B5 (:meth:`bench.runner.BenchRun`); ``python -m
bench.structured`` (``make bench-structured``) runs it alone and prints the figures.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import clients
from bench.models import ensure_bench, ensure_tiny
from bench.procs import ProcGroup, free_port
from bench.report import b5_table, fmt_ratio, targets, to_markdown
from bench.results import ResultSet, RunRecord
from bench.stats import alternated
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
KINDS = ("plain", "structured")
WARMUP_TOKENS = 16
METRICS_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class KindRun:
    """One kind's clients in one round."""

    kind: str
    round_index: int
    tok_s: float
    ttft_ms: list[float]
    bad_streams: int


@dataclass
class B5Result:
    """Every run of B5 on one model, and the mask cost over all of them."""

    runs: list[KindRun] = field(default_factory=list)
    mask_us_per_token: float | None = None
    mask_ms_per_step: float | None = None
    masked_share: float | None = None
    """Of the constrained tokens, the share chosen under a mask (masked first, or refused by their
    grammar after a choice without one and chosen again)."""

    def records(self, model: str, clients_count: int) -> list[RunRecord]:
        """The runs as the bench's records (``B5`` per kind and round, ``B5mask`` once)."""
        found = [run_record(run, model, clients_count) for run in self.runs]
        if self.mask_us_per_token is not None and self.mask_ms_per_step is not None:
            mask = {"us_per_token": self.mask_us_per_token, "ms_per_step": self.mask_ms_per_step}
            if self.masked_share is not None:
                mask["masked_share"] = self.masked_share
            found.append(RunRecord("B5mask", "structured", model, clients_count, 0, metrics=mask))
        return found


def run_record(run: KindRun, model: str, clients_count: int) -> RunRecord:
    """One kind's round as a ``B5`` record."""
    return RunRecord(
        "B5",
        run.kind,
        model,
        clients_count,
        run.round_index,
        metrics={"tok_s": run.tok_s, "bad_streams": run.bad_streams},
        samples={"ttft_ms": run.ttft_ms},
    )


def gpu_worker_env(metrics_port: int) -> dict[str, str]:
    """What B5's GPU worker needs besides the stack's settings: its metrics, for the mask cost."""
    return {"RESQ_METRICS_PORT": str(metrics_port)}


def _samples(text: str) -> dict[str, float]:
    """Every sample of a Prometheus exposition with at most one label, by sample name (and
    ``name:value`` of its label)."""
    return {
        ":".join([sample.name, *sample.labels.values()]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if len(sample.labels) <= 1
    }


async def _wait_for_metrics(client: httpx.AsyncClient, metrics_url: str) -> None:
    # The GPU worker serves its metrics once its engine runs: the sign that this stack's worker
    # (not one an earlier stack left listed in Redis) is the one that will generate.
    deadline = asyncio.get_running_loop().time() + METRICS_TIMEOUT_S
    while True:
        try:
            if (await client.get(metrics_url)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the GPU worker's metrics ({metrics_url}) never answered")
        await asyncio.sleep(0.25)


async def one_kind(
    client: httpx.AsyncClient, stack: ResqStack, kind: str, clients_count: int, tokens: int, round_index: int
) -> KindRun:
    """``clients_count`` concurrent streams of ``kind``; their throughput and first-token times."""
    text = TEXT if kind == "structured" else None
    timings, wall = await clients.concurrently(
        clients_count,
        lambda: clients.resq_stream(client, stack.base_url, stack.model.served_name, tokens, text),
    )
    good = [timing for timing in timings if timing.error is None]
    bad = sum(1 for timing in timings if timing.error is not None or timing.tokens != tokens)
    return KindRun(
        kind, round_index, sum(t.tokens for t in good) / wall, [t.ttft_s * 1000 for t in good], bad
    )


async def measure(
    stack: ResqStack,
    metrics_url: str,
    rounds: int,
    clients_count: int,
    tokens: int,
    on_run: Callable[[KindRun], None] = lambda _: None,
) -> B5Result:
    """Warm both kinds up at full width, then ``rounds`` alternated rounds."""
    result = B5Result()
    async with httpx.AsyncClient(timeout=600) as client:
        await _wait_for_metrics(client, metrics_url)
        for kind in KINDS:
            await one_kind(client, stack, kind, clients_count, WARMUP_TOKENS, -1)
        before = _samples((await client.get(metrics_url)).text)
        for round_index in range(rounds):
            for kind in alternated(list(KINDS), round_index):
                run = await one_kind(client, stack, kind, clients_count, tokens, round_index)
                result.runs.append(run)
                on_run(run)
        after = _samples((await client.get(metrics_url)).text)

    def grown(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    constrained = grown("resq_constrained_tokens_total")
    if constrained:
        mask_s = grown("resq_grammar_mask_seconds_sum")
        result.mask_us_per_token = mask_s / constrained * 1e6
        result.mask_ms_per_step = mask_s / max(grown("resq_grammar_mask_seconds_count"), 1) * 1e3
        result.masked_share = 1 - grown("resq_grammar_token_checks_total:accepted") / constrained
    return result


def _print(result: B5Result, model: str, clients_count: int) -> None:
    results = ResultSet(records=result.records(model, clients_count))
    click.echo(to_markdown(b5_table(results)))
    (target,) = [found for found in targets(results) if found.name.startswith("B5")]
    click.echo(f"\n{target.name}: {fmt_ratio(target.measured)}, target >= {target.bound}: {target.verdict()}")
    if result.mask_ms_per_step is not None:
        click.echo(
            f"mask time per step with masked rows: {result.mask_ms_per_step:.3f} ms; "
            f"constrained tokens chosen under a mask: {100 * (result.masked_share or 0):.0f}%"
        )


def _echo_run(run: KindRun) -> None:
    flag = f" ({run.bad_streams} short or failed streams)" if run.bad_streams else ""
    click.echo(f"round {run.round_index + 1}: {run.kind:10s} {run.tok_s:8.1f} tok/s{flag}")


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
    metrics_port = free_port()
    stack = ResqStack(group, redis.url, served, gpu_worker_env=gpu_worker_env(metrics_port))
    try:
        stack.start()
        stack.wait_ready()
        click.echo(f"model {served.key}: {served.description}; {clients_count} clients x {tokens} tokens")
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        result = asyncio.run(measure(stack, metrics_url, rounds, clients_count, tokens, _echo_run))
        _print(result, served.key, clients_count)
    finally:
        group.stop_all()
        redis.stop()


if __name__ == "__main__":
    main()
