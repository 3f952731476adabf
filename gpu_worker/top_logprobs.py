"""The most likely tokens at each output position (``top_logprobs``), in resq's sampling step.

A request that asks for ``top_logprobs: k`` (1 to 20) gets, for every token it generates,
the ``k`` tokens of highest probability under the model's raw distribution at that
position and their logprobs: ``topk(log_softmax(logits), k)``, from the same raw logits
the sampled token's own logprob comes from (:mod:`gpu_worker.raw_logprobs`), before any
penalty, grammar mask, temperature or nucleus, as OpenAI and vLLM report them.

:class:`TopLogprobs` keeps them per request until the GPU worker's publisher sends them
with their tokens (:meth:`TopLogprobs.take`). A step computes one ``topk`` over the rows
that ask, at the largest ``k`` among them, and reads it back to the host in one copy;
steps without such rows cost one ``len()``. Rows map to requests through the step's row
order, as for :mod:`gpu_worker.penalties`, so the engine keeps a :class:`TopLogprobs` only
while its step runs eagerly and synchronously; elsewhere a job asking for them is refused.

Each sampled row of a step is its request's next output token, so a request's lists come in
output order: the ``i``-th list belongs to the ``i``-th token this engine copy generated.
The step of a row flagged non-finite or whose grammar failed records one list more than
the output keeps; that request ends at that step, and the list is never taken.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

TOP_LOGPROBS_MAX = 20
"""OpenAI's bound on ``top_logprobs``."""

LOWEST_LOGPROB = -9999.0
"""What a logprob that is not a finite number is reported as (as :mod:`resq.postprocess.logprobs`)."""

Alternatives = list[tuple[int, float]]
"""One position's most likely tokens: (token id, logprob), most likely first."""


def top_alternatives(
    distribution: torch.Tensor, rows: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` highest logprobs of ``distribution[rows]`` and their token ids.

    ``distribution``: [n, vocab] float32 log-probabilities, the step's
    (:func:`gpu_worker.raw_logprobs.raw_distribution`, computed once for the sampled tokens'
    logprobs too); ``rows``: int64 [r], or None for every row (no copy of the rows). Returns
    float32 [r, k] and int64 [r, k], most likely first.
    """
    chosen = distribution if rows is None else distribution.index_select(0, rows)
    values, indices = torch.topk(chosen, k, dim=-1)
    # JSON has no infinity or NaN: what is not finite reads as the lowest logprob resq reports.
    return torch.nan_to_num(values, nan=LOWEST_LOGPROB, neginf=LOWEST_LOGPROB, posinf=0.0), indices


@dataclass(eq=False)
class _Wanted:
    count: int
    recorded: list[Alternatives] = field(default_factory=list)
    taken: int = 0
    """Output positions already handed to the publisher and dropped from ``recorded``."""


@dataclass(frozen=True)
class TopRows:
    """The rows of one step that want alternatives, and for whom."""

    rows: torch.Tensor
    """int64 [r]: rows of the step's logits, on the logits' device."""
    requests: list[_Wanted]
    k: int
    """The largest ``top_logprobs`` among them: what the step's ``topk`` computes."""


class TopLogprobs:
    """The recorded alternatives of one engine's requests that ask for them (thread-safe)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Wanted] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many requests want alternatives now (a step checks this before anything else)."""
        return len(self._requests)

    def add(self, request_id: str, count: int) -> None:
        """Record the ``count`` most likely tokens at each position ``request_id`` generates."""
        if not 1 <= count <= TOP_LOGPROBS_MAX:
            raise ValueError(f"top_logprobs must be between 1 and {TOP_LOGPROBS_MAX}, not {count}")
        with self._lock:
            self._requests[request_id] = _Wanted(count)

    def forget(self, request_id: str) -> None:
        """Drop what a request that ended (or never asked) still holds."""
        with self._lock:
            self._requests.pop(request_id, None)

    def rows(self, row_request_ids: list[str], device: torch.device) -> TopRows | None:
        """The rows of a step (whose rows belong to ``row_request_ids``) that want alternatives."""
        with self._lock:
            found = [(row, self._requests.get(rid)) for row, rid in enumerate(row_request_ids)]
        wanted = [(row, request) for row, request in found if request is not None]
        if not wanted:
            return None
        rows = torch.tensor([row for row, _ in wanted], dtype=torch.int64).to(device, non_blocking=True)
        requests = [request for _, request in wanted]
        return TopRows(rows, requests, max(request.count for request in requests))

    def record(self, top: TopRows, distribution: torch.Tensor) -> None:
        """Compute and keep the alternatives of ``top``'s rows from the step's raw ``distribution``
        (log-probabilities [n, vocab], float32)."""
        # Rows come in step order: when all of them ask, the step's distribution is taken whole.
        every_row = len(top.requests) == distribution.shape[0]
        values, indices = top_alternatives(distribution, None if every_row else top.rows, top.k)
        # One read back for the step's rows; a request asking for fewer keeps its first ones.
        values_host, indices_host = values.tolist(), indices.tolist()
        with self._lock:
            for request, row_values, row_indices in zip(top.requests, values_host, indices_host, strict=True):
                count = request.count
                request.recorded.append(list(zip(row_indices[:count], row_values[:count], strict=True)))

    def take(self, request_id: str, start: int, stop: int) -> list[Alternatives] | None:
        """The alternatives of output positions ``start`` to ``stop`` (exclusive) of ``request_id``'s
        engine copy; None when they are not all recorded (the request does not ask for them, or
        its step did not record them).

        ``start`` is what the publisher has published: every position before it is dropped. The
        ones returned stay until a later call starts past them, so a round whose append failed and
        is sent again gets them again.
        """
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return None
            published = start - request.taken
            if published < 0 or stop - request.taken > len(request.recorded):
                return None
            del request.recorded[:published]
            request.taken = start
            return request.recorded[: stop - start]
