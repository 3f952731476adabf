"""OpenAI's presence and frequency penalties, in resq's sampling step.

For every token ``j`` of a penalised request's row, before the token is chosen (greedy
or drawn, and before any grammar mask):

    logits[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)

where ``count[j]`` is how often the request has generated ``j`` so far; the prompt does
not count. :func:`apply_penalties` is that arithmetic on tensors.

:class:`Penalties` keeps the counts of one engine's penalised requests in one table on the
logits' device, a row per request ([requests, vocab], float32, grown by doubling): a step
gathers its penalised rows' counts with one index, and after the tokens are chosen adds
them with one ``index_put_``, on the device, without reading anything back. A request
resumed after its GPU worker was lost starts with the counts of the tokens it replays
(those already published). Only requests with a non-zero penalty get a row: a step with
no penalised request in the engine costs one ``len()``, and a step without penalised
rows a dictionary look-up per row.

The table is only ever touched on the engine thread (:meth:`Penalties.rows` fills the
rows of requests added since the last step), so Celery threads adding and forgetting
requests never race the step's device work; they change dictionaries under a lock.
The mapping from rows to requests is read on the host at every step, which a replayed
CUDA graph or a batch prepared ahead (asynchronous batching) would skip: the engine
only keeps a :class:`Penalties` when its step runs eagerly and synchronously.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

INITIAL_ROWS = 8
"""Rows of the count table when the first penalised request arrives; it doubles when full."""


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """``logits`` [n, vocab] with the penalties of ``rows`` subtracted, as a new tensor.

    ``rows`` (int64 [p]) are the penalised rows of ``logits``, ``counts`` (float32 [p, vocab])
    how often each of them generated each token so far, and ``frequency`` and ``presence``
    (float32 [p]) their penalties. Other rows are copied unchanged; with no penalised row,
    ``logits`` itself is returned. ``logits`` is never modified: the step reports logprobs
    of the model's raw distribution from it.
    """
    if rows.numel() == 0:  # host metadata: no device sync
        return logits
    penalty = counts * frequency.unsqueeze(1) + (counts > 0) * presence.unsqueeze(1)
    # Penalties are finite, so a token a grammar masked (-inf) stays -inf, whatever their sign.
    return logits.index_add(0, rows, penalty, alpha=-1)


@dataclass(eq=False)  # compared by identity: two requests may carry equal settings
class _Request:
    frequency: float
    presence: float
    replay: list[int] | None
    """Tokens to count before the request's first step; None once its table row holds them."""
    slot: int = -1
    """Its row of the count table; -1 until the engine thread gives it one."""


@dataclass(frozen=True)
class PenalisedRows:
    """The penalised rows of one step and their rows of the count table."""

    rows: torch.Tensor
    """int64 [p]: rows of the step's logits, on the logits' device."""
    slots: torch.Tensor
    """int64 [p]: the same requests' rows of the count table."""


class Penalties:
    """Generated-token counts of the penalised requests of one engine (thread-safe)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._requests: dict[str, _Request] = {}
        self._pending: list[_Request] = []
        self._free_slots: list[int] = []
        self._counts: torch.Tensor | None = None
        """float32 [capacity, vocab]: how often each slot's request generated each token."""
        self._coefficients: torch.Tensor | None = None
        """float32 [2, capacity]: each slot's frequency (row 0) and presence (row 1) penalty."""
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many requests are penalised now (a step checks this before anything else)."""
        return len(self._requests)

    def add(self, request_id: str, frequency: float, presence: float, replay: list[int]) -> None:
        """Penalise ``request_id``, counting ``replay`` (the tokens it already generated) first."""
        request = _Request(frequency, presence, list(replay))
        with self._lock:
            previous = self._requests.pop(request_id, None)
            if previous is not None:
                self._release(previous)
            self._requests[request_id] = request
            self._pending.append(request)

    def forget(self, request_id: str) -> None:
        """Drop the counts of a request that ended (or never was penalised)."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self._release(request)

    def _release(self, request: _Request) -> None:
        # Its slot may still be in a step running now: that step's count lands in a freed row,
        # which the engine thread clears before it hands the row to another request.
        if request.slot >= 0:
            self._free_slots.append(request.slot)
        elif request in self._pending:
            self._pending.remove(request)

    def rows(self, row_request_ids: list[str], device: torch.device) -> PenalisedRows | None:
        """The penalised rows of a step whose rows belong to ``row_request_ids``; None when none.

        Runs on the engine thread, which alone touches the count table: requests added since
        the last step get their row here, with their replayed tokens counted.
        """
        with self._lock:
            if self._pending:
                self._place(self._pending, device)
                self._pending = []
            found = [(row, self._requests.get(rid)) for row, rid in enumerate(row_request_ids)]
        rows = [row for row, request in found if request is not None]
        if not rows:
            return None
        slots = [request.slot for _, request in found if request is not None]
        # One host-to-device copy for both: it overlaps the forward pass, which runs after this.
        index = torch.tensor([rows, slots], dtype=torch.int64).to(device, non_blocking=True)
        return PenalisedRows(rows=index[0], slots=index[1])

    def _place(self, requests: list[_Request], device: torch.device) -> None:
        # Under the lock, on the engine thread: give each new request a cleared row of the table.
        while len(self._free_slots) < len(requests):
            self._grow(device)
        slots = [self._free_slots.pop() for _ in requests]
        counts, coefficients = self._counts, self._coefficients
        assert counts is not None and coefficients is not None
        for request, slot in zip(requests, slots, strict=True):
            replayed = torch.tensor(request.replay or [], dtype=torch.int64)
            # An id beyond the logits' width cannot have been sampled; cut rather than fail.
            row = torch.bincount(replayed, minlength=self.vocab_size)[: self.vocab_size]
            counts[slot].copy_(row)
            request.slot = slot
            request.replay = None
        index = torch.tensor(slots, dtype=torch.int64, device=device)
        values = torch.tensor(
            [[r.frequency for r in requests], [r.presence for r in requests]],
            dtype=torch.float32,
            device=device,
        )
        coefficients[:, index] = values

    def _grow(self, device: torch.device) -> None:
        old = self._counts
        capacity = INITIAL_ROWS if old is None else 2 * old.shape[0]
        counts = torch.zeros(capacity, self.vocab_size, dtype=torch.float32, device=device)
        coefficients = torch.zeros(2, capacity, dtype=torch.float32, device=device)
        start = 0
        if old is not None and self._coefficients is not None:
            start = old.shape[0]
            counts[:start] = old
            coefficients[:, :start] = self._coefficients
        self._counts, self._coefficients = counts, coefficients
        self._free_slots.extend(range(capacity - 1, start - 1, -1))

    def apply(self, penalised: PenalisedRows, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [rows, vocab] with the penalised rows' penalties subtracted (a copy)."""
        counts, coefficients = self._counts, self._coefficients
        assert counts is not None and coefficients is not None
        chosen = coefficients[:, penalised.slots]
        return apply_penalties(logits, penalised.rows, counts[penalised.slots], chosen[0], chosen[1])

    def count(self, penalised: PenalisedRows, tokens: torch.Tensor) -> None:
        """Add each penalised row's chosen token (of ``tokens`` [rows]) to its request's counts."""
        counts = self._counts
        assert counts is not None
        chosen = tokens[penalised.rows].to(torch.int64)
        ones = torch.ones(chosen.shape[0], dtype=counts.dtype, device=counts.device)
        # One request per slot in a step, so accumulate only matters for clarity, not for races.
        counts.index_put_((penalised.slots, chosen), ones, accumulate=True)
