"""The per-request record of each position's most likely tokens (gpu_worker.top_logprobs)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.raw_logprobs import raw_distribution
from gpu_worker.top_logprobs import LOWEST_LOGPROB, TopLogprobs, top_alternatives

CPU = torch.device("cpu")


def logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_alternatives_are_the_top_of_the_raw_distribution() -> None:
    scores = logits(4)
    values, ids = top_alternatives(raw_distribution(scores), torch.tensor([1, 3]), 3)
    expected_values, expected_ids = torch.topk(torch.log_softmax(scores[[1, 3]], dim=-1), 3)
    assert torch.equal(ids, expected_ids) and torch.allclose(values, expected_values)


def test_every_row_at_once_is_the_same_as_each_row_named() -> None:
    distribution = raw_distribution(logits(3))
    named = top_alternatives(distribution, torch.arange(3), 4)
    whole = top_alternatives(distribution, None, 4)
    assert all(torch.equal(a, b) for a, b in zip(named, whole, strict=True))


def test_values_that_are_not_finite_read_as_the_lowest_logprob() -> None:
    scores = torch.full((1, 4), float("-inf"))
    scores[0, 2] = 0.0
    values, ids = top_alternatives(raw_distribution(scores), torch.tensor([0]), 3)
    assert ids[0, 0].item() == 2 and values[0, 0].item() == 0.0
    assert values[0, 1:].tolist() == [LOWEST_LOGPROB, LOWEST_LOGPROB]


def test_each_request_keeps_its_own_rows_in_order_and_hands_each_position_out_once() -> None:
    top = TopLogprobs()
    top.add("a", 3)
    top.add("b", 1)
    steps = [logits(3, seed=step) for step in range(4)]
    for scores in steps:
        # Rows: "a", a request that asks for none, "b".
        found = top.rows(["a", "other", "b"], CPU)
        assert found is not None and found.k == 3 and found.rows.tolist() == [0, 2]
        top.record(found, raw_distribution(scores))
    first = top.take("a", 0, 2)
    assert first is not None and [len(row) for row in first] == [3, 3]
    for position, row in enumerate(first):
        values, ids = torch.topk(torch.log_softmax(steps[position][0], dim=-1), 3)
        assert [token for token, _ in row] == ids.tolist()
        assert [value for _, value in row] == pytest.approx(values.tolist())
        assert all(math.isfinite(value) for _, value in row)
    # A round sent again (its append failed) gets the same positions again.
    assert top.take("a", 0, 2) == first
    rest = top.take("a", 2, 4)  # positions 0 and 1 are published: dropped
    assert rest is not None and len(rest) == 2
    assert top.take("a", 0, 1) is None
    assert top.take("a", 4, 5) is None  # not recorded yet
    b = top.take("b", 0, 4)
    assert b is not None and [len(row) for row in b] == [1, 1, 1, 1]
    assert b[0][0][0] == int(torch.argmax(steps[0][2]))
    top.forget("a")
    top.forget("b")
    assert len(top) == 0 and top.rows(["a", "b"], CPU) is None
    assert top.take("a", 4, 5) is None


@pytest.mark.parametrize("count", [0, 21])
def test_counts_outside_openais_bounds_are_refused(count: int) -> None:
    with pytest.raises(ValueError, match="top_logprobs"):
        TopLogprobs().add("a", count)
