"""Per-request next-token choice for a batch of logits: greedy rows, temperature and top-p.

transformers' per-request processors (temperature, top-k, top-p) sort the whole
vocabulary twice for every row of every step, greedy rows included, and then
draw from a softmax of the whole batch. :func:`next_tokens` does the same job
with as little work as the batch needs:

- greedy rows take the argmax of their logits, with no processing at all; a
  batch with only greedy rows costs one argmax;
- sampled rows are divided by their temperature and drawn from; only rows with
  ``top_p < 1`` are sorted, once, to cut the nucleus.

With ``graph_safe`` it makes no decision on the host (no ``.item()``, no
boolean indexing): every row is processed and the greedy ones are picked with
``torch.where``, so the step can be captured in a CUDA graph or compiled.

Top-p keeps a token when the probability mass of the tokens ranked above it is
below ``top_p``: the most likely token always stays, as in transformers
(``cumulative <= 1 - top_p`` removed, in ascending order).
"""

from __future__ import annotations

import torch


def next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    greedy: torch.Tensor,
    *,
    graph_safe: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of every row of ``logits`` ([rows, vocab], float32), as int64 [rows].

    ``temperature`` and ``top_p`` are float32 [rows]; ``greedy`` is bool [rows] (its
    rows ignore the other two). ``generator`` is for tests: the draw is reproducible.
    """
    greedy_tokens = logits.argmax(dim=-1)
    if graph_safe:
        # Greedy rows get a harmless temperature; their draw is discarded below.
        safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
        drawn = _draw(logits, safe_temperature, top_p, nucleus=True, generator=generator)
        return torch.where(greedy, greedy_tokens, drawn)
    if bool(greedy.all()):
        return greedy_tokens
    rows = (~greedy).nonzero().squeeze(1)
    row_top_p = top_p[rows]
    nucleus = bool((row_top_p < 1.0).any())
    drawn = _draw(logits[rows], temperature[rows], row_top_p, nucleus=nucleus, generator=generator)
    return greedy_tokens.index_put((rows,), drawn)


def _draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    *,
    nucleus: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    scaled = logits / temperature.unsqueeze(1)
    if not nucleus:
        probs = torch.softmax(scaled, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    ranked, order = torch.sort(scaled, dim=-1, descending=True)
    probs = torch.softmax(ranked, dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    # Rows with top_p >= 1 keep everything (cumsum's rounding must not cut their tail).
    cut = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    cut[:, 0] = False  # the most likely token stays, whatever top_p says
    probs = probs.masked_fill(cut, 0.0)
    choice = torch.multinomial(probs, 1, generator=generator)
    return order.gather(1, choice).squeeze(1)
