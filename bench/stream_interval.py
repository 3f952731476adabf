"""The stream interval (``RESQ_STREAM_INTERVAL_MS``) A/B: throughput and CPU per token, paired per round.

One resq stack per interval (each with its own GPU worker, two post-process workers, an API and a
private redis-server), measured as :mod:`bench.configurations` measures configurations: ``clients``
concurrent greedy streams of ``tokens`` tokens each, rounds in rotated order after a full-width
warm-up; tok/s, tokens per delta frame, TTFT p50 and B7's CPU per streamed token outside the
engine thread. Ratios are medians of per-round ratios against the first interval given.

``python -m bench.stream_interval`` (``make bench-interval``) runs it and prints the tables.
"""

from __future__ import annotations

import click

from bench.configurations import configuration_table, load_options, measure_configurations
from bench.report import Table, to_markdown
from bench.results import ResultSet

SCENARIO = "interval"


def system_name(interval_ms: int) -> str:
    """How a run at ``interval_ms`` is named in the results and tables."""
    return f"{interval_ms} ms"


def interval_table(results: ResultSet, intervals: list[int], model: str, concurrency: int) -> Table:
    """Every interval's medians, and its per-round ratios against the first interval."""
    names = [system_name(interval) for interval in intervals]
    return configuration_table(results, SCENARIO, names, model, concurrency, "Stream interval", "interval")


@click.command()
@click.option(
    "--intervals", default="0,50", show_default=True, help="RESQ_STREAM_INTERVAL_MS values, comma-separated."
)
@load_options(rounds=3)
def main(intervals: str, model: str, rounds: int, concurrency: int, tokens: int) -> None:
    """Throughput and CPU per token of resq at several stream intervals, paired per round."""
    wanted = [int(value) for value in intervals.split(",")]
    configurations = {
        system_name(interval): {"gpu_worker_env": {"RESQ_STREAM_INTERVAL_MS": str(interval)}}
        for interval in wanted
    }
    results, key = measure_configurations(configurations, SCENARIO, model, rounds, concurrency, tokens)
    click.echo("")
    click.echo(to_markdown(interval_table(results, wanted, key, concurrency)))


if __name__ == "__main__":
    main()
