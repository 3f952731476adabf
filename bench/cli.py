"""``resq bench``: run the scenarios, print the table, write ``docs/benchmarks.md`` and its plot."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table as RichTable

from bench.plan import MODELS, SCENARIOS, Plan
from bench.report import Table, all_tables

QUIET_LOAD = 0.5
QUIET_HOLD_S = 60.0
QUIET_MAX_WAIT_S = 1800.0


def _choice(allowed: tuple[str, ...]) -> click.Choice:  # type: ignore[type-arg]
    return click.Choice(allowed, case_sensitive=False)


def invocation(context: click.Context) -> str:
    """How the run was asked for, as the doc's block names it: ``make bench`` for the default run,
    otherwise the options given on the command line (a block from ``--scenario b1
    --postprocess-workers 0`` must not read as a full default run)."""
    given: list[str] = []
    for param in context.command.params:
        if param.name is None or context.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE:
            continue
        flag, value = param.opts[0], context.params[param.name]
        if isinstance(param, click.Option) and param.is_flag:
            given.append(flag)
        elif isinstance(value, tuple):
            given.extend(f"{flag} {item}" for item in value)
        else:
            given.append(f"{flag} {value}")
    return "resq bench " + " ".join(given) if given else "make bench"


def wait_for_quiet(
    console: Console,
    threshold: float = QUIET_LOAD,
    hold_s: float = QUIET_HOLD_S,
    max_wait_s: float = QUIET_MAX_WAIT_S,
) -> bool:
    """Wait until the 1-minute load average stays under ``threshold`` for ``hold_s``; False on giving up."""
    deadline = time.monotonic() + max_wait_s
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        load = os.getloadavg()[0]
        if load < threshold:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= hold_s:
                return True
        else:
            quiet_since = None
            console.print(f"[dim]waiting for a quiet machine: load {load:.2f} (want < {threshold})[/dim]")
        time.sleep(10)
    return False


def print_table(console: Console, table: Table) -> None:
    """``table`` on the terminal."""
    rich_table = RichTable(title=table.title, title_justify="left")
    for header in table.headers:
        rich_table.add_column(
            header, justify="right" if header not in ("model", "system", "target", "load") else "left"
        )
    for row in table.rows:
        rich_table.add_row(*row)
    console.print(rich_table)


@click.command(name="bench")
@click.option(
    "--quick", is_flag=True, help="A smaller run (2 rounds, 64 tokens, 300 held streams): a few minutes."
)
@click.option("--rounds", type=int, help="A/B rounds per case (default 3; 2 with --quick).")
@click.option(
    "--model",
    "models",
    multiple=True,
    type=_choice(MODELS),
    help="Models for B1/B2 (default: tiny and bench; repeat the option for several).",
)
@click.option(
    "--scenario",
    "scenarios",
    multiple=True,
    type=_choice(SCENARIOS),
    help="Scenarios to run (default: all; repeat the option for several: --scenario b1 --scenario b2).",
)
@click.option("--no-serve", is_flag=True, help="Leave out the `transformers serve` baseline.")
@click.option(
    "--postprocess-workers",
    type=click.IntRange(min=0),
    default=Plan.postprocess_workers,
    show_default=True,
    help="resq's post-process workers in B1, B2 and B4 (0: post-processing inline in the API, "
    "the single-host shape); the issue's targets are judged on the default.",
)
@click.option(
    "--redis-url", help="Use this Redis database (FLUSHED) instead of starting a private redis-server."
)
@click.option(
    "--redis-server",
    type=click.Path(exists=True, dir_okay=False),
    help="Run the private Redis from this redis-server (or valkey-server) binary instead of the "
    "bundled one (e.g. the Redis version a deployment runs).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=Path("docs"),
    show_default=True,
    help="Where benchmarks.md and benchmarks.png go.",
)
@click.option(
    "--run-dir", type=click.Path(path_type=Path), help="Logs and raw results (default: .bench/<time>)."
)
@click.option(
    "--wait-quiet",
    is_flag=True,
    help="First wait until the load average stays under 0.5 for a minute (at most --wait-max minutes).",
)
@click.option(
    "--wait-max",
    type=float,
    default=QUIET_MAX_WAIT_S / 60,
    show_default=True,
    help="Minutes --wait-quiet waits at most.",
)
@click.option("--no-doc", is_flag=True, help="Print the tables only; leave docs/ alone.")
def bench_command(
    quick: bool,
    rounds: int | None,
    models: tuple[str, ...],
    scenarios: tuple[str, ...],
    no_serve: bool,
    postprocess_workers: int,
    redis_url: str | None,
    redis_server: str | None,
    out_dir: Path,
    run_dir: Path | None,
    wait_quiet: bool,
    wait_max: float,
    no_doc: bool,
) -> None:
    """Benchmark resq against the direct engine, `transformers serve` and the relay floor (scenarios B1-B4), and structured outputs against plain streaming (B5)."""
    from bench.runner import BenchRun

    if redis_url and redis_server:
        raise click.UsageError("--redis-url and --redis-server exclude each other")

    console = Console()
    plan = Plan().quick if quick else Plan()
    plan = replace(
        plan,
        rounds=rounds or plan.rounds,
        models=tuple(m.lower() for m in models) or plan.models,
        scenarios=tuple(s.upper() for s in scenarios) or plan.scenarios,
        with_serve=not no_serve,
        postprocess_workers=postprocess_workers,
    )
    quiet = None
    if wait_quiet:
        quiet = wait_for_quiet(console, max_wait_s=wait_max * 60)
        if not quiet:
            console.print("[yellow]the machine never got quiet; measuring anyway (the doc says so)[/yellow]")
    run_dir = run_dir or Path(".bench") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"resq bench: {plan.runs()} measured runs; logs and raw results in {run_dir}")
    started = time.monotonic()
    results = BenchRun(plan, run_dir, console, redis_url, redis_server).run()
    results.context["duration_s"] = round(time.monotonic() - started)
    results.context["waited_for_quiet"] = quiet
    results.context["command"] = invocation(click.get_current_context())
    results.save(run_dir / "results.json")
    for table in all_tables(results):
        print_table(console, table)
    if not no_doc:
        from bench.document import write_document

        written = write_document(results, out_dir)
        console.print(f"wrote {', '.join(str(path) for path in written)}")
