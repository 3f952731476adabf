"""The GPU worker's sampler on plain tensors: greedy rows, temperature and top-p per row."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.sampling import choose, next_tokens
from gpu_worker.sampling_step import ArgumentRows, row_settings

MODES = [pytest.param(False, id="eager"), pytest.param(True, id="graph-safe")]


def rows_of(probs: list[float], count: int) -> torch.Tensor:
    """``count`` identical rows of logits whose softmax is ``probs``."""
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32).repeat(count, 1)


def frequencies(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab).float() / tokens.numel()).tolist()


def settings(count: int, temperature: float, top_p: float, greedy: bool) -> tuple[torch.Tensor, ...]:
    return (
        torch.full((count,), temperature),
        torch.full((count,), top_p),
        torch.full((count,), greedy),
    )


@pytest.mark.parametrize("graph_safe", MODES)
def test_greedy_rows_take_the_argmax(graph_safe: bool) -> None:
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(1))
    temperature, top_p, greedy = settings(16, 1.0, 1.0, True)
    tokens = next_tokens(logits, temperature, top_p, greedy, graph_safe=graph_safe)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("graph_safe", MODES)
def test_greedy_rows_in_a_mixed_batch_take_the_argmax(graph_safe: bool) -> None:
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(2))
    greedy = torch.tensor([True, False] * 6)
    temperature = torch.where(greedy, 1.0, 1.5)
    top_p = torch.where(greedy, 1.0, 0.9)
    generator = torch.Generator().manual_seed(3)
    tokens = next_tokens(logits, temperature, top_p, greedy, graph_safe=graph_safe, generator=generator)
    argmax = logits.argmax(dim=-1)
    assert tokens[greedy].tolist() == argmax[greedy].tolist()
    # Sampled rows at temperature 1.5 over 300 tokens do not all land on the argmax.
    assert tokens[~greedy].tolist() != argmax[~greedy].tolist()


@pytest.mark.parametrize("graph_safe", MODES)
def test_a_tiny_top_p_leaves_only_the_argmax(graph_safe: bool) -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(4))
    temperature, top_p, greedy = settings(64, 1.3, 1e-6, False)
    generator = torch.Generator().manual_seed(5)
    tokens = next_tokens(logits, temperature, top_p, greedy, graph_safe=graph_safe, generator=generator)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("graph_safe", MODES)
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_a_temperature_row_draws_from_the_scaled_distribution(graph_safe: bool, temperature: float) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    draws = 40_000
    temp, top_p, greedy = settings(draws, temperature, 1.0, False)
    generator = torch.Generator().manual_seed(6)
    tokens = next_tokens(
        rows_of(probs, draws), temp, top_p, greedy, graph_safe=graph_safe, generator=generator
    )
    scaled = [p ** (1 / temperature) for p in probs]
    expected = [s / sum(scaled) for s in scaled]
    assert frequencies(tokens, len(probs)) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("graph_safe", MODES)
def test_top_p_keeps_the_nucleus_and_renormalises(graph_safe: bool) -> None:
    # Mass above each token: 0, 0.5, 0.8, 0.95: top_p 0.75 keeps the first two.
    probs = [0.5, 0.3, 0.15, 0.05]
    draws = 40_000
    temperature, top_p, greedy = settings(draws, 1.0, 0.75, False)
    generator = torch.Generator().manual_seed(7)
    logits = rows_of(probs, draws)
    tokens = next_tokens(logits, temperature, top_p, greedy, graph_safe=graph_safe, generator=generator)
    assert frequencies(tokens, len(probs)) == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=0.01)


@pytest.mark.parametrize("graph_safe", MODES)
def test_top_p_one_keeps_the_whole_tail(graph_safe: bool) -> None:
    probs = [0.9, 0.0999, 0.0001]
    draws = 100_000
    temperature, top_p, greedy = settings(draws, 1.0, 1.0, False)
    generator = torch.Generator().manual_seed(8)
    logits = rows_of(probs, draws)
    tokens = next_tokens(logits, temperature, top_p, greedy, graph_safe=graph_safe, generator=generator)
    assert (tokens == 2).any()


def test_rows_keep_their_own_settings() -> None:
    # One batch: a greedy row, a hot row, and a nucleus row that can only take the argmax.
    probs = [0.4, 0.35, 0.25]
    draws = 20_000
    logits = rows_of(probs, 3 * draws)
    greedy = torch.tensor([True, False, False]).repeat_interleave(draws)
    temperature = torch.tensor([1.0, 1.0, 1.0]).repeat_interleave(draws)
    top_p = torch.tensor([1.0, 1.0, 0.3]).repeat_interleave(draws)
    tokens = next_tokens(logits, temperature, top_p, greedy, generator=torch.Generator().manual_seed(9))
    greedy_part, hot_part, nucleus_part = tokens[:draws], tokens[draws : 2 * draws], tokens[2 * draws :]
    assert set(greedy_part.tolist()) == {0}
    assert frequencies(hot_part, 3) == pytest.approx(probs, abs=0.015)
    assert set(nucleus_part.tolist()) == {0}


def test_row_settings_read_transformers_argument_rows() -> None:
    # The step's argument rows are int32: floats are stored bit for bit (transformers' layout).
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(10))
    rows = ArgumentRows(temperature=0, top_k=1, top_p=2)
    arguments = torch.zeros(3, 8, dtype=torch.int32)
    arguments[0, :3] = torch.tensor([1.0, 0.8, 1.0]).view(torch.int32)
    arguments[1, :3] = torch.tensor([1, 200, 1], dtype=torch.int32)
    arguments[2, :3] = torch.tensor([1.0, 1e-6, 1.0]).view(torch.int32)
    for graph_safe in (False, True):
        tokens = choose(logits, *row_settings(arguments, rows, 3), graph_safe=graph_safe).tokens
        # Rows 0 and 2 are greedy (top_k 1); row 1 samples from a nucleus of one token.
        assert tokens.tolist() == logits.argmax(dim=-1).tolist()


# --- per-request seeds (gpu_worker/seeds.py) --------------------------------------------------------


def test_a_seeded_row_draws_the_same_whatever_its_neighbours_and_the_shared_stream() -> None:
    from gpu_worker.seeds import SeededRow, mixed_seed

    torch.manual_seed(0)
    row = torch.randn(1, 400)
    draws = []
    for neighbours in range(1, 5):
        logits = torch.cat([torch.randn(neighbours, 400), row])
        count = logits.shape[0]
        temperature = torch.ones(count)
        top_p = torch.full((count,), 0.9)
        greedy = torch.zeros(count, dtype=torch.bool)
        seeded = [SeededRow(neighbours, mixed_seed(1234, 7))]
        generator = torch.Generator().manual_seed(neighbours * 31)
        tokens = next_tokens(logits, temperature, top_p, greedy, generator=generator, seeded=seeded)
        draws.append(int(tokens[neighbours]))
    assert len(set(draws)) == 1, draws


def test_seeded_draws_follow_the_distribution_and_differ_by_seed_and_position() -> None:
    from gpu_worker.seeds import SeededRow, mixed_seed

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    one = torch.ones(1)
    greedy = torch.zeros(1, dtype=torch.bool)
    counts = [0, 0, 0]
    for position in range(3000):
        seeded = [SeededRow(0, mixed_seed(42, position))]
        counts[int(next_tokens(logits, one, one, greedy, seeded=seeded)[0])] += 1
    assert [round(count / 3000, 1) for count in counts] == [0.5, 0.3, 0.2]
    assert len({mixed_seed(seed, position) for seed in range(50) for position in range(50)}) == 2500


def test_seeds_advance_one_position_per_sampled_row_and_start_after_a_replay() -> None:
    from gpu_worker.seeds import Seeds, mixed_seed

    seeds = Seeds()
    seeds.add("a", 5, 0)
    seeds.add("b", 5, 3)  # resumed: 3 tokens were generated before
    first = seeds.rows(["x", "a", "b"])
    second = seeds.rows(["b", "a"])
    assert [(entry.row, entry.generator_seed) for entry in first] == [
        (1, mixed_seed(5, 0)),
        (2, mixed_seed(5, 3)),
    ]
    assert [(entry.row, entry.generator_seed) for entry in second] == [
        (0, mixed_seed(5, 4)),
        (1, mixed_seed(5, 1)),
    ]
    seeds.forget("a")
    assert len(seeds) == 1 and seeds.rows(["a"]) == []
