"""Resq stacks that differ in one setting, measured side by side: throughput and CPU per token.

The machinery of the configuration A/Bs (:mod:`bench.stream_interval`, :mod:`bench.placement`)
and of :mod:`bench.versus`: one resq stack per configuration, each on a Redis of its own, loaded
one at a time with ``clients`` concurrent greedy streams of ``tokens`` tokens, in an order rotated
between rounds (:func:`bench.stats.alternated`) after a full-width warm-up of every stack. Per run:
streamed tokens per second, tokens per delta frame, TTFT p50, and B7's CPU per streamed token
outside the engine thread (:mod:`bench.cpu_accounting`, every process of the stack and its Redis).
Ratios are medians of per-round ratios against the first configuration.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import redis

from bench import clients, cpu_accounting
from bench.models import ensure_bench, ensure_tiny
from bench.procs import ProcGroup
from bench.report import Table, fmt, fmt_paired, to_markdown
from bench.results import ResultSet, RunRecord
from bench.stats import alternated, median
from bench.systems import HttpSystems, ResqStack
from resq.embedded_redis import EmbeddedRedis

ROLES = ("gpu-worker", "postprocess", "api", "redis")

F = TypeVar("F", bound=Callable[..., Any])


REDIS_OPTIONS = frozenset({"redis_unix_socket", "redis_server"})
"""A configuration's keys that choose its Redis rather than its stack."""


def load_options(rounds: int) -> Callable[[F], F]:
    """The command-line options every configuration A/B takes (``rounds`` by default)."""

    def decorate(command: F) -> F:
        for option in reversed(
            [
                click.option(
                    "--model", type=click.Choice(["tiny", "bench"]), default="tiny", show_default=True
                ),
                click.option("--rounds", type=int, default=rounds, show_default=True),
                click.option("--clients", "concurrency", type=int, default=32, show_default=True),
                click.option("--tokens", type=int, default=256, show_default=True),
            ]
        ):
            command = option(command)
        return command

    return decorate


async def load(
    stack: ResqStack,
    concurrency: int,
    tokens: int,
    repeats: int = 1,
    text: dict[str, object] | None = None,
) -> tuple[list[clients.StreamTiming], float]:
    """``concurrency`` clients at once against ``stack``, each making ``repeats`` greedy streams of
    ``tokens`` tokens in a row (``text``: e.g. a ``text.format`` to constrain them); timings and
    wall time."""
    async with clients.new_client() as client:
        return await clients.concurrently(
            concurrency,
            lambda: clients.resq_stream(client, stack.base_url, stack.model.served_name, tokens, text),
            repeats,
        )


def measure_once(
    system: HttpSystems,
    concurrency: int,
    tokens: int,
    repeats: int = 1,
    text: dict[str, object] | None = None,
) -> dict[str, float]:
    """One loaded run of ``system``'s stack: its metrics (raises when a stream failed or was short)."""
    meter = system.meter("resq")
    engine = meter.engine_keys()
    before = cpu_accounting.thread_times(meter.pids)
    timings, wall = asyncio.run(load(system.stack, concurrency, tokens, repeats, text))
    after = cpu_accounting.thread_times(meter.pids)
    bad = [timing for timing in timings if timing.error is not None or timing.tokens != tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(timings)} streams failed or were short: {bad[0]}")
    streamed = sum(timing.tokens for timing in timings)
    return {
        "tok_s": streamed / wall,
        "tokens_per_frame": streamed / max(1, sum(timing.frames for timing in timings)),
        "ttft_p50_ms": median([timing.ttft_s * 1000 for timing in timings]),
        # Every stream's longest wait between deltas: a pause of the whole server shows in most.
        "max_gap_p50_ms": median([timing.max_gap_s * 1000 for timing in timings]),
        **cpu_accounting.split(before, after, engine, meter.labels).per_token(streamed),
    }


def paired_rounds(
    systems: dict[str, HttpSystems],
    scenario: str,
    model: str,
    concurrency: int,
    tokens: int,
    rounds: int,
    repeats: int = 1,
    text: dict[str, object] | None = None,
) -> ResultSet:
    """Warm every system up at full width, then measure ``rounds`` rounds of all of them, back to
    back in an order rotated per round (:func:`bench.stats.alternated`); each run is printed.

    ``repeats``: requests each client makes in a row per run (more requests per run, for costs
    per request that psutil's 10 ms clock would blur over one request per client)."""
    for system in systems.values():
        asyncio.run(load(system.stack, concurrency, tokens))
    results = ResultSet()
    for round_index in range(rounds):
        for name in alternated(list(systems), round_index):
            metrics = measure_once(systems[name], concurrency, tokens, repeats, text)
            results.add(RunRecord(scenario, name, model, concurrency, round_index, metrics))
            click.echo(
                f"round {round_index + 1}: {name}: {metrics['tok_s']:7.1f} tok/s, "
                f"{metrics['server_cpu_us_per_token']:6.1f} us/token outside the engine, "
                f"{metrics['tokens_per_frame']:.1f} tokens per delta"
            )
    return results


def configuration_table(
    results: ResultSet, scenario: str, names: list[str], model: str, concurrency: int, title: str, label: str
) -> Table:
    """Every configuration's medians, and its per-round ratios against the first of ``names``."""
    base = names[0]
    rows = []
    for name in names:

        def value(metric: str, name: str = name) -> float | None:
            return results.scalar(scenario, name, metric, model, concurrency)

        paired = [
            fmt_paired(results.per_round_ratios(scenario, name, base, metric, model, concurrency))
            if name != base
            else "-"
            for metric in ("tok_s", "server_cpu_us_per_token")
        ]
        rows.append(
            [
                name,
                fmt(value("tok_s")),
                fmt(value("tokens_per_frame")),
                fmt(value("ttft_p50_ms")),
                fmt(value("server_cpu_us_per_token")),
                *[fmt(value(f"server_cpu_us_per_token:{role}")) for role in ROLES],
                fmt(value("engine_cpu_us_per_token")),
                *paired,
            ]
        )
    return Table(
        f"{title}, {model}, {concurrency} clients (medians of rounds; ratios paired per round against {base})",
        [
            label,
            "tok/s",
            "tokens / delta",
            "TTFT p50 ms",
            "CPU us/token outside the engine",
            *ROLES,
            "engine thread",
            f"tok/s vs {base}",
            f"CPU/token vs {base}",
        ],
        rows,
    )


def measure_configurations(
    configurations: dict[str, dict[str, Any]],
    scenario: str,
    model: str,
    rounds: int,
    concurrency: int,
    tokens: int,
) -> tuple[ResultSet, str]:
    """Start one resq stack per configuration (``ResqStack`` keyword arguments, by name), each on a
    Redis of its own, and measure them paired per round (:func:`paired_rounds`); the results and
    the model's key. A configuration's ``redis_unix_socket: True`` (not a ``ResqStack`` argument)
    puts its stack on its Redis's Unix socket instead of loopback TCP, and its ``redis_server``
    (a path, not a ``ResqStack`` argument either) runs that binary as its Redis."""
    cache = Path.home() / ".cache" / "resq" / "bench-models"
    served = ensure_bench(cache) if model == "bench" else ensure_tiny(cache)
    group = ProcGroup(Path(tempfile.mkdtemp(prefix=f"resq-bench-{scenario}-")))
    servers = {
        name: EmbeddedRedis(
            unix_socket=bool(options.get("redis_unix_socket")), binary=options.get("redis_server")
        )
        for name, options in configurations.items()
    }
    systems: dict[str, HttpSystems] = {}
    try:
        for name, options in configurations.items():
            server = servers[name]
            server.start()
            stack_options = {key: value for key, value in options.items() if key not in REDIS_OPTIONS}
            stack = ResqStack(group, server.url, served, **stack_options)
            stack.start()
            pid = cpu_accounting.redis_server_pid(redis.Redis.from_url(server.url).info("server"))
            systems[name] = HttpSystems(stack, redis_pid=pid)
        for system in systems.values():
            system.stack.wait_ready()
        click.echo(f"model {served.key}; {concurrency} clients x {tokens} tokens; logs in {group.log_dir}")
        return paired_rounds(systems, scenario, served.key, concurrency, tokens, rounds), served.key
    finally:
        group.stop_all()
        for server in servers.values():
            server.stop()


def print_configuration_ab(
    configurations: dict[str, dict[str, Any]],
    scenario: str,
    options: tuple[str, int, int, int],
    title: str,
    label: str,
) -> None:
    """Measure ``configurations`` paired per round and print their table (the first is the base).

    ``options`` are :func:`load_options`' values: model, rounds, clients and tokens.
    """
    model, rounds, concurrency, tokens = options
    results, key = measure_configurations(configurations, scenario, model, rounds, concurrency, tokens)
    click.echo("")
    click.echo(
        to_markdown(
            configuration_table(results, scenario, list(configurations), key, concurrency, title, label)
        )
    )
