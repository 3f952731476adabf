"""This checkout against another commit: throughput and CPU per token, paired per round.

``python -m bench.versus --base <rev>`` (``make bench-versus BASE=<rev>``) checks ``rev`` out in a
temporary git worktree, starts one resq stack from each tree (GPU worker, two post-process
workers, API, each with its own redis-server), side by side, and loads them one at a time:
``clients`` concurrent greedy streams of ``tokens`` tokens, in an order rotated between rounds
(:func:`bench.stats.alternated`), after a full-width warm-up of both. Per run: streamed tokens
per second, tokens per delta, TTFT p50 and B7's CPU per streamed token outside the engine thread
by process (:mod:`bench.cpu_accounting`). Every ratio is the median of per-round ratios.

Each stack's processes start from their own tree (working directory and ``PYTHONPATH``, see
:class:`bench.procs.ProcGroup`); the working directories of both stacks are printed, so a run
that compared a tree with itself shows it. The bench code (this module, the clients, the
accounting) is this checkout's for both.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import click
import redis

from bench import cpu_accounting
from bench.models import ensure_bench, ensure_tiny
from bench.procs import ProcGroup
from bench.report import Table, fmt, fmt_paired, to_markdown
from bench.results import ResultSet
from bench.stream_interval import ROLES, paired_rounds
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
)
REPO = Path(__file__).resolve().parent.parent


def versus_table(results: ResultSet, base: str, model: str, concurrency: int) -> Table:
    """Each metric's medians for both trees, and this checkout's per-round ratios to ``base``."""
    rows = [
        [
            metric,
            fmt(results.scalar(SCENARIO, HERE, metric, model, concurrency)),
            fmt(results.scalar(SCENARIO, base, metric, model, concurrency)),
            fmt_paired(results.per_round_ratios(SCENARIO, HERE, base, metric, model, concurrency)),
        ]
        for metric in METRICS
    ]
    return Table(
        f"{HERE} vs {base}, {model}, {concurrency} clients (medians of rounds; ratios paired per round)",
        ["metric", HERE, base, f"{HERE} / {base}"],
        rows,
    )


def _worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="resq-versus-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True)
    return path


@click.command()
@click.option("--base", required=True, help="The commit (or branch, tag) to compare this checkout with.")
@click.option("--model", type=click.Choice(["tiny", "bench"]), default="tiny", show_default=True)
@click.option("--rounds", type=int, default=4, show_default=True)
@click.option("--clients", "concurrency", type=int, default=32, show_default=True)
@click.option("--tokens", type=int, default=256, show_default=True)
def main(base: str, model: str, rounds: int, concurrency: int, tokens: int) -> None:
    """This checkout against ``--base``, side by side, paired per round."""
    cache = Path.home() / ".cache" / "resq" / "bench-models"
    served = ensure_bench(cache) if model == "bench" else ensure_tiny(cache)
    base_tree = _worktree(base)
    logs = Path(tempfile.mkdtemp(prefix="resq-bench-versus-"))
    groups = {HERE: ProcGroup(logs / "here"), base: ProcGroup(logs / "base", tree=base_tree)}
    servers = {name: EmbeddedRedis() for name in groups}
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
        click.echo(f"model {served.key}; {concurrency} clients x {tokens} tokens; logs in {logs}")
        results = paired_rounds(systems, SCENARIO, served.key, concurrency, tokens, rounds)
        click.echo("")
        click.echo(to_markdown(versus_table(results, base, served.key, concurrency)))
    finally:
        for group in groups.values():
            group.stop_all()
        for server in servers.values():
            server.stop()
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=False)


if __name__ == "__main__":
    main()
