"""What one bench run measured: a flat list of records, saved as JSON, aggregated on demand.

Each record is one run of one system in one case (scenario, model, concurrency)
in one round. Scalars (tokens/s, CPU per token) are summarised by the median
over rounds; samples (TTFT, inter-token latency) are pooled over rounds and
summarised by percentiles.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.stats import median, percentile


@dataclass
class RunRecord:
    """One measured run."""

    scenario: str
    system: str
    model: str
    concurrency: int
    round: int
    metrics: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class ResultSet:
    """Every record of a bench run, and what the run was (command, machine, settings)."""

    records: list[RunRecord] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)

    def add(self, record: RunRecord) -> None:
        """Keep ``record``."""
        self.records.append(record)

    def matching(
        self, scenario: str, system: str, model: str = "", concurrency: int | None = None
    ) -> list[RunRecord]:
        """The records of one case and system."""
        return [
            record
            for record in self.records
            if record.scenario == scenario
            and record.system == system
            and record.model == model
            and (concurrency is None or record.concurrency == concurrency)
        ]

    def scalar(
        self, scenario: str, system: str, metric: str, model: str = "", concurrency: int | None = None
    ) -> float | None:
        """The median over rounds of ``metric`` (None when never measured)."""
        values = [
            record.metrics[metric]
            for record in self.matching(scenario, system, model, concurrency)
            if metric in record.metrics
        ]
        return median(values) if values else None

    def per_round_ratios(
        self,
        scenario: str,
        numerator: str,
        denominator: str,
        metric: str,
        model: str = "",
        concurrency: int | None = None,
    ) -> list[float]:
        """``numerator / denominator`` of ``metric`` in each round both ran (back to back), in round
        order: the pairs a drift of the machine between rounds cannot skew."""
        by_round: dict[int, dict[str, float]] = {}
        for system in (numerator, denominator):
            for record in self.matching(scenario, system, model, concurrency):
                if metric in record.metrics:
                    by_round.setdefault(record.round, {})[system] = record.metrics[metric]
        return [
            pair[numerator] / pair[denominator]
            for _, pair in sorted(by_round.items())
            if numerator in pair and denominator in pair and pair[denominator] != 0
        ]

    def paired_ratio(
        self,
        scenario: str,
        numerator: str,
        denominator: str,
        metric: str,
        model: str = "",
        concurrency: int | None = None,
    ) -> float | None:
        """The median of :meth:`per_round_ratios` (None when no round ran both)."""
        ratios = self.per_round_ratios(scenario, numerator, denominator, metric, model, concurrency)
        return median(ratios) if ratios else None

    def pooled(
        self,
        scenario: str,
        system: str,
        sample: str,
        q: float,
        model: str = "",
        concurrency: int | None = None,
    ) -> float | None:
        """The ``q``-th percentile of ``sample`` pooled over rounds (None when never measured)."""
        values = [
            value
            for record in self.matching(scenario, system, model, concurrency)
            for value in record.samples.get(sample, [])
        ]
        return percentile(values, q) if values else None

    def save(self, path: Path) -> None:
        """Write the records and context as JSON."""
        payload = {"context": self.context, "records": [asdict(record) for record in self.records]}
        path.write_text(json.dumps(payload, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ResultSet:
        """Read what :meth:`save` wrote."""
        payload = json.loads(path.read_text())
        return cls(records=[RunRecord(**record) for record in payload["records"]], context=payload["context"])
