"""Tables and target verdicts from a :class:`~bench.results.ResultSet` (pure: no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from bench.results import ResultSet
from bench.stats import median

HELD_STREAMS_TARGET = 4000
"""B4: streams one API process must hold open at once (issue 16 raised it from 1,000)."""


@dataclass(frozen=True)
class Table:
    """A titled table of already formatted cells."""

    title: str
    headers: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Target:
    """One target of the issue and what was measured against it."""

    name: str
    measured: float | None
    bound: float
    direction: Literal["min", "max"]
    unit: str = ""

    @property
    def met(self) -> bool | None:
        """Whether the measurement meets the bound (None when not measured)."""
        if self.measured is None:
            return None
        return self.measured >= self.bound if self.direction == "min" else self.measured <= self.bound

    @property
    def margin(self) -> float | None:
        """How far past the bound, as a fraction of it: positive when met, negative when missed."""
        if self.measured is None or self.bound == 0:
            return None
        if self.direction == "min":
            return (self.measured - self.bound) / self.bound
        return (self.bound - self.measured) / self.bound

    def verdict(self) -> str:
        """``met (+12%)``, ``MISSED (-30%)`` or ``not measured``."""
        if self.met is None or self.margin is None:
            return "not measured"
        word = "met" if self.met else "MISSED"
        percent = self.margin * 100
        # A miss by a fraction of a percent must not read "-0%".
        return f"{word} ({percent:+.1f}%)" if abs(percent) < 1 else f"{word} ({percent:+.0f}%)"


def fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    """A number for a table cell; ``-`` when missing."""
    if value is None:
        return "-"
    if abs(value) >= 1000 and digits <= 1:
        return f"{value:,.0f}{unit}"
    return f"{value:.{digits}f}{unit}"


def fmt_ratio(value: float | None) -> str:
    """A ratio as ``0.93x``."""
    return "-" if value is None else f"{value:.2f}x"


def fmt_paired(ratios: Sequence[float]) -> str:
    """Per-round ratios as ``1.14, 1.17, 1.45 -> 1.17x``: each round's, then their median."""
    if not ratios:
        return "-"
    return f"{', '.join(f'{value:.2f}' for value in ratios)} -> {median(ratios):.2f}x"


def to_markdown(table: Table) -> str:
    """The table as GitHub markdown, with its title as a bold line above."""
    lines = [f"**{table.title}**", "", "| " + " | ".join(table.headers) + " |"]
    lines.append("|" + "|".join("---" for _ in table.headers) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    return "\n".join(lines)


def _models(results: ResultSet, scenario: str) -> list[str]:
    order = {"tiny": 0, "bench": 1}
    found = {record.model for record in results.records if record.scenario == scenario}
    return sorted(found, key=lambda model: order.get(model, 9))


def _concurrencies(results: ResultSet, scenario: str, model: str = "") -> list[int]:
    return sorted(
        {
            record.concurrency
            for record in results.records
            if record.scenario == scenario and record.model == model
        }
    )


B1_THROUGHPUT_SYSTEMS = (
    ("resq", "resq"),
    ("direct", "direct (resq's engine)"),
    ("upstream", "upstream transformers"),
    ("serve", "serve (resq's sizes)"),
    ("serve-defaults", "serve (its defaults)"),
)
"""B1's systems and their column names."""
B1_RATIOS = (
    ("resq", "direct"),
    ("resq", "upstream"),
    ("direct", "upstream"),
    ("resq", "serve"),
    ("resq", "serve-defaults"),
)
"""B1's paired ratios: the queue's cost (resq / each engine alone), resq's engine changes
(direct / upstream) and resq against ``transformers serve`` at both settings."""


def b1_table(results: ResultSet) -> Table:
    """B1: end-to-end output tokens/s of resq and every baseline (medians of rounds)."""
    rows = []
    for model in _models(results, "B1"):
        for clients in _concurrencies(results, "B1", model):
            rows.append(
                [model, str(clients)]
                + [
                    fmt(results.scalar("B1", system, "tok_s", model, clients))
                    for system, _ in B1_THROUGHPUT_SYSTEMS
                ]
            )
    headers = ["model", "clients"] + [f"{label} tok/s" for _, label in B1_THROUGHPUT_SYSTEMS]
    return Table("B1 throughput (output tokens/s, median of rounds)", headers, rows)


def b1_ratio_table(results: ResultSet) -> Table:
    """B1's ratios, each the median of per-round ratios, printed with the rounds' own."""
    rows = []
    for model in _models(results, "B1"):
        for clients in _concurrencies(results, "B1", model):
            rows.append(
                [model, str(clients)]
                + [
                    fmt_paired(results.per_round_ratios("B1", a, b, "tok_s", model, clients))
                    for a, b in B1_RATIOS
                ]
            )
    headers = ["model", "clients"] + [f"{a} / {b}" for a, b in B1_RATIOS]
    return Table("B1 ratios (tokens/s, per round -> median)", headers, rows)


B7_SYSTEMS = ("resq", "serve", "serve-defaults")


def b7_table(results: ResultSet) -> Table:
    """B7: CPU per streamed token outside the engine thread, resq against ``transformers serve``."""
    rows = []
    for model in _models(results, "B1"):
        for clients in _concurrencies(results, "B1", model):
            server, engine = (
                [results.scalar("B1", system, metric, model, clients) for system in B7_SYSTEMS]
                for metric in ("server_cpu_us_per_token", "engine_cpu_us_per_token")
            )
            if all(value is None for value in server):
                continue
            rows.append(
                [model, str(clients)]
                + [fmt(value) for value in server]
                + [fmt(value) for value in engine]
                + [
                    fmt_paired(
                        results.per_round_ratios(
                            "B1", "resq", peer, "server_cpu_us_per_token", model, clients
                        )
                    )
                    for peer in ("serve", "serve-defaults")
                ]
                + [fmt(results.scalar("B1", "resq", "tokens_per_frame", model, clients))]
            )
    headers = [
        "model", "clients",
        "resq us/token", "serve", "serve (defaults)",
        "engine thread: resq", "serve", "serve (defaults)",
        "resq / serve", "resq / serve (defaults)",
        "resq tokens / delta",
    ]  # fmt: skip
    return Table(
        "B7 CPU per streamed token outside the engine thread (us, median of rounds; every resq process and Redis)",
        headers,
        rows,
    )


B7_RESQ_ROLES = ("api", "postprocess", "gpu-worker", "redis")


def b7_breakdown_table(results: ResultSet) -> Table:
    """B7's resq figure by process role (the GPU worker's without its engine thread)."""
    rows = []
    for model in _models(results, "B1"):
        for clients in _concurrencies(results, "B1", model):
            cells = [
                results.scalar("B1", "resq", f"server_cpu_us_per_token:{role}", model, clients)
                for role in B7_RESQ_ROLES
            ]
            if any(value is not None for value in cells):
                rows.append([model, str(clients), *(fmt(value) for value in cells)])
    headers = ["model", "clients", "API", "post-process workers", "GPU worker (not the engine)", "Redis"]
    return Table("B7 resq by process (us per streamed token, median of rounds)", headers, rows)


def ttft_ms(results: ResultSet, system: str, model: str, clients: int, q: float) -> float | None:
    """TTFT percentile: from the single-client probes (B2) at 1 client, from B1's streams otherwise."""
    if clients == 1:
        probed = results.pooled("B2", system, "ttft_ms", q, model, 1)
        if probed is not None:
            return probed
    return results.pooled("B1", system, "ttft_ms", q, model, clients)


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def b2_table(results: ResultSet) -> Table:
    """B2: TTFT and inter-token latency, resq minus the direct engine."""
    rows = []
    for model in _models(results, "B1") or _models(results, "B2"):
        for clients in (1, 32):
            if clients not in _concurrencies(results, "B1", model) and clients != 1:
                continue
            cells = [model, str(clients)]
            for q in (50, 99):
                resq = ttft_ms(results, "resq", model, clients, q)
                direct = ttft_ms(results, "direct", model, clients, q)
                cells += [fmt(resq), fmt(direct), fmt(_difference(resq, direct))]
            resq_itl = results.pooled("B1", "resq", "itl_ms", 50, model, clients)
            direct_itl = results.pooled("B1", "direct", "itl_ms", 50, model, clients)
            cells += [fmt(resq_itl, 2), fmt(direct_itl, 2), fmt(_difference(resq_itl, direct_itl), 2)]
            cells.append(fmt(ttft_ms(results, "serve", model, clients, 50)))
            # The first frame of a bare SSE relay (no work): the HTTP round trip any Python server
            # pays; what resq adds beyond it and the engine is the queue's own part of the overhead.
            floor = results.pooled("B2", "floor", "ttft_ms", 50, model, 1) if clients == 1 else None
            resq_p50 = ttft_ms(results, "resq", model, clients, 50)
            direct_p50 = ttft_ms(results, "direct", model, clients, 50)
            cells += [fmt(floor), fmt(_difference(_difference(resq_p50, direct_p50), floor))]
            rows.append(cells)
    headers = [
        "model", "clients",
        "TTFT p50 resq", "direct", "overhead",
        "TTFT p99 resq", "direct", "overhead",
        "ITL p50 resq", "direct", "overhead",
        "TTFT p50 serve",
        "HTTP floor p50", "p50 overhead above the floor",
    ]  # fmt: skip
    return Table("B2 latency (ms; TTFT at 1 client from sequential probes)", headers, rows)


def b3_table(results: ResultSet) -> Table:
    """B3: events/s of one and two post-process workers and of the builder alone."""
    rows = []
    if not results.matching("B3", "pp1", "tiny"):
        return Table("B3 post-processing", [], [])
    for system, label in (
        ("builder", "event builder alone (in-process loop)"),
        ("pp1", "1 post-process worker"),
        ("pp2", "2 post-process workers"),
    ):
        value = results.scalar("B3", system, "events_s", "tiny")
        rows.append(
            [
                label,
                fmt(value),
                fmt_paired(results.per_round_ratios("B3", system, "pp1", "events_s", "tiny")),
                fmt_paired(results.per_round_ratios("B3", system, "builder", "events_s", "tiny")),
            ]
        )
    return Table(
        "B3 post-processing (events/s, median of rounds; ratios paired per round)",
        ["system", "events/s", "vs 1 worker", "vs builder"],
        rows,
    )


def b4_table(results: ResultSet) -> Table:
    """B4: API CPU per streamed token against the floor, and the streams one API process holds."""
    rows = []
    for clients in _concurrencies(results, "B4", "tiny"):
        resq = results.scalar("B4", "resq", "cpu_us_per_token", "tiny", clients)
        floor = results.scalar("B4", "floor", "cpu_us_per_token", "tiny", clients)
        rows.append(
            [
                f"{clients} clients",
                fmt(resq),
                fmt(floor),
                fmt_paired(
                    results.per_round_ratios("B4", "resq", "floor", "cpu_us_per_token", "tiny", clients)
                ),
                fmt(results.scalar("B4", "resq", "tokens_per_frame", "tiny", clients)),
                fmt_paired(
                    results.per_round_ratios("B4", "resq", "floor", "cpu_us_per_frame", "tiny", clients)
                ),
            ]
        )
    for record in results.matching("B4cap", "resq", "tiny"):
        metrics = record.metrics
        rows.append(
            [
                f"{record.concurrency} idle streams held",
                f"{metrics['held']:.0f} held",
                f"RSS {metrics['rss_idle_mb']:.0f} -> {metrics['rss_held_mb']:.0f} MB",
                f"{metrics['kb_per_stream']:.0f} KB/stream",
                "",
                "",
            ]
        )
    return Table(
        "B4 API cost (API process CPU us per streamed token, median of rounds)",
        ["load", "resq API", "floor", "resq / floor", "resq tokens / frame", "resq / floor per frame"],
        rows,
    )


def b5_ratios(results: ResultSet, model: str) -> list[float]:
    """B5's structured / plain throughput of each round on ``model`` (both kinds ran back to back)."""
    return results.per_round_ratios("B5", "structured", "plain", "tok_s", model)


def b5_ratio(results: ResultSet, model: str) -> float | None:
    """The median of B5's per-round ratios on ``model``."""
    ratios = b5_ratios(results, model)
    return median(ratios) if ratios else None


def b5_table(results: ResultSet) -> Table:
    """B5: structured (json_schema) vs plain streaming, paired per round, and the mask cost."""
    rows = []
    for model in _models(results, "B5"):
        clients = _concurrencies(results, "B5", model)[0]
        ratios = b5_ratios(results, model)
        mask = results.matching("B5mask", "structured", model)
        cells = [
            model,
            str(clients),
            ", ".join(f"{value:.2f}" for value in ratios),
            fmt_ratio(b5_ratio(results, model)),
        ]
        for q in (50, 99):
            cells += [
                fmt(results.pooled("B5", kind, "ttft_ms", q, model, clients))
                for kind in ("plain", "structured")
            ]
        cells.append(fmt(mask[0].metrics["us_per_token"]) if mask else "-")
        share = mask[0].metrics.get("masked_share") if mask else None
        cells.append(f"{100 * share:.0f}%" if share is not None else "-")
        rows.append(cells)
    headers = [
        "model", "clients", "structured / plain per round", "median",
        "TTFT p50 plain", "structured", "TTFT p99 plain", "structured", "mask us / token",
        "tokens masked",
    ]  # fmt: skip
    return Table(
        "B5 structured outputs (json_schema vs plain, tok/s ratio paired per round; ms)", headers, rows
    )


def targets(results: ResultSet) -> list[Target]:
    """Every target of the issue with its measurement; B1 and B2 on every model that ran."""
    found: list[Target] = []
    for model in _models(results, "B1") or _models(results, "B2"):
        for engine, label in (("direct", "direct engine"), ("upstream", "upstream transformers")):
            found.append(Target(f"B1 {model} 32 clients: resq / {label} (median of per-round ratios)", results.paired_ratio("B1", "resq", engine, "tok_s", model, 32), 0.8, "min", "x"))  # fmt: skip
        for serve, label in (("serve", "transformers serve (resq's sizes)"), ("serve-defaults", "transformers serve (its defaults)")):  # fmt: skip
            found.append(Target(f"B1 {model} 32 clients: resq / {label} (median of per-round ratios)", results.paired_ratio("B1", "resq", serve, "tok_s", model, 32), 1.5, "min", "x"))  # fmt: skip
        found += [
            Target(f"B2 {model} 1 client: TTFT overhead p50", _difference(ttft_ms(results, "resq", model, 1, 50), ttft_ms(results, "direct", model, 1, 50)), 5.0, "max", " ms"),
            Target(f"B2 {model} 1 client: TTFT overhead p99", _difference(ttft_ms(results, "resq", model, 1, 99), ttft_ms(results, "direct", model, 1, 99)), 20.0, "max", " ms"),
        ]  # fmt: skip
    found += [
        Target("B3: 2 workers / 1 worker (median of per-round ratios)", results.paired_ratio("B3", "pp2", "pp1", "events_s", "tiny"), 1.7, "min", "x"),
        Target("B3: 1 worker / builder alone (median of per-round ratios)", results.paired_ratio("B3", "pp1", "builder", "events_s", "tiny"), 0.6, "min", "x"),
    ]  # fmt: skip
    for clients in _concurrencies(results, "B4", "tiny")[-1:]:  # the target is at the widest load
        ratios = results.per_round_ratios("B4", "resq", "floor", "cpu_us_per_token", "tiny", clients)
        found.append(
            Target(
                f"B4 {clients} clients: API CPU per token / bare relay floor (median of per-round ratios)",
                median(ratios) if ratios else None,
                2.0,
                "max",
                "x",
            )
        )
    for record in results.matching("B4cap", "resq", "tiny"):
        found.append(
            Target("B4: streams held by one API process", record.metrics["held"], HELD_STREAMS_TARGET, "min")
        )
    for model in _models(results, "B5"):
        found.append(Target(f"B5 {model}: structured / plain (median of per-round ratios)", b5_ratio(results, model), 0.85, "min", "x"))  # fmt: skip
    if results.matching("B1", "resq", "tiny", 32):
        for serve, label in (("serve", "resq's sizes"), ("serve-defaults", "its defaults")):
            found.append(Target(f"B7 tiny 32 clients: CPU per token outside the engine, resq / transformers serve ({label})", results.paired_ratio("B1", "resq", serve, "server_cpu_us_per_token", "tiny", 32), 1.0, "max", "x"))  # fmt: skip
    return found


def targets_table(found: Sequence[Target]) -> Table:
    """The targets as a table."""
    rows = []
    for target in found:
        bound = f"{'>=' if target.direction == 'min' else '<='} {target.bound:g}{target.unit}"
        digits = 2 if target.unit == "x" else 1
        measured = "-" if target.measured is None else f"{target.measured:.{digits}f}{target.unit}"
        rows.append([target.name, measured, bound, target.verdict()])
    return Table("Targets", ["target", "measured", "bound", "verdict"], rows)


def all_tables(results: ResultSet) -> list[Table]:
    """Every table that has data, targets first."""
    tables = [
        targets_table(targets(results)),
        b1_table(results),
        b1_ratio_table(results),
        b2_table(results),
        b3_table(results),
        b4_table(results),
        b5_table(results),
        b7_table(results),
        b7_breakdown_table(results),
    ]
    return [table for table in tables if table.rows]
