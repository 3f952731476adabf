"""Constrained decoding in the GPU worker's engine, on the built-in random-weight model (CPU).

Random weights write valid JSON only when the grammar really constrains every step: each
schema's answers validate at temperature 0 and 1, with tokens checked after their choice
and with every row masked first, while the same prompts without a grammar do not (so the
check can fail). Checking after the choice picks exactly the tokens masking first picks,
greedy and seeded, and a nucleus draw is masked first. A greedy unconstrained request gets
the same tokens with or without constrained neighbours in its batch, and a resumed
generation replays its tokens into a fresh matcher and stays within the grammar.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client import REGISTRY
from transformers.generation.continuous_batching.requests import RequestStatus

from gpu_worker.engine import GRAMMAR_FAILED_ERROR, Engine, failure_code
from gpu_worker.model_loading import LoadedModel, load_model
from gpu_worker.sampling import GRAMMAR_FAILED_TOKEN
from resq.grammars import AnswerShape, build_grammar
from resq.settings import BUILTIN_MODEL, Settings
from resq.wire import GenerationJob
from tests.support.engine import batch_tokens, greedy_job, run_batch
from tests.support.schemas import SCHEMAS, follows

MAX_TOKENS = 160
SAMPLING_SEED = 2026


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Settings(model=BUILTIN_MODEL, device="cpu"))


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[Engine]:
    started = Engine(loaded, Settings(model=BUILTIN_MODEL, device="cpu", kv_cache_tokens=32768, max_batch=48))
    started.start()
    try:
        yield started
    finally:
        started.stop()


def prompt(loaded: LoadedModel, text: str) -> list[int]:
    rendered = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(rendered, str)
    return list(loaded.tokenizer(rendered, add_special_tokens=False)["input_ids"])


def schema_grammar(schema: dict[str, Any]) -> str:
    grammar = build_grammar(AnswerShape(reasoning=None, json_schema=schema, calls=None), lambda _: None)
    assert grammar is not None
    return grammar


def make_job(response_id: str, prompt_ids: list[int], **fields: Any) -> GenerationJob:
    return greedy_job(response_id, prompt_ids, MAX_TOKENS, **{"model": "resq-tiny", **fields})


def run_all(
    engine: Engine, jobs: list[GenerationJob], generated: dict[str, list[int]] | None = None
) -> dict[str, list[int]]:
    """Run ``jobs`` in one batch; the tokens each generated."""
    return batch_tokens(engine, jobs, generated, timeout_s=300)


def answer(loaded: LoadedModel, tokens: list[int]) -> str:
    return str(loaded.tokenizer.decode(tokens, skip_special_tokens=True))


@contextmanager
def checking_after_choice(engine: Engine, on: bool) -> Iterator[None]:
    """Requests added inside are checked after their choice (``on``) or masked first."""
    assert engine.constraints is not None
    engine.constraints.check_after_choice = on
    try:
        yield
    finally:
        engine.constraints.check_after_choice = True


def grammar_checks() -> dict[str, float]:
    """The GPU worker's count of tokens checked after their choice, by outcome."""
    return {
        outcome: REGISTRY.get_sample_value("resq_grammar_token_checks_total", {"outcome": outcome}) or 0.0
        for outcome in ("accepted", "refused")
    }


@pytest.mark.parametrize("checked", [True, False], ids=["checked-after-choice", "masked-first"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constrained_answer_follows_its_schema(
    loaded: LoadedModel, engine: Engine, temperature: float, checked: bool
) -> None:
    prompt_ids = prompt(loaded, "Answer in JSON.")
    jobs = [
        make_job(
            f"resp_{name}_{temperature}_{checked}",
            prompt_ids,
            temperature=temperature,
            # Seeded: an unseeded draw can write a number's digits past MAX_TOKENS now and then
            # (the JSON grammar allows any number of them), which would make the test flaky.
            seed=SAMPLING_SEED if temperature else None,
            grammar=schema_grammar(schema),
        )
        for name, schema in SCHEMAS.items()
    ]
    before = grammar_checks()
    with checking_after_choice(engine, checked):
        results = run_all(engine, jobs)
    checks = {outcome: grammar_checks()[outcome] - before[outcome] for outcome in before}
    if checked:  # both outcomes happened: the random model's tokens are often refused, sometimes not
        assert checks["accepted"] > 0 and checks["refused"] > 0, checks
    else:
        assert checks == {"accepted": 0.0, "refused": 0.0}
    eos = set(loaded.card.eos_token_ids)
    for name, schema in SCHEMAS.items():
        tokens = results[f"resp_{name}_{temperature}_{checked}"]
        text = answer(loaded, tokens)
        assert tokens and tokens[-1] in eos, f"{name}: did not end when the grammar accepted: {text!r}"
        assert follows(text, schema), f"{name}: {text!r} does not follow {schema}"


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 11)], ids=["greedy", "seeded"])
def test_checking_after_the_choice_picks_what_masking_first_picks(
    loaded: LoadedModel, engine: Engine, temperature: float, seed: int | None
) -> None:
    prompts = [prompt(loaded, f"Answer in JSON, case {index}.") for index in range(2)]

    def run(checked: bool) -> dict[str, list[int]]:
        jobs = [
            make_job(
                f"resp_same_{name}_{index}_{checked}",
                ids,
                temperature=temperature,
                seed=seed,
                grammar=schema_grammar(schema),
            )
            for name, schema in SCHEMAS.items()
            for index, ids in enumerate(prompts)
        ]
        with checking_after_choice(engine, checked):
            results = run_all(engine, jobs)
        return {request_id.rsplit("_", 1)[0]: tokens for request_id, tokens in results.items()}

    before = grammar_checks()
    checked = run(True)
    refused = grammar_checks()["refused"] - before["refused"]
    assert refused > 0, "no token was refused: the redraw under the mask never ran"
    assert checked == run(False)


def test_a_nucleus_draw_is_masked_before_its_choice(loaded: LoadedModel, engine: Engine) -> None:
    schema = SCHEMAS["flat"]
    job = make_job(
        "resp_nucleus",
        prompt(loaded, "Answer in JSON."),
        temperature=1.0,
        top_p=0.9,
        grammar=schema_grammar(schema),
    )
    before = grammar_checks()
    tokens = run_all(engine, [job])["resp_nucleus"]
    assert grammar_checks() == before, "a nucleus row was checked after its choice"
    assert follows(answer(loaded, tokens), schema)


def test_a_batch_mixing_nucleus_checked_and_free_rows_keeps_each_row_its_own(
    loaded: LoadedModel, engine: Engine
) -> None:
    # One step holds rows masked before their choice (nucleus), rows checked after it (greedy)
    # and unconstrained rows: each greedy row gets what it gets with every row masked first.
    prompts = [prompt(loaded, f"Mixed batch, case {index}.") for index in range(2)]
    names = ["nested", "pattern"]

    def greedy_jobs(tag: str) -> list[GenerationJob]:
        return [
            make_job(f"resp_mix_{tag}_{name}_{index}", ids, grammar=schema_grammar(SCHEMAS[name]))
            for name in names
            for index, ids in enumerate(prompts)
        ]

    with checking_after_choice(engine, False):
        masked_first = run_all(engine, greedy_jobs("alone"))
    nucleus = [
        make_job(
            f"resp_mix_nucleus_{name}",
            prompts[0],
            temperature=1.0,
            top_p=0.8,
            grammar=schema_grammar(SCHEMAS[name]),
        )
        for name in names
    ]
    free = [
        make_job(f"resp_mix_free_{index}", ids, max_output_tokens=32) for index, ids in enumerate(prompts)
    ]
    mixed = run_all(engine, [*nucleus, *greedy_jobs("mixed"), *free])
    for name in names:
        for index in range(len(prompts)):
            assert mixed[f"resp_mix_mixed_{name}_{index}"] == masked_first[f"resp_mix_alone_{name}_{index}"]
        assert follows(answer(loaded, mixed[f"resp_mix_nucleus_{name}"]), SCHEMAS[name])


def test_without_a_grammar_the_same_requests_do_not_follow_the_schemas(
    loaded: LoadedModel, engine: Engine
) -> None:
    prompt_ids = prompt(loaded, "Answer in JSON.")
    jobs = [make_job(f"resp_free_{name}", prompt_ids, temperature=1.0) for name in SCHEMAS]
    results = run_all(engine, jobs)
    following = [
        name
        for name, schema in SCHEMAS.items()
        if follows(answer(loaded, results[f"resp_free_{name}"]), schema)
    ]
    assert following == []


def test_unconstrained_greedy_rows_are_unchanged_by_constrained_neighbours(
    loaded: LoadedModel, engine: Engine
) -> None:
    prompts = [prompt(loaded, f"Tell me about number {index}.") for index in range(4)]
    alone = run_all(
        engine, [make_job(f"resp_alone_{i}", ids, max_output_tokens=48) for i, ids in enumerate(prompts)]
    )
    grammar = schema_grammar(SCHEMAS["nested"])
    mixed_jobs = [make_job(f"resp_mixed_{i}", ids, max_output_tokens=48) for i, ids in enumerate(prompts)] + [
        make_job(f"resp_neighbour_{i}", prompts[i % 4], temperature=1.0, grammar=grammar) for i in range(6)
    ]
    mixed = run_all(engine, mixed_jobs)
    for index in range(4):
        assert mixed[f"resp_mixed_{index}"] == alone[f"resp_alone_{index}"]
    for index in range(6):
        assert follows(answer(loaded, mixed[f"resp_neighbour_{index}"]), SCHEMAS["nested"])


def test_a_resumed_generation_replays_its_tokens_into_a_fresh_matcher(
    loaded: LoadedModel, engine: Engine
) -> None:
    schema = SCHEMAS["array_of_objects"]
    grammar = schema_grammar(schema)
    prompt_ids = prompt(loaded, "Points, please.")
    first = run_all(engine, [make_job("resp_first", prompt_ids, temperature=1.0, grammar=grammar)])[
        "resp_first"
    ]
    assert len(first) > 6
    # A lost worker published the first six tokens; the new one resumes after them.
    published = first[:6]
    resumed_job = make_job(
        "resp_resumed",
        prompt_ids + published,
        temperature=1.0,
        grammar=grammar,
        max_output_tokens=MAX_TOKENS - 6,
    )
    rest = run_all(engine, [resumed_job], {"resp_resumed": published})["resp_resumed"]
    assert follows(answer(loaded, published + rest), schema)


def test_tokens_that_break_the_grammar_are_refused_on_resume(loaded: LoadedModel, engine: Engine) -> None:
    grammar = schema_grammar(SCHEMAS["flat"])
    not_json = loaded.tokenizer("hello", add_special_tokens=False)["input_ids"]
    job = make_job("resp_broken", prompt(loaded, "x") + not_json, grammar=grammar)
    with pytest.raises(ValueError, match="do not follow the grammar"):
        engine.add(job, not_json)


@pytest.mark.parametrize("checked", [True, False], ids=["checked-after-choice", "masked-first"])
def test_a_grammar_that_fails_while_decoding_ends_its_request_with_an_error_and_its_neighbours_go_on(
    loaded: LoadedModel, engine: Engine, checked: bool
) -> None:
    """llguidance spells the forced text "<tool_call>" with the vocabulary's added token, then
    refuses that token as special: the answer can no longer follow the grammar. The request
    fails (it once ended "completed" with '{"a": "'), alone."""
    failing = schema_grammar(
        {
            "type": "object",
            "properties": {"a": {"const": "<tool_call>"}},
            "required": ["a"],
            "additionalProperties": False,
        }
    )
    prompt_ids = prompt(loaded, "JSON, please.")
    with checking_after_choice(engine, checked):
        jobs = [
            make_job("resp_grammar_fails", prompt_ids, grammar=failing),
            make_job("resp_neighbour", prompt_ids, grammar=schema_grammar(SCHEMAS["flat"])),
        ]
        results = run_batch(engine, jobs, None, timeout_s=300)
    failed, neighbour = results["resp_grammar_fails"], results["resp_neighbour"]
    assert failed.status == RequestStatus.FAILED and failed.error == GRAMMAR_FAILED_ERROR
    assert failure_code(failed.error) == "invalid_prompt"  # the request's fault, not the server's
    assert GRAMMAR_FAILED_TOKEN not in failed.generated_tokens
    assert answer(loaded, list(failed.generated_tokens)).startswith('{"a": "')
    assert neighbour.status == RequestStatus.FINISHED
    assert follows(answer(loaded, list(neighbour.generated_tokens)), SCHEMAS["flat"])
