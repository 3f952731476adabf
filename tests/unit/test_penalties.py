"""Presence and frequency penalties: the arithmetic, the per-request counts, and the engine.

The engine tests run the built-in random-weight model on CPU: greedy, it repeats one token
for ever, and its logits span less than 2, so a frequency penalty of 2 makes any token it
generated less likely than every token it did not.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from gpu_worker.engine import Engine, PenaltiesRefusedError
from gpu_worker.model_loading import LoadedModel, load_model
from gpu_worker.penalties import INITIAL_ROWS, Penalties, apply_penalties
from gpu_worker.sampling import next_tokens
from resq.settings import BUILTIN_MODEL, Settings
from resq.wire import GenerationJob
from tests.support.engine import batch_tokens, chat_prompt_ids, greedy_job, started_engine

CPU = torch.device("cpu")


def counts_of(generated: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(generated), minlength=vocab).float()


# --- apply_penalties ----------------------------------------------------------------------------


def test_hand_computed_penalties() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    # Generated [2, 2, 3]: token 2 twice (2 * 0.25 + 0.5 = 1.0), token 3 once (0.25 + 0.5 = 0.75).
    penalised = apply_penalties(
        logits,
        torch.tensor([0]),
        counts_of([2, 2, 3], 5)[None],
        frequency=torch.tensor([0.25]),
        presence=torch.tensor([0.5]),
    )
    assert penalised.tolist() == [[1.0, 2.0, 2.0, 3.25, 5.0]]
    assert logits.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0]]  # the raw logits stay for logprobs


def test_negative_penalties_favour_what_was_generated() -> None:
    logits = torch.zeros(1, 5)
    penalised = apply_penalties(
        logits, torch.tensor([0]), counts_of([2, 2, 3], 5)[None], torch.tensor([-0.5]), torch.tensor([-1.0])
    )
    assert penalised.tolist() == [[0.0, 0.0, 2.0, 1.5, 0.0]]


def test_only_the_penalised_rows_change() -> None:
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    counts = torch.stack([counts_of([1, 1], 7), counts_of([6], 7)])
    penalised = apply_penalties(
        logits, torch.tensor([3, 1]), counts, torch.tensor([1.0, 2.0]), torch.zeros(2)
    )
    assert torch.equal(penalised[[0, 2]], logits[[0, 2]])
    expected_3 = logits[3].clone()
    expected_3[1] -= 2.0
    expected_1 = logits[1].clone()
    expected_1[6] -= 2.0
    assert torch.equal(penalised[3], expected_3)
    assert torch.equal(penalised[1], expected_1)


def test_no_penalised_row_returns_the_logits_themselves() -> None:
    logits = torch.randn(3, 11)
    empty = torch.empty(0, dtype=torch.int64)
    assert apply_penalties(logits, empty, torch.empty(0, 11), torch.empty(0), torch.empty(0)) is logits


def test_zero_penalties_leave_the_values_unchanged() -> None:
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(1))
    counts = torch.stack([counts_of([0, 4, 4], 9), counts_of([8], 9)])
    penalised = apply_penalties(logits, torch.tensor([0, 1]), counts, torch.zeros(2), torch.zeros(2))
    assert torch.equal(penalised, logits)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_masked_token_stays_masked(sign: float) -> None:
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    counts = counts_of([1, 1, 1, 2], 4)[None]
    penalised = apply_penalties(
        logits, torch.tensor([0]), counts, torch.tensor([2.0 * sign]), torch.tensor([2.0 * sign])
    )
    assert penalised[0, 1].item() == -math.inf
    assert penalised[0, 3].item() == -math.inf
    assert not penalised.isnan().any()


def test_a_penalty_moves_the_greedy_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0], [0.0, 3.0, 2.5, 1.0]])
    greedy = torch.tensor([True, True])
    ones = torch.ones(2)
    # Row 0 generated token 1 once; row 1 is another request, unpenalised.
    penalised = apply_penalties(
        logits, torch.tensor([0]), counts_of([1], 4)[None], torch.tensor([0.3]), torch.tensor([0.3])
    )
    assert next_tokens(logits, ones, ones, greedy).tolist() == [1, 1]
    assert next_tokens(penalised, ones, ones, greedy).tolist() == [2, 1]
    assert next_tokens(penalised, ones, ones, greedy, graph_safe=True).tolist() == [2, 1]


# --- Penalties: counts per request --------------------------------------------------------------


def step(penalties: Penalties, row_ids: list[str], logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """One engine step: the penalised logits, then the chosen ``tokens`` counted."""
    penalised = penalties.rows(row_ids, CPU)
    result = logits if penalised is None else penalties.apply(penalised, logits)
    if penalised is not None:
        penalties.count(penalised, torch.tensor(tokens))
    return result


def test_counts_start_from_the_replayed_tokens_and_follow_each_step() -> None:
    penalties = Penalties(vocab_size=5)
    penalties.add("resp_a", frequency=0.25, presence=0.5, replay=[2, 2])
    assert len(penalties) == 1
    zeros = torch.zeros(2, 5)
    # Rows: an unpenalised request, then resp_a; resp_a's replayed tokens count from its first step.
    first = step(penalties, ["resp_free", "resp_a"], zeros, [0, 3])
    assert first.tolist() == [[0.0] * 5, [0.0, 0.0, -1.0, 0.0, 0.0]]
    # resp_a chose 3 at that step; rows may come in another order.
    second = step(penalties, ["resp_a", "resp_free"], zeros, [2, 0])
    assert second.tolist() == [[0.0, 0.0, -1.0, -0.75, 0.0], [0.0] * 5]
    third = step(penalties, ["resp_a"], torch.zeros(1, 5), [4])
    assert third.tolist() == [[0.0, 0.0, -1.25, -0.75, 0.0]]


def test_a_step_without_penalised_rows_touches_nothing() -> None:
    penalties = Penalties(vocab_size=5)
    penalties.add("resp_a", frequency=1.0, presence=0.0, replay=[])
    assert penalties.rows(["resp_other"], CPU) is None


def test_a_forgotten_request_leaves_no_count_behind() -> None:
    penalties = Penalties(vocab_size=4)
    penalties.add("resp_old", frequency=1.0, presence=1.0, replay=[1, 1, 1])
    step(penalties, ["resp_old"], torch.zeros(1, 4), [2])
    penalties.forget("resp_old")
    penalties.forget("resp_never_added")
    assert len(penalties) == 0
    # The new request takes the freed row of the table, cleared.
    penalties.add("resp_new", frequency=1.0, presence=0.0, replay=[3])
    assert step(penalties, ["resp_new"], torch.zeros(1, 4), [0]).tolist() == [[0.0, 0.0, 0.0, -1.0]]


def test_a_request_forgotten_before_its_first_step_is_never_placed() -> None:
    penalties = Penalties(vocab_size=4)
    penalties.add("resp_gone", frequency=1.0, presence=1.0, replay=[])
    penalties.add("resp_kept", frequency=1.0, presence=1.0, replay=[])
    penalties.forget("resp_gone")
    assert step(penalties, ["resp_gone", "resp_kept"], torch.zeros(2, 4), [1, 2]).tolist() == [[0.0] * 4] * 2
    assert step(penalties, ["resp_kept"], torch.zeros(1, 4), [1]).tolist() == [[0.0, 0.0, -2.0, 0.0]]


def test_the_table_grows_and_keeps_every_requests_counts() -> None:
    penalties = Penalties(vocab_size=3 * INITIAL_ROWS)
    ids = [f"resp_{index}" for index in range(3 * INITIAL_ROWS)]
    for index, request_id in enumerate(ids[:INITIAL_ROWS]):
        penalties.add(request_id, frequency=1.0, presence=0.0, replay=[index])
    logits = torch.zeros(len(ids), 3 * INITIAL_ROWS)
    step(penalties, ids[:INITIAL_ROWS], logits[:INITIAL_ROWS], list(range(INITIAL_ROWS)))
    for index, request_id in enumerate(ids[INITIAL_ROWS:], start=INITIAL_ROWS):
        penalties.add(request_id, frequency=1.0, presence=0.0, replay=[index])
    penalised = step(penalties, ids, logits, [0] * len(ids))
    expected = torch.zeros_like(logits)
    for index in range(len(ids)):
        expected[index, index] = -2.0 if index < INITIAL_ROWS else -1.0
    assert torch.equal(penalised, expected)


# --- the engine -------------------------------------------------------------------------------

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Settings(model=BUILTIN_MODEL, device="cpu"))


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[Engine]:
    with started_engine(loaded, Settings(model=BUILTIN_MODEL, device="cpu", kv_cache_tokens=4096)) as started:
        yield started


@pytest.fixture(scope="module")
def prompt_ids(loaded: LoadedModel) -> list[int]:
    """A chat prompt; greedy decoding of the random model repeats one token after it."""
    return chat_prompt_ids(loaded, "Describe a zebra in many words.")


def job(response_id: str, prompt_ids: list[int], **options: object) -> GenerationJob:
    return greedy_job(response_id, prompt_ids, MAX_TOKENS, **options)


def run_all(
    engine: Engine, jobs: list[GenerationJob], generated: dict[str, list[int]] | None = None
) -> dict[str, list[int]]:
    """Run ``jobs`` in one batch (``generated``: tokens each replays); the tokens each generated."""
    return batch_tokens(engine, jobs, generated)


def reference(
    loaded: LoadedModel, prompt_ids: list[int], count: int, frequency: float, presence: float
) -> list[int]:
    """Greedy decoding with OpenAI's penalties by plain forward passes (stops at an end token)."""
    ids = list(prompt_ids)
    generated: list[int] = []
    vocab = int(loaded.model.config.get_text_config().vocab_size)
    eos = set(loaded.card.eos_token_ids)
    with torch.no_grad():
        for _ in range(count):
            logits = loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            counts = counts_of(generated, vocab) if generated else torch.zeros(vocab)
            logits = logits - frequency * counts - presence * (counts > 0).float()
            token = int(logits.argmax())
            ids.append(token)
            generated.append(token)
            if token in eos:
                break
    return generated


VARIANTS = {
    "resp_frequency": (2.0, 0.0),
    "resp_presence": (0.0, 2.0),
    "resp_mild": (0.5, 0.25),
    "resp_negative": (-1.0, -0.5),
}
"""Penalised requests of one batch: (frequency_penalty, presence_penalty)."""


def test_penalised_requests_stop_repeating_what_a_free_one_repeats(
    engine: Engine, loaded: LoadedModel, prompt_ids: list[int]
) -> None:
    alone = run_all(engine, [job("resp_free_alone", prompt_ids)])["resp_free_alone"]
    repeated, times = Counter(alone).most_common(1)[0]
    assert times > MAX_TOKENS // 2  # the free request loops on one token
    jobs = [job("resp_free", prompt_ids)] + [
        job(rid, prompt_ids, frequency_penalty=frequency, presence_penalty=presence)
        for rid, (frequency, presence) in VARIANTS.items()
    ]
    results = run_all(engine, jobs)
    assert results["resp_free"] == alone  # its neighbours' penalties do not touch it
    for rid in ("resp_frequency", "resp_presence"):
        assert len(set(results[rid])) == len(results[rid]), f"{rid} repeats a token"
        assert results[rid].count(repeated) <= 1
    for rid, (frequency, presence) in VARIANTS.items():
        assert results[rid] == reference(loaded, prompt_ids, MAX_TOKENS, frequency, presence), rid
    assert engine.penalties is not None and len(engine.penalties) == 0  # forgotten once finished


def test_replayed_tokens_count_as_generated(engine: Engine, prompt_ids: list[int]) -> None:
    whole = run_all(engine, [job("resp_whole", prompt_ids, frequency_penalty=2.0)])["resp_whole"]
    published = whole[:5]
    # A lost worker published five tokens; the new one resumes after them, counting them.
    resumed_job = job(
        "resp_resumed", prompt_ids + published, max_output_tokens=MAX_TOKENS - 5, frequency_penalty=2.0
    )
    rest = run_all(engine, [resumed_job], {"resp_resumed": published})["resp_resumed"]
    assert published + rest == whole
    assert not set(rest) & set(published)
    # Counted as prompt instead (the prompt never counts), they would be repeated.
    forgetful = job(
        "resp_forgetful", prompt_ids + published, max_output_tokens=MAX_TOKENS - 5, frequency_penalty=2.0
    )
    assert set(run_all(engine, [forgetful])["resp_forgetful"]) & set(published)


def test_an_engine_that_cannot_penalise_refuses_the_job(engine: Engine, prompt_ids: list[int]) -> None:
    penalties, engine.penalties = engine.penalties, None
    try:
        with pytest.raises(PenaltiesRefusedError, match="presence_penalty or frequency_penalty"):
            engine.add(job("resp_refused", prompt_ids, presence_penalty=0.5))
    finally:
        engine.penalties = penalties


def test_penalties_need_an_eager_synchronous_step() -> None:
    assert Engine._step_runs_eagerly(ContinuousBatchingConfig(use_cuda_graph=False, use_async_batching=False))
    assert not Engine._step_runs_eagerly(ContinuousBatchingConfig(use_cuda_graph=True))
    assert not Engine._step_runs_eagerly(
        ContinuousBatchingConfig(use_cuda_graph=False, use_async_batching=True)
    )


def test_the_wire_bounds_are_openais() -> None:
    assert job("resp_default", [1]).presence_penalty == job("resp_default", [1]).frequency_penalty == 0.0
    for name in ("presence_penalty", "frequency_penalty"):
        assert getattr(job("resp_edge", [1], **{name: -2.0}), name) == -2.0
        with pytest.raises(ValueError, match="less than or equal to 2"):
            job("resp_big", [1], **{name: 2.5})
        with pytest.raises(ValueError, match="greater than or equal to -2"):
            job("resp_small", [1], **{name: -2.1})
