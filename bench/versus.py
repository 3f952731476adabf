"""This checkout against another commit: throughput and CPU per token, paired per round.

``python -m bench.versus --base <rev>`` (``make bench-versus BASE=<rev>``) checks ``rev`` out in a
temporary git worktree, starts one resq stack from each tree (GPU worker, two post-process
workers, API, each with its own redis-server), side by side, and loads them one at a time:
``clients`` concurrent greedy streams of ``tokens`` tokens, in an order rotated between rounds
(:func:`bench.stats.alternated`), after a full-width warm-up of both. Per run: streamed tokens
per second, tokens per delta, TTFT p50 and B7's CPU per streamed token outside the engine thread
by process (:mod:`bench.cpu_accounting`). With ``--repeats N`` each client makes N requests in a
row per run: with short requests (``--tokens 16``) that measures what a request costs rather than
its tokens, over enough requests for psutil's 10 ms clock. ``--structured`` constrains every
stream by B5's JSON schema (:data:`bench.structured.TEXT`). With ``--probes N``, each round also times N sequential
one-client streams of 4 tokens per tree (B2's probe: the latency of the path itself, with no
batching to hide it); ``--clients 0`` runs only those. With ``--agent-loops N``, each round also runs N
of B6's agent loops per tree over HTTP (:mod:`bench.agent_loop`: 10 turns of a growing history,
``previous_response_id`` and ``prompt_cache_key``, each loop a session of its own), on B6's text
variant of the model (whose every answer streams text): loop time, TTFT of turns 2-10 and of the
last turn, and CPU per turn outside the engine thread by process; with ``--resend`` each turn sends
the whole conversation again with ``store: false`` instead (Codex's shape). Every ratio is the
median of per-round ratios.

Each stack's processes start from their own tree (working directory and ``PYTHONPATH``, see
:class:`bench.procs.ProcGroup`); the working directories of both stacks are printed, so a run
that compared a tree with itself shows it. The bench code (this module, the clients, the
accounting) is this checkout's for both.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path
from statistics import median

import click
import httpx
import redis

from bench import agent_loop, clients, cpu_accounting
from bench import structured as structured_text
from bench.configurations import ROLES, paired_rounds
from bench.models import ensure_bench, ensure_tiny
from bench.procs import ProcGroup
from bench.report import Table, fmt, fmt_paired, to_markdown
from bench.results import ResultSet, RunRecord
from bench.stats import alternated
from bench.systems import HttpSystems, ResqStack
from resq.embedded_redis import EmbeddedRedis

SCENARIO = "versus"
HERE = "this checkout"
METRICS = (
    "tok_s",
    "server_cpu_us_per_token",
    *(f"server_cpu_us_per_token:{role}" for role in ROLES),
    "tokens_per_frame",
    "ttft_p50_ms",
    "max_gap_p50_ms",
)
PROBE_METRICS = ("ttft1_p50_ms", "ttft1_p90_ms")
AGENT_METRICS = (
    "loop_s",
    "turn_ttft_p50_ms",
    "last_ttft_ms",
    "server_cpu_ms_per_turn",
    *(f"server_cpu_ms_per_turn:{role}" for role in ROLES),
)
PROBE_TOKENS = 4
REPO = Path(__file__).resolve().parent.parent


def versus_table(
    results: ResultSet, base: str, model: str, concurrency: int, metrics: tuple[str, ...] = METRICS
) -> Table:
    """Each metric's medians for both trees, and this checkout's per-round ratios to ``base``."""
    rows = [
        [
            metric,
            fmt(results.scalar(SCENARIO, HERE, metric, model, concurrency)),
            fmt(results.scalar(SCENARIO, base, metric, model, concurrency)),
            fmt_paired(results.per_round_ratios(SCENARIO, HERE, base, metric, model, concurrency)),
        ]
        for metric in metrics
    ]
    return Table(
        f"{HERE} vs {base}, {model}, {concurrency} clients (medians of rounds; ratios paired per round)",
        ["metric", HERE, base, f"{HERE} / {base}"],
        rows,
    )


async def _sequential_ttfts(stack: ResqStack, probes: int) -> list[float]:
    async with clients.new_client() as client:
        timings = [
            await clients.resq_stream(client, stack.base_url, stack.model.served_name, PROBE_TOKENS)
            for _ in range(probes)
        ]
    bad = [timing for timing in timings if timing.error is not None or timing.tokens != PROBE_TOKENS]
    if bad:
        raise RuntimeError(f"{len(bad)} of {probes} probes failed or were short: {bad[0]}")
    return sorted(timing.ttft_s * 1000 for timing in timings)


def probe_rounds(systems: dict[str, HttpSystems], model: str, probes: int, rounds: int) -> ResultSet:
    """``rounds`` rounds of ``probes`` sequential one-client streams per system, alternated per round."""
    for system in systems.values():  # warm-up, not measured
        asyncio.run(_sequential_ttfts(system.stack, 5))
    results = ResultSet()
    for round_index in range(rounds):
        for name in alternated(list(systems), round_index):
            ttfts = asyncio.run(_sequential_ttfts(systems[name].stack, probes))
            metrics = {"ttft1_p50_ms": median(ttfts), "ttft1_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))]}
            results.add(RunRecord(SCENARIO, name, model, 1, round_index, metrics))
            click.echo(
                f"round {round_index + 1}: {name}: 1-client TTFT p50 {metrics['ttft1_p50_ms']:.2f} ms, "
                f"p90 {metrics['ttft1_p90_ms']:.2f} ms ({probes} probes)"
            )
    return results


async def _agent_loops(
    stack: ResqStack, loops: int, session: str, shape: agent_loop.LoopShape, resend: bool
) -> list[tuple[list[agent_loop.Turn], float]]:
    timeout = httpx.Timeout(agent_loop.TURN_TIMEOUT_S, connect=60.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        return [
            await agent_loop.http_loop(
                client, stack.base_url, stack.model.served_name, f"{session}-{index}", shape, resend
            )
            for index in range(loops)
        ]


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1000


def agent_rounds(
    systems: dict[str, HttpSystems], model: str, loops: int, rounds: int, resend: bool = False
) -> ResultSet:
    """``rounds`` rounds of ``loops`` agent loops per system (one warm-up loop each first), alternated
    per round; every loop a session of its own, so no loop reuses another's prefix."""
    shape = agent_loop.LoopShape()
    tag = f"versus-{time.time_ns()}"
    for name, system in systems.items():
        asyncio.run(_agent_loops(system.stack, 1, f"{tag}-warm-{name}", shape, resend))
    results = ResultSet()
    for round_index in range(rounds):
        for name in alternated(list(systems), round_index):
            meter = systems[name].meter("resq")
            engine = meter.engine_keys()
            before = cpu_accounting.thread_times(meter.pids)
            session = f"{tag}-{round_index}-{name}"
            runs = asyncio.run(_agent_loops(systems[name].stack, loops, session, shape, resend))
            after = cpu_accounting.thread_times(meter.pids)
            used = cpu_accounting.split(before, after, engine, meter.labels)
            turns = loops * shape.turns
            metrics = {
                "loop_s": median(wall for _, wall in runs),
                "turn_ttft_p50_ms": median(_ms(turn.ttft_s) for loop, _ in runs for turn in loop[1:]),
                "last_ttft_ms": median(_ms(loop[-1].ttft_s) for loop, _ in runs),
                "server_cpu_ms_per_turn": used.server_s * 1000 / turns,
                **{
                    f"server_cpu_ms_per_turn:{label}": seconds * 1000 / turns
                    for label, seconds in used.server_s_by_label.items()
                },
            }
            results.add(RunRecord(SCENARIO, name, model, 1, round_index, metrics))
            click.echo(
                f"round {round_index + 1}: {name}: {loops} agent loops, loop {metrics['loop_s']:.2f} s, "
                f"TTFT turns 2-{shape.turns} p50 {metrics['turn_ttft_p50_ms']:.1f} ms, last "
                f"{metrics['last_ttft_ms']:.1f} ms, {metrics['server_cpu_ms_per_turn']:.2f} ms CPU a turn "
                "outside the engine"
            )
    return results


def _worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="resq-versus-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True)
    return path


@click.command()
@click.option("--base", required=True, help="The commit (or branch, tag) to compare this checkout with.")
@click.option("--model", type=click.Choice(["tiny", "bench"]), default="tiny", show_default=True)
@click.option("--rounds", type=int, default=4, show_default=True)
@click.option(
    "--clients", "concurrency", type=int, default=32, show_default=True, help="0: only the --probes rounds."
)
@click.option("--tokens", type=int, default=256, show_default=True)
@click.option(
    "--repeats",
    type=int,
    default=1,
    show_default=True,
    help="Requests each client makes in a row per run (e.g. 8 with --tokens 16: costs per request).",
)
@click.option(
    "--structured",
    is_flag=True,
    help="Constrain every stream by B5's JSON schema (bench.structured) instead of plain text.",
)
@click.option(
    "--probes",
    type=int,
    default=0,
    show_default=True,
    help="Sequential one-client TTFT probes per tree and round.",
)
@click.option(
    "--agent-loops",
    type=int,
    default=0,
    show_default=True,
    help="B6's 10-turn agent loops (HTTP) per tree and round, on B6's text variant of the model.",
)
@click.option(
    "--resend",
    is_flag=True,
    help="With --agent-loops: each turn resends the whole conversation, unstored (Codex's shape).",
)
@click.option(
    "--redis-server",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The redis-server (or valkey-server) binary both stacks' Redis runs; default the bundled one.",
)
def main(
    base: str,
    model: str,
    rounds: int,
    concurrency: int,
    tokens: int,
    repeats: int,
    structured: bool,
    probes: int,
    agent_loops: int,
    resend: bool,
    redis_server: str | None,
) -> None:
    """This checkout against ``--base``, side by side, paired per round."""
    cache = Path.home() / ".cache" / "resq" / "bench-models"
    served = ensure_bench(cache) if model == "bench" else ensure_tiny(cache)
    if agent_loops:
        served = agent_loop.ensure_text_model(cache, served)
    base_tree = _worktree(base)
    logs = Path(tempfile.mkdtemp(prefix="resq-bench-versus-"))
    groups = {HERE: ProcGroup(logs / "here"), base: ProcGroup(logs / "base", tree=base_tree)}
    servers = {name: EmbeddedRedis(binary=redis_server) for name in groups}
    systems: dict[str, HttpSystems] = {}
    try:
        for name, group in groups.items():
            servers[name].start()
            stack = ResqStack(group, servers[name].url, served)
            stack.start()
            pid = cpu_accounting.redis_server_pid(redis.Redis.from_url(servers[name].url).info("server"))
            systems[name] = HttpSystems(stack, redis_pid=pid)
        for system in systems.values():
            system.stack.wait_ready()
        for name, system in systems.items():
            trees = sorted({os.readlink(f"/proc/{proc.pid}/cwd") for proc in system.stack.procs})
            click.echo(f"{name}: processes started in {', '.join(trees)}")
        kind = "structured (B5's schema)" if structured else "plain"
        click.echo(
            f"model {served.key}; {concurrency} clients x {repeats} x {tokens} tokens, {kind}; logs in {logs}"
        )
        if concurrency:
            text = structured_text.TEXT if structured else None
            results = paired_rounds(systems, SCENARIO, served.key, concurrency, tokens, rounds, repeats, text)
            click.echo("")
            click.echo(to_markdown(versus_table(results, base, served.key, concurrency)))
        if probes:
            probed = probe_rounds(systems, served.key, probes, rounds)
            click.echo("")
            click.echo(to_markdown(versus_table(probed, base, served.key, 1, PROBE_METRICS)))
        if agent_loops:
            looped = agent_rounds(systems, served.key, agent_loops, rounds, resend)
            click.echo("")
            click.echo(to_markdown(versus_table(looped, base, served.key, 1, AGENT_METRICS)))
    finally:
        for group in groups.values():
            group.stop_all()
        for server in servers.values():
            server.stop()
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=False)


if __name__ == "__main__":
    main()
