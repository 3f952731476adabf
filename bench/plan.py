"""What a bench run does: scenarios, models, rounds and sizes (full and ``--quick``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

SCENARIOS = ("B1", "B2", "B3", "B4", "B5")
MODELS = ("tiny", "bench")


@dataclass(frozen=True)
class Plan:
    """Sizes of every scenario; the defaults are the issue's."""

    rounds: int = 3
    models: tuple[str, ...] = MODELS
    scenarios: tuple[str, ...] = SCENARIOS
    with_serve: bool = True
    postprocess_workers: int = 2
    """resq's post-process workers in B1/B2/B4 (``RESQ_POSTPROCESS_WORKERS``; 0: inline in the API)."""
    b1_concurrencies: tuple[int, ...] = (1, 8, 32)
    b1_tokens: int = 256
    b2_probes: int = 40
    """Sequential single-client requests per system and round, for TTFT percentiles."""
    b2_probe_tokens: int = 4
    b3_streams: int = 64
    b3_tokens: int = 256
    b4_concurrencies: tuple[int, ...] = (1, 8, 64)
    b4_tokens: int = 256
    b4_min_tokens: int = 2048
    """Each B4 client repeats requests until the run streamed this many tokens (CPU clock resolution)."""
    b4_floor_interval_s: float = 0.002
    capacity_streams: int = 4000
    """B4: streams the held-streams case opens against one API process (its target is as many)."""
    b5_clients: int = 32
    """B5: streaming clients of each kind (structured, plain) per round."""
    b5_tokens: int = 128

    @property
    def quick(self) -> Plan:
        """A smaller run for a first look (a few minutes): fewer rounds, tokens and streams."""
        return replace(
            self,
            rounds=2,
            b1_tokens=64,
            b2_probes=15,
            b3_streams=32,
            b3_tokens=128,
            b4_tokens=64,
            b4_min_tokens=1024,
            capacity_streams=300,
            b5_tokens=64,
        )

    def runs(self) -> int:
        """How many measured runs the plan makes (the progress bar's total)."""
        per_model = 0
        if "B1" in self.scenarios:
            # resq, the GPU worker's engine, upstream transformers; transformers serve twice
            per_model += len(self.b1_concurrencies) * (5 if self.with_serve else 3)
        if "B2" in self.scenarios:
            # resq, the engine alone, the HTTP floor; transformers serve
            per_model += 4 if self.with_serve else 3
        total = per_model * len(self.models) * self.rounds
        if "B3" in self.scenarios:
            total += 3 * self.rounds
        if "B4" in self.scenarios:
            total += 2 * len(self.b4_concurrencies) * self.rounds + 1
        if "B5" in self.scenarios:
            total += 2 * len(self.models) * self.rounds
        return total
