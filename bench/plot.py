"""The figure of ``docs/benchmarks.png``: one panel per scenario."""

from __future__ import annotations

from pathlib import Path

from bench.report import ttft_ms
from bench.results import ResultSet

COLOURS = {
    "resq": "#1f77b4",
    "direct": "#7f7f7f",
    "serve": "#ff7f0e",
    "floor": "#2ca02c",
    "builder": "#7f7f7f",
}


def write_plot(results: ResultSet, path: Path) -> Path:
    """Draw B1-B4 into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    _b1(results, axes[0][0])
    _b2(results, axes[0][1])
    _b3(results, axes[1][0])
    _b4(results, axes[1][1])
    context = results.context
    figure.suptitle(
        f"resq bench ({context.get('cpu', '?')}, {context.get('cores', '?')} cores, commit {context.get('commit', '?')})",
        fontsize=11,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _bars(
    axis: object, groups: list[str], series: dict[str, list[float | None]], label_format: str = "{:.0f}"
) -> None:
    width = 0.8 / max(1, len(series))
    for index, (name, values) in enumerate(series.items()):
        positions = [group + (index - (len(series) - 1) / 2) * width for group in range(len(groups))]
        heights = [value or 0.0 for value in values]
        bars = axis.bar(positions, heights, width, label=name, color=COLOURS.get(name.split()[0]))  # type: ignore[attr-defined]
        for bar, value in zip(bars, values, strict=True):
            if value is not None:
                axis.annotate(  # type: ignore[attr-defined]
                    label_format.format(value),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    axis.set_xticks(range(len(groups)), groups)  # type: ignore[attr-defined]
    axis.legend(fontsize=8)  # type: ignore[attr-defined]


def _b1(results: ResultSet, axis: object) -> None:
    groups: list[str] = []
    series: dict[str, list[float | None]] = {"resq": [], "direct": [], "serve": []}
    for model in ("tiny", "bench"):
        for clients in sorted(
            {r.concurrency for r in results.records if r.scenario == "B1" and r.model == model}
        ):
            groups.append(f"{model}\nx{clients}")
            for system in series:
                series[system].append(results.scalar("B1", system, "tok_s", model, clients))
    _bars(axis, groups, series)
    axis.set_title("B1 throughput: output tokens/s (higher is better)")  # type: ignore[attr-defined]


def _b2(results: ResultSet, axis: object) -> None:
    groups: list[str] = []
    series: dict[str, list[float | None]] = {"resq": [], "direct": [], "serve": []}
    for model in ("tiny", "bench"):
        if not any(r.model == model and r.scenario in ("B1", "B2") for r in results.records):
            continue
        for clients in (1, 32):
            groups.append(f"{model}\nx{clients}")
            for system in series:
                series[system].append(ttft_ms(results, system, model, clients, 50))
    _bars(axis, groups, series, "{:.1f}")
    axis.set_yscale("log")  # type: ignore[attr-defined]
    axis.set_title("B2 time to first token, p50 (ms, log scale; lower is better)")  # type: ignore[attr-defined]


def _b3(results: ResultSet, axis: object) -> None:
    labels = {"builder": "builder alone", "pp1": "1 worker", "pp2": "2 workers"}
    groups = list(labels.values())
    values = [results.scalar("B3", system, "events_s", "tiny") for system in labels]
    _bars(axis, groups, {"resq": values})
    axis.set_title("B3 post-processing: events/s (higher is better)")  # type: ignore[attr-defined]


def _b4(results: ResultSet, axis: object) -> None:
    concurrencies = sorted({r.concurrency for r in results.records if r.scenario == "B4"})
    groups = [f"x{clients}" for clients in concurrencies]
    series: dict[str, list[float | None]] = {
        "resq API": [results.scalar("B4", "resq", "cpu_us_per_token", "tiny", c) for c in concurrencies],
        "floor": [results.scalar("B4", "floor", "cpu_us_per_token", "tiny", c) for c in concurrencies],
    }
    _bars(axis, groups, series)
    axis.axhline(10, color="red", linestyle="--", linewidth=1)  # type: ignore[attr-defined]
    axis.set_title("B4 API CPU per streamed token (us; target <= 10, dashed)")  # type: ignore[attr-defined]
