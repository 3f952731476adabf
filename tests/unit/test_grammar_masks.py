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

SCHEMAS: list[dict[str, object]] = [
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
        assert constrained.masked_rows == [0, 2, 3]
        assert constrained.checked_rows == []
        masked = constraints.apply(constrained, torch.zeros(len(row_ids), vocab))
        forbidden = masked.isinf()
        assert not forbidden[1].any(), "the unconstrained row was masked"
        seen.append(forbidden)
        tokens = torch.tensor([chooser.choice(torch.nonzero(~row).flatten().tolist()) for row in forbidden])
        assert constraints.check(constrained, tokens.tolist()) == []
        constraints.advance(constrained, tokens.tolist())
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


def test_checked_rows_are_masked_only_when_their_grammar_refuses_the_chosen_token(
    tokenizer_json: str,
) -> None:
    vocab = 2054
    checked = GrammarConstraints(tokenizer_json, vocab, [2], parallel=False)
    reference = GrammarConstraints(tokenizer_json, vocab, [2], parallel=False)  # every row masked first
    row_ids = ["a", "free", "b", "c"]
    for request_id, schema in zip(["a", "b", "c"], SCHEMAS, strict=True):
        checked.add(request_id, grammar_of(schema), [], checkable=True)
        reference.add(request_id, grammar_of(schema), [])
    chooser = random.Random(11)
    refusals = 0
    for step in range(STEPS):
        constrained = checked.start_masks(row_ids, torch.device("cpu"))
        expected = reference.start_masks(row_ids, torch.device("cpu"))
        assert constrained is not None and expected is not None
        assert constrained.checked_rows == [0, 2, 3] and constrained.masked_rows == []
        assert constrained.forbidden is None, "a mask was computed before the choice"
        forbidden = reference.apply(expected, torch.zeros(len(row_ids), vocab)).isinf()
        # Rows take turns choosing a token their grammar refuses and one it allows.
        refuse = {row for row in (0, 2, 3) if (row + step) % 2 == 0}
        matchers = dict(zip(constrained.checked_rows, constrained.checked_matchers, strict=True))
        tokens = [0] * len(row_ids)
        for row in (0, 2, 3):
            allowed = torch.nonzero(~forbidden[row]).flatten().tolist()
            if row in refuse:
                refused_tokens = [t for t in range(vocab) if matchers[row].validate_tokens([t]) == 0]
                tokens[row] = chooser.choice(refused_tokens)
            else:
                tokens[row] = chooser.choice(allowed)
        assert checked.check(constrained, tokens) == sorted(refuse)
        refusals += len(refuse)
        # The refused rows get exactly their grammar's masks, and are chosen again under them.
        remasked = checked.mask_refused(constrained, torch.zeros(len(refuse), vocab)).isinf()
        assert torch.equal(remasked, forbidden[sorted(refuse)])
        for row in sorted(refuse):
            tokens[row] = chooser.choice(torch.nonzero(~forbidden[row]).flatten().tolist())
        checked.advance(constrained, tokens)
        reference.advance(expected, tokens)
    assert refusals > 0
    # Every matcher took the same tokens as its reference: the next masks agree.
    last = checked.start_masks(row_ids, torch.device("cpu"))
    again = reference.start_masks(row_ids, torch.device("cpu"))
    assert last is not None and again is not None
    next_forbidden = reference.apply(again, torch.zeros(len(row_ids), vocab)).isinf()
    for row, matcher in zip(last.checked_rows, last.checked_matchers, strict=True):
        own, _ = checked._forbidden_tokens([matcher])
        assert torch.equal(own[0], next_forbidden[row])
