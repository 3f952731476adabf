"""Per-request next-token choice for a batch of logits: greedy rows, temperature and top-p.

transformers' per-request processors (temperature, top-k, top-p) sort the whole
vocabulary twice for every row of every step, greedy rows included, and then
draw from a softmax of the whole batch. :func:`choose` does the same job
with as little work as the batch needs:

- greedy rows take the argmax of their logits, with no processing at all; a
  batch with only greedy rows costs one max;
- sampled rows are divided by their temperature and drawn from; only rows with
  ``top_p < 1`` are sorted, once, to cut the nucleus.

With ``graph_safe`` it makes no decision on the host (no ``.item()``, no
boolean indexing): every row is processed and the greedy ones are picked with
``torch.where``, so the step can be captured in a CUDA graph or compiled.

Top-p keeps a token when the probability mass of the tokens ranked above it is
below ``top_p``: the most likely token always stays, as in transformers
(``cumulative <= 1 - top_p`` removed, in ascending order).

A row with nothing finite to choose from (a NaN or an infinity in its logits, every
token masked, or a maximum that overflows once divided by its temperature) must not
end the step for the whole batch: :func:`choose` clears its :attr:`Choice.finite` flag
and still gives it a valid token id, from the same single max that finds the greedy
tokens (``max`` propagates NaN), so the check costs no extra pass over the logits and
no host sync. The draw is ``torch.multinomial``'s own exponential race without its
validity check, which reads two reductions back to the host and raises for a NaN row.
"""

from __future__ import annotations

from typing import Final, NamedTuple

import torch

from gpu_worker.seeds import SeededRow, seeded_race

GREEDY_BELOW_TEMPERATURE: Final = 1e-5
"""Temperatures below this decode greedily, as in vLLM (``_SAMPLING_EPS``): they are greedy in
all but rounding, and logits divided by 1e-40 overflow to infinity."""

NON_FINITE_TOKEN: Final = 2**31 - 1
"""The token id resq's step reports for a row that is not :attr:`Choice.finite` (the largest int32:
never a real token); the engine makes it an end token of every request and turns it into
an error finish."""

GRAMMAR_FAILED_TOKEN: Final = 2**31 - 2
"""The token id resq's step reports for a constrained row whose grammar failed (its matcher refused
the token its own mask allowed, or hit one of llguidance's limits): like :data:`NON_FINITE_TOKEN`,
an end token of every request that the engine turns into an error finish, so the response
fails instead of ending ``completed`` with text its grammar does not allow."""

STEP_FLAGS: Final = (NON_FINITE_TOKEN, GRAMMAR_FAILED_TOKEN)
"""Every token id the step reports that is not a token (each one ends its request with an error)."""


class Choice(NamedTuple):
    """The next token of every row, and which rows had something finite to choose from."""

    tokens: torch.Tensor
    """int64 [rows]: a valid token id for every row, the non-finite ones included."""
    finite: torch.Tensor
    """bool [rows]: the row's logits (after its temperature) have a finite maximum."""


def choose(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
    *,
    graph_safe: bool = False,
    generator: torch.Generator | None = None,
    seeded: list[SeededRow] | None = None,
) -> Choice:
    """The next token of every row of ``logits`` ([rows, vocab], float32), and which rows are finite.

    ``temperature`` and ``top_p`` are float32 [rows]; ``greedy`` is bool [rows] (its
    rows ignore the other two). ``generator`` is for tests: the draw is reproducible.
    ``seeded``: rows whose draw uses noise of their own seed (:mod:`gpu_worker.seeds`).
    """
    best, greedy_tokens = logits.max(dim=-1)
    race = seeded_race(logits.shape[0], logits.shape[1], logits.device, seeded, generator) if seeded else None
    if graph_safe:
        # Greedy rows get a harmless temperature; their draw is discarded below.
        safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
        drawn = _draw(logits, safe_temperature, top_p, nucleus=True, generator=generator, race=race)
        finite = torch.isfinite(best / safe_temperature)
        return Choice(torch.where(greedy, greedy_tokens, drawn), finite)
    finite = torch.isfinite(best)
    if bool(greedy.all()):
        return Choice(greedy_tokens, finite)
    rows = (~greedy).nonzero().squeeze(1)
    row_temperature = temperature[rows]
    row_top_p = top_p[rows]
    nucleus = bool((row_top_p < 1.0).any())
    drawn = _draw(
        logits[rows],
        row_temperature,
        row_top_p,
        nucleus=nucleus,
        generator=generator,
        race=race[rows] if race is not None else None,
    )
    # A finite maximum may still overflow once divided by a small temperature.
    finite = finite.index_put((rows,), torch.isfinite(best[rows] / row_temperature))
    return Choice(greedy_tokens.index_put((rows,), drawn), finite)


def next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
    *,
    graph_safe: bool = False,
    generator: torch.Generator | None = None,
    seeded: list[SeededRow] | None = None,
) -> torch.Tensor:
    """:attr:`Choice.tokens` of :func:`choose` (int64 [rows])."""
    return choose(
        logits, temperature, top_p, greedy, graph_safe=graph_safe, generator=generator, seeded=seeded
    ).tokens


def _draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    *,
    nucleus: bool,
    generator: torch.Generator | None,
    race: torch.Tensor | None = None,
) -> torch.Tensor:
    scaled = logits / temperature.unsqueeze(1)
    if not nucleus:
        return _sample(torch.softmax(scaled, dim=-1), generator, race)
    ranked, order = torch.sort(scaled, dim=-1, descending=True)
    probs = torch.softmax(ranked, dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    # Rows with top_p >= 1 keep everything (cumsum's rounding must not cut their tail).
    cut = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    cut[:, 0] = False  # the most likely token stays, whatever top_p says
    probs = probs.masked_fill(cut, 0.0)
    return order.gather(1, _sample(probs, generator, race).unsqueeze(1)).squeeze(1)


def _sample(
    probs: torch.Tensor, generator: torch.Generator | None, race: torch.Tensor | None
) -> torch.Tensor:
    # torch.multinomial(probs, 1) draws argmax(probs / q), q ~ Exp(1): the same draw from the
    # same generator, without the check that syncs the host and fails the step on a NaN row.
    # A given race (seeded rows' own noise) is the q, indexed by rank in the nucleus path.
    if race is not None:
        return (probs / race).argmax(dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return torch.div(probs, race, out=race).argmax(dim=-1)
