"""Cache-aware routing under load: 16 concurrent agent loops on 2 GPU workers vs on 1.

Issue 16's "B6": with several GPU workers, a turn carrying ``previous_response_id`` and a
``prompt_cache_key`` goes to the worker that served its prefix last (``resq/affinity.py``).
This runs ``loops`` concurrent agent loops (:mod:`bench.agent_loop`'s turns, each loop with a
session of its own) on a stack with two GPU workers and on one with a single GPU worker, and
reports the affinity hit rate (``resq_affinity_routed_total`` of the API: hit / all routed) and
the median turn-10 TTFT of each stack, paired per round. Targets: hit rate >= 90%; turn-10 TTFT
with two workers within 1.2x of one worker's.

On a 2-core machine the two GPU workers share the cores with everything else, so the TTFT
ratio measures contention as much as routing; the hit rate does not depend on it.

``python -m bench.affinity`` (``make bench-affinity``).
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import httpx

from bench.agent_loop import TURN_TIMEOUT_S, LoopShape, ensure_text_model, http_loop, session_tag
from bench.models import ensure_bench, ensure_tiny
from bench.procs import ProcGroup
from bench.report import fmt, fmt_paired
from bench.stats import median, ratio
from bench.systems import ResqStack
from resq.embedded_redis import EmbeddedRedis

HIT_RATE_TARGET = 0.9
TTFT_RATIO_TARGET = 1.2
_ROUTED = re.compile(r'^resq_affinity_routed_total\{outcome="(\w+)"\} ([0-9.e+]+)$', re.M)


def routed_counts(metrics_text: str) -> dict[str, float]:
    """``resq_affinity_routed_total`` by outcome, from a Prometheus text page."""
    return {outcome: float(value) for outcome, value in _ROUTED.findall(metrics_text)}


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Hits over every routed job between two scrapes (None when nothing was routed)."""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in set(before) | set(after)}
    routed = sum(delta.values())
    return delta.get("hit", 0.0) / routed if routed > 0 else None


@dataclass
class StackRound:
    """One round of ``loops`` concurrent loops on one stack."""

    last_ttft_ms: float
    hit_rate: float | None
    wall_s: float


async def one_round(stack: ResqStack, loops: int, shape: LoopShape, tag: str) -> StackRound:
    """``loops`` loops at once on ``stack``: the median turn-10 TTFT and the hit rate meanwhile."""
    limits = httpx.Limits(max_connections=loops + 4)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(TURN_TIMEOUT_S, connect=60.0), limits=limits
    ) as client:
        before = routed_counts((await client.get(f"{stack.base_url}/metrics")).text)
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                http_loop(client, stack.base_url, stack.model.served_name, f"{tag}-{index}", shape)
                for index in range(loops)
            )
        )
        wall = time.perf_counter() - started
        after = routed_counts((await client.get(f"{stack.base_url}/metrics")).text)
    last = [turns[-1].ttft_s * 1000 for turns, _ in results if turns[-1].ttft_s is not None]
    return StackRound(median(last) if last else float("nan"), hit_rate(before, after), wall)


@click.command()
@click.option("--model", type=click.Choice(["tiny", "bench"]), default="bench", show_default=True)
@click.option("--rounds", type=int, default=2, show_default=True)
@click.option("--loops", type=int, default=16, show_default=True)
@click.option("--turns", type=int, default=LoopShape.turns, show_default=True)
def main(model: str, rounds: int, loops: int, turns: int) -> None:
    """Affinity hit rate and turn-10 TTFT: 16 concurrent agent loops on 2 GPU workers vs 1."""
    shape = LoopShape(turns=turns)
    cache = Path.home() / ".cache" / "resq" / "bench-models"
    served = ensure_text_model(cache, ensure_bench(cache) if model == "bench" else ensure_tiny(cache))
    redis_two, redis_one = EmbeddedRedis(), EmbeddedRedis()
    group = ProcGroup(Path(tempfile.mkdtemp(prefix="resq-bench-affinity-")))
    two = ResqStack(group, redis_two.url, served, gpu_workers=2)
    one = ResqStack(group, redis_one.url, served)
    try:
        for server in (redis_two, redis_one):
            server.start()
        for stack in (two, one):
            stack.start()
        for stack in (two, one):
            stack.wait_ready()
        click.echo(f"model {served.key}; {loops} loops x {shape.turns} turns; logs in {group.log_dir}")
        tag = f"{int(time.time())}"
        measured: dict[str, list[StackRound]] = {"two": [], "one": []}
        for round_index in range(-1, rounds):  # round -1: warm-up, not counted
            order = [("two", two), ("one", one)] if round_index % 2 else [("one", one), ("two", two)]
            for name, stack in order:
                result = asyncio.run(one_round(stack, loops, shape, session_tag(tag, round_index, name)))
                label = "warm-up" if round_index < 0 else f"round {round_index + 1}"
                shown = "-" if result.hit_rate is None else f"{result.hit_rate:.1%}"
                click.echo(
                    f"{label}: {name} GPU worker(s): turn-10 TTFT p50 {fmt(result.last_ttft_ms, 1)} ms, "
                    f"hit rate {shown}, wall {result.wall_s:.1f} s"
                )
                if round_index >= 0:
                    measured[name].append(result)
        rates = [r.hit_rate for r in measured["two"] if r.hit_rate is not None]
        ratios = [
            value
            for value in (
                ratio(a.last_ttft_ms, b.last_ttft_ms)
                for a, b in zip(measured["two"], measured["one"], strict=True)
            )
            if value is not None
        ]
        rate = median(rates) if rates else None
        paired = median(ratios) if ratios else None
        click.echo("")
        verdict = "met" if rate is not None and rate >= HIT_RATE_TARGET else "MISSED"
        shown_rate = "-" if rate is None else f"{rate:.1%} (rounds: {', '.join(f'{r:.1%}' for r in rates)})"
        click.echo(
            f"affinity hit rate, 2 GPU workers (median of rounds): {shown_rate}, target >= 90%: {verdict}"
        )
        verdict = "met" if paired is not None and paired <= TTFT_RATIO_TARGET else "MISSED"
        click.echo(
            f"turn-10 TTFT, 2 workers / 1 worker (median of per-round ratios): {fmt_paired(ratios)}, "
            f"target <= 1.2x: {verdict}"
        )
    finally:
        group.stop_all()
        redis_one.stop()
        redis_two.stop()


if __name__ == "__main__":
    main()
