"""Where post-processing runs: post-process workers against inline in the API, paired per round.

One resq stack per placement (``RESQ_POSTPROCESS_WORKERS``: ``0`` post-processes on the API's
thread pool, ``n`` starts ``n`` post-process workers), each with its own GPU worker, API and
private redis-server, measured as :mod:`bench.configurations` measures configurations: ``clients``
concurrent greedy streams of ``tokens`` tokens, rounds in rotated order after a full-width
warm-up; tok/s, tokens per delta, TTFT p50 and B7's CPU per streamed token outside the engine
thread, by process. Ratios are medians of per-round ratios against the first placement given.

What it answers: how much of the queue's CPU per token the post-process hop costs on one host,
against what separate workers buy (post-processing scaled out and isolated from the API).
``python -m bench.placement`` (``make bench-placement``) runs it and prints the table.
"""

from __future__ import annotations

import click

from bench.configurations import configuration_table, load_options, measure_configurations
from bench.report import Table, to_markdown
from bench.results import ResultSet

SCENARIO = "placement"


def system_name(workers: int) -> str:
    """How a run with ``workers`` post-process workers (0: inline) is named in the results and tables."""
    if workers == 0:
        return "inline"
    return f"{workers} post-process worker" + ("s" if workers > 1 else "")


def placement_table(results: ResultSet, placements: list[int], model: str, concurrency: int) -> Table:
    """Every placement's medians, and its per-round ratios against the first placement."""
    names = [system_name(workers) for workers in placements]
    return configuration_table(
        results, SCENARIO, names, model, concurrency, "Post-processing placement", "post-processing"
    )


@click.command()
@click.option(
    "--workers",
    default="2,0",
    show_default=True,
    help="RESQ_POSTPROCESS_WORKERS values, comma-separated (0: inline in the API).",
)
@load_options(rounds=4)
def main(workers: str, model: str, rounds: int, concurrency: int, tokens: int) -> None:
    """Throughput and CPU per token of resq with its post-processing placed in several ways, paired per round."""
    placements = [int(value) for value in workers.split(",")]
    configurations = {system_name(count): {"postprocess_workers": count} for count in placements}
    results, key = measure_configurations(configurations, SCENARIO, model, rounds, concurrency, tokens)
    click.echo("")
    click.echo(to_markdown(placement_table(results, placements, key, concurrency)))


if __name__ == "__main__":
    main()
