"""Per-request sampling seeds (``seed`` of Chat Completions), in resq's sampling step.

A seeded request's draw for its ``k``-th output token uses noise of its own: the
exponential race of :func:`gpu_worker.sampling.choose` for that row comes from a
generator seeded with ``(seed, k)``, not from the engine's shared stream. So the same
request (prompt, settings, seed) draws the same tokens whatever else is in the batch
(as long as its logits are the same: batch shapes may change their rounding, which is
why OpenAI calls ``seed`` best effort too), and a request resumed on another GPU worker
after a loss goes on exactly as it would have: its position starts at the tokens it
already generated.

Like :mod:`gpu_worker.penalties`, the rows are mapped to requests on the host at every
step, so the engine keeps a :class:`Seeds` only while its step runs eagerly; elsewhere a
seed is not applied (logged once per request).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

_MASK_64 = (1 << 64) - 1


def mixed_seed(seed: int, position: int) -> int:
    """One 63-bit generator seed per (request seed, output position): splitmix64 of both."""
    value = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK_64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (value ^ (value >> 31)) >> 1


@dataclass(frozen=True)
class SeededRow:
    """A row of a step whose draw is seeded, with the generator seed of its position."""

    row: int
    generator_seed: int


@dataclass(eq=False)
class _Seeded:
    seed: int
    position: int
    """The output position of the request's next sampled token."""


class Seeds:
    """The seeds and output positions of one engine's seeded requests (thread-safe)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Seeded] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many requests are seeded now (a step checks this before anything else)."""
        return len(self._requests)

    def add(self, request_id: str, seed: int, generated: int) -> None:
        """Seed ``request_id``, whose next token is its ``generated``-th (0 for a new request)."""
        with self._lock:
            self._requests[request_id] = _Seeded(seed, generated)

    def forget(self, request_id: str) -> None:
        """Drop a request that ended (or never was seeded)."""
        with self._lock:
            self._requests.pop(request_id, None)

    def rows(self, row_request_ids: list[str]) -> list[SeededRow]:
        """The seeded rows of a step whose rows belong to ``row_request_ids``; each moves one on.

        Every row of a step is one sampled token of its request, so a request's position
        advances by one per step it is in.
        """
        seeded: list[SeededRow] = []
        with self._lock:
            for row, request_id in enumerate(row_request_ids):
                request = self._requests.get(request_id)
                if request is not None:
                    seeded.append(SeededRow(row, mixed_seed(request.seed, request.position)))
                    request.position += 1
        return seeded


def seeded_race(
    rows: int, vocab: int, device: torch.device, seeded: list[SeededRow], generator: torch.Generator | None
) -> torch.Tensor:
    """Exponential noise [rows, vocab] for a step's draw: the shared stream's, with the seeded rows'
    own noise in their rows."""
    race = torch.empty((rows, vocab), dtype=torch.float32, device=device).exponential_(generator=generator)
    for entry in seeded:
        own = torch.Generator(device=device)
        own.manual_seed(entry.generator_seed)
        race[entry.row].exponential_(generator=own)
    return race
