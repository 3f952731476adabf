"""The grammar masks of a step: filled in parallel or one row after another, the same masks.

:class:`gpu_worker.constraints.GrammarConstraints` picks llguidance's executor only for a large
vocabulary on a host with cores to spare; both paths must give each row exactly its grammar's
mask, step after step, as the chosen tokens advance the matchers.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gpu_worker.builtin_model import ensure_builtin_model
from gpu_worker.constraints import (
    PARALLEL_MASKS_MIN_CORES,
    PARALLEL_MASKS_MIN_VOCAB,
    GrammarConstraints,
    masks_in_parallel,
)
from resq.grammars import AnswerShape, build_grammar

SCHEMAS = [
    {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 3},
    {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
    },
    {"type": "string", "enum": ["red", "green", "blue"]},
]
STEPS = 12


def grammar_of(schema: dict[str, object]) -> str:
    grammar = build_grammar(AnswerShape(reasoning=None, json_schema=schema, calls=None), lambda _: None)
    assert grammar is not None
    return grammar


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    return (Path(ensure_builtin_model()) / "tokenizer.json").read_text()


def masks_over_steps(tokenizer_json: str, parallel: bool) -> list[torch.Tensor]:
    """Each step's forbidden-token masks of four rows (one unconstrained), tokens chosen by a seeded RNG."""
    vocab = 2054
    constraints = GrammarConstraints(tokenizer_json, vocab, [2], parallel=parallel)
    row_ids = ["a", "free", "b", "c"]
    for request_id, schema in zip(["a", "b", "c"], SCHEMAS, strict=True):
        constraints.add(request_id, grammar_of(schema), [])
    chooser = random.Random(7)
    seen = []
    for _ in range(STEPS):
        constrained = constraints.start_masks(row_ids, torch.device("cpu"))
        assert constrained is not None
        assert constrained.rows == [0, 2, 3]
        masked = constraints.apply(constrained, torch.zeros(len(row_ids), vocab))
        forbidden = masked.isinf()
        assert not forbidden[1].any(), "the unconstrained row was masked"
        seen.append(forbidden)
        tokens = torch.tensor([chooser.choice(torch.nonzero(~row).flatten().tolist()) for row in forbidden])
        constraints.advance(constrained, tokens)
    return seen


def test_both_fill_paths_give_every_row_the_same_masks(tokenizer_json: str) -> None:
    in_parallel = masks_over_steps(tokenizer_json, parallel=True)
    one_by_one = masks_over_steps(tokenizer_json, parallel=False)
    for step, (expected, found) in enumerate(zip(in_parallel, one_by_one, strict=True)):
        assert torch.equal(expected, found), f"masks differ at step {step}"
    # The grammars really constrain: each constrained row forbids most of the vocabulary at the start.
    assert all(in_parallel[0][row].float().mean() > 0.5 for row in (0, 2, 3))


def test_only_a_large_vocabulary_on_spare_cores_is_filled_in_parallel() -> None:
    assert masks_in_parallel(PARALLEL_MASKS_MIN_VOCAB, PARALLEL_MASKS_MIN_CORES)
    assert masks_in_parallel(128_256, 64)
    assert not masks_in_parallel(PARALLEL_MASKS_MIN_VOCAB - 1, 64)
    assert not masks_in_parallel(128_256, PARALLEL_MASKS_MIN_CORES - 1)
    assert not masks_in_parallel(128_256, None)
