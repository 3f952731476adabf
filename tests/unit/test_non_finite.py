"""One misbehaving request never fails its neighbours.

- the sampler flags a row with nothing finite to choose from (NaN, infinity, every token
  masked, a maximum that overflows at its temperature) and still gives every row a valid
  token, the others' unchanged;
- tiny temperatures decode greedily;
- in the engine (the built-in random-weight model on CPU), a request whose logits turn NaN
  ends with an error after the tokens it had, while its batch goes on with the tokens each
  request gets alone;
- a generation loop that dies fails nothing itself: the publisher hands its requests back,
  counting a loss, and gives up on one only after ``max_losses``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import pytest
import redis
import torch
from transformers.generation.continuous_batching import model_runner
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from gpu_worker.engine import NON_FINITE_ERROR, Engine
from gpu_worker.model_loading import LoadedModel, load_model
from gpu_worker.penalties import apply_penalties
from gpu_worker.publisher import TokenPublisher
from gpu_worker.runner_step import Step
from gpu_worker.sampling import GREEDY_BELOW_TEMPERATURE, NON_FINITE_TOKEN, choose
from gpu_worker.sampling_step import reported_tokens
from resq import keys
from resq.recovery import generations
from resq.recovery.generations import Generations, plan_resume
from resq.recovery.generations import Resumption as Plan
from resq.redis_types import range_entries
from resq.settings import BUILTIN_MODEL, Settings
from resq.wire import FinishEntry, GenerationJob, decode_entry
from tests.support.engine import chat_prompt_ids, greedy_job, run_batch

MODES = [pytest.param(False, id="eager"), pytest.param(True, id="graph-safe")]
NAN = float("nan")
INF = float("inf")

# --- the sampler ------------------------------------------------------------------------------


def mixed_batch(rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits and settings of a batch mixing greedy, hot and nucleus rows."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(11))
    greedy = torch.tensor([True, False, False] * (rows // 3) + [True] * (rows % 3))
    temperature = torch.where(greedy, 1.0, 1.4)
    top_p = torch.tensor([1.0, 1.0, 0.8] * (rows // 3) + [1.0] * (rows % 3))
    return logits, temperature, top_p, greedy


@pytest.mark.parametrize("graph_safe", MODES)
def test_non_finite_rows_are_flagged_and_the_others_keep_their_tokens(graph_safe: bool) -> None:
    logits, temperature, top_p, greedy = mixed_batch(12, 400)
    clean = choose(
        logits, temperature, top_p, greedy, graph_safe=graph_safe, generator=torch.Generator().manual_seed(12)
    )
    assert clean.finite.all()
    poisoned = logits.clone()
    poisoned[0, 17] = NAN  # greedy row, one NaN
    poisoned[1] = NAN  # hot row, all NaN
    poisoned[2, 3] = INF  # nucleus row, +inf
    poisoned[3] = -INF  # greedy row, every token masked
    poisoned[4, 5] = -INF  # one masked token is fine
    bad = torch.tensor([i in (0, 1, 2, 3) for i in range(12)])
    choice = choose(
        poisoned,
        temperature,
        top_p,
        greedy,
        graph_safe=graph_safe,
        generator=torch.Generator().manual_seed(12),
    )
    assert (~choice.finite).tolist() == bad.tolist()
    assert choice.tokens[~bad].tolist() == clean.tokens[~bad].tolist()
    assert ((choice.tokens >= 0) & (choice.tokens < 400)).all()  # a flagged row still gets a real id
    assert reported_tokens(choice).tolist() == torch.where(bad, NON_FINITE_TOKEN, clean.tokens).tolist()


@pytest.mark.parametrize("graph_safe", MODES)
def test_a_maximum_that_overflows_at_its_temperature_is_flagged(graph_safe: bool) -> None:
    logits = torch.zeros(2, 50)
    logits[:, 7] = 1e35  # finite, but 1e35 / 1e-4 is not
    temperature = torch.tensor([1e-4, 1e-4])
    greedy = torch.tensor([False, True])
    choice = choose(logits, temperature, torch.ones(2), greedy, graph_safe=graph_safe)
    assert choice.finite.tolist() == [False, True]  # the greedy row never divides
    assert choice.tokens[1] == 7


@pytest.mark.parametrize("graph_safe", MODES)
@pytest.mark.parametrize("top_p", [1.0, 0.5, 5e-324])
@pytest.mark.parametrize("temperature", [GREEDY_BELOW_TEMPERATURE, 1.0, 2.0])
def test_every_setting_the_api_accepts_keeps_finite_logits_finite(
    graph_safe: bool, top_p: float, temperature: float
) -> None:
    # Wide logits, penalised as hard as the API allows (+-2 on counts of a long generation).
    logits = 30 * torch.randn(4, 1000, generator=torch.Generator().manual_seed(14))
    counts = torch.zeros(2, 1000)
    counts[:, :10] = 100_000
    penalised = apply_penalties(
        logits, torch.tensor([0, 1]), counts, torch.tensor([2.0, -2.0]), torch.tensor([2.0, -2.0])
    )
    choice = choose(
        penalised,
        torch.full((4,), temperature),
        torch.full((4,), top_p),
        torch.tensor([False, False, False, True]),
        graph_safe=graph_safe,
    )
    assert choice.finite.all()


def test_the_draw_is_multinomials_draw() -> None:
    # The exponential race replaces torch.multinomial's (checked) call: same generator, same tokens.
    logits, temperature, _, _ = mixed_batch(30, 300)
    greedy = torch.zeros(30, dtype=torch.bool)
    ones = torch.ones(30)
    tokens = choose(logits, temperature, ones, greedy, generator=torch.Generator().manual_seed(13)).tokens
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(13)).squeeze(1)
    assert tokens.tolist() == expected.tolist()


# --- the engine -------------------------------------------------------------------------------

MAX_TOKENS = 24
POISON_AT = 4
"""A poisoned request's logits turn NaN at its POISON_AT-th token (so it has tokens to keep)."""


@dataclass
class Poison:
    """Request ids whose logits rows turn NaN, and how many rows of each the step has seen."""

    response_ids: set[str]
    seen: dict[str, int]
    raise_for: set[str]
    """Request ids whose presence in a batch makes the step raise (the generation loop dies)."""


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> Poison:
    """Wrap the runner's step (resq's included) with a model whose logits this test spoils."""
    state = Poison(set(), {}, set())
    current: Step = model_runner.ModelRunner._forward_process_and_sample

    def step(
        self: Any,
        model: Any,
        batch_data: dict[str, Any],
        carry_over_ids: torch.Tensor,
        prev_output_ids: torch.Tensor,
        output_ids: torch.Tensor,
    ) -> None:
        row_ids = list(self.inputs_and_outputs.req_id_to_new_token_position)
        if state.raise_for & set(row_ids):
            raise RuntimeError("injected engine failure")
        rows = []
        for row, response_id in enumerate(row_ids):
            state.seen[response_id] = state.seen.get(response_id, 0) + 1
            if response_id in state.response_ids and state.seen[response_id] >= POISON_AT:
                rows.append(row)

        def spoiled(**kwargs: Any) -> Any:
            output = model(**kwargs)
            if rows:
                positions = torch.tensor(rows)
                if "logits_to_keep" not in kwargs:
                    positions = kwargs["logits_indices"][positions]
                output.logits[0, positions] = NAN
            return output

        current(self, spoiled, batch_data, carry_over_ids, prev_output_ids, output_ids)

    # An engine built meanwhile must not wrap resq's step around this one (which it would skip).
    setattr(step, "_resq_step_marks", getattr(current, "_resq_step_marks", frozenset()))  # noqa: B010
    monkeypatch.setattr(model_runner.ModelRunner, "_forward_process_and_sample", step)
    return state


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Settings(model=BUILTIN_MODEL, device="cpu"))


def new_engine(loaded: LoadedModel) -> Engine:
    engine = Engine(loaded, Settings(model=BUILTIN_MODEL, device="cpu", kv_cache_tokens=4096, logprobs=True))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[Engine]:
    started = new_engine(loaded)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def prompt_ids(loaded: LoadedModel) -> list[int]:
    return chat_prompt_ids(loaded, "Describe a zebra in many words.")


def job(response_id: str, prompt_ids: list[int], **options: object) -> GenerationJob:
    return greedy_job(response_id, prompt_ids, MAX_TOKENS, **options)


def run_all(engine: Engine, jobs: list[GenerationJob]) -> dict[str, GenerationOutput]:
    """Run ``jobs`` in one batch; the final output of each."""
    return run_batch(engine, jobs)


def test_tiny_temperatures_decode_greedily(engine: Engine, prompt_ids: list[int]) -> None:
    temperatures = [0.0, 1e-40, 1e-30, GREEDY_BELOW_TEMPERATURE / 2]
    jobs = [job(f"resp_tiny_{i}", prompt_ids, temperature=t) for i, t in enumerate(temperatures)]
    results = run_all(engine, jobs)
    tokens = [results[request.response_id].generated_tokens for request in jobs]
    assert all(output.status == RequestStatus.FINISHED for output in results.values())
    assert tokens[1:] == [tokens[0]] * 3 and len(tokens[0]) == MAX_TOKENS


def test_a_non_finite_request_fails_alone_and_its_batch_goes_on(
    engine: Engine, prompt_ids: list[int], poison: Poison
) -> None:
    neighbours = [
        job("resp_greedy", prompt_ids),
        job("resp_penalised", prompt_ids, frequency_penalty=0.5),
    ]
    alone = {request.response_id: run_all(engine, [request])[request.response_id] for request in neighbours}
    greedy_alone = alone["resp_greedy"].generated_tokens

    poison.response_ids = {"resp_bad_greedy", "resp_bad_hot", "resp_bad_nucleus"}
    spoiled = [
        job("resp_bad_greedy", prompt_ids),
        job("resp_bad_hot", prompt_ids, temperature=1.0),
        job("resp_bad_nucleus", prompt_ids, temperature=0.7, top_p=0.5),
    ]
    results = run_all(engine, [neighbours[0], *spoiled, neighbours[1]])

    for request in neighbours:
        output = results[request.response_id]
        assert output.status == RequestStatus.FINISHED
        assert output.generated_tokens == alone[request.response_id].generated_tokens
        assert len(output.logprobs) == len(output.generated_tokens)
    for request in spoiled:
        output = results[request.response_id]
        assert output.status == RequestStatus.FAILED and output.error == NON_FINITE_ERROR
        # The tokens before the NaN step stay; the flag itself never comes out.
        assert len(output.generated_tokens) == POISON_AT - 1
        assert len(output.logprobs) == POISON_AT - 1
        assert NON_FINITE_TOKEN not in output.generated_tokens
    assert results["resp_bad_greedy"].generated_tokens == greedy_alone[: POISON_AT - 1]
    assert engine.is_running()
    # The engine keeps serving, and forgot the failed requests' state.
    poison.response_ids = set()
    again = run_all(engine, [job("resp_after", prompt_ids)])["resp_after"]
    assert again.generated_tokens == greedy_alone
    assert engine.penalties is not None and len(engine.penalties) == 0


def test_a_dying_generation_loop_fails_no_request_itself(
    loaded: LoadedModel, prompt_ids: list[int], poison: Poison
) -> None:
    doomed = new_engine(loaded)
    try:
        poison.raise_for = {"resp_boom"}
        for request in (
            job("resp_bystander", prompt_ids, max_output_tokens=2000),
            job("resp_boom", prompt_ids),
        ):
            assert doomed.acquire_slot(5)
            doomed.add(request)
        outputs: list[GenerationOutput] = []
        deadline = time.monotonic() + 60
        while doomed.is_running() and time.monotonic() < deadline:
            outputs.extend(doomed.next_outputs(0.2))
        outputs.extend(doomed.next_outputs(0.2))
        assert not doomed.is_running()
        # transformers failed both; those failures are not the requests' own: none comes out.
        assert not [output for output in outputs if output.is_finished()]
    finally:
        doomed.stop(hard=True)


# --- the publisher, once the engine died ---------------------------------------------------------

TTL_S = 600


class DeadEngine:
    """The part of :class:`Engine` the publisher uses, for an engine whose loop died."""

    eos_token_ids = frozenset({2})

    def __init__(self) -> None:
        self.released = 0

    def next_outputs(self, timeout_s: float, quiet_until: float = 0.0) -> list[GenerationOutput]:
        return []

    def is_running(self) -> bool:
        return False

    def forget(self, response_id: str) -> None:
        """Nothing kept per request."""

    def release_slot(self) -> None:
        self.released += 1

    def cancel(self, response_id: str) -> None:
        raise AssertionError("a dead engine's requests are handed back, not cancelled")


def staged(r: redis.Redis, gens: Generations) -> tuple[str, Callable[[TokenPublisher], None]]:
    """A staged, claimed job; and how to start it on a publisher."""
    response_id = "resp_" + uuid.uuid4().hex
    request = GenerationJob(
        response_id=response_id,
        model="m",
        prompt_token_ids=[5, 6, 7],
        max_output_tokens=8,
        temperature=0.0,
        top_p=1.0,
    )
    pipe = r.pipeline(transaction=False)
    generations.stage(pipe, request, TTL_S, int(time.time() * 1000))
    pipe.execute()
    claim = gens.claim(response_id, "gpu-test")
    assert claim.fence is not None
    fence = claim.fence
    plan = plan_resume(request, gens.progress(response_id), frozenset({2}))
    assert isinstance(plan, Plan)
    return response_id, lambda publisher: publisher.start_request(response_id, fence, plan)


def field(r: redis.Redis, response_id: str, name: str) -> str | None:
    value = cast("bytes | None", r.hget(keys.generation(response_id), name))
    return value.decode() if value is not None else None


def run_until_dead(publisher: TokenPublisher) -> None:
    publisher.start()
    deadline = time.monotonic() + 10
    while publisher.fatal_error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert publisher.fatal_error is not None


@pytest.mark.parametrize("max_losses", [3, 1])
def test_a_dead_engines_requests_are_handed_back_as_a_lost_workers(
    redis_client: redis.Redis, max_losses: int
) -> None:
    r = redis_client
    gens = Generations(r, TTL_S)
    engine = DeadEngine()
    dispatched: list[str] = []
    publisher = TokenPublisher(r, cast(Engine, engine), gens, dispatched.append, max_losses=max_losses)
    started = [staged(r, gens) for _ in range(2)]
    for _, start in started:
        start(publisher)
    run_until_dead(publisher)
    ids = [response_id for response_id, _ in started]
    assert publisher.active_count == 0 and engine.released == 2
    for response_id in ids:
        assert field(r, response_id, "owner") == "" and field(r, response_id, "losses") == "1"
        entries = [decode_entry(fields) for _, fields in range_entries(r.xrange(keys.tokens(response_id)))]
        if max_losses > 1:  # resumable: no finish entry, dispatched again
            assert field(r, response_id, "state") == "pending"
            assert not [entry for entry in entries if isinstance(entry, FinishEntry)]
        else:  # lost as often as allowed: it fails, as the reaper would fail it
            assert field(r, response_id, "state") == "failed"
            finish = entries[-1]
            assert isinstance(finish, FinishEntry) and finish.finish_reason == "error"
            assert finish.error is not None and "giving up" in finish.error
    assert dispatched == (ids if max_losses > 1 else [])
