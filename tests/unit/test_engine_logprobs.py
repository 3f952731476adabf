"""The GPU worker's engine on the fixture model (CPU): sampling, raw-distribution logprobs, per-request stops."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from transformers.generation.continuous_batching.requests import GenerationOutput

from gpu_worker.engine import Engine
from gpu_worker.model_loading import LoadedModel, load_model
from gpu_worker.raw_logprobs import chosen_token_logprobs
from resq.settings import Settings
from resq.wire import GenerationJob
from tests.fixture_model import ensure_fixture_model, scenario
from tests.fixture_model.build import _prompt_ids
from tests.support.engine import started_engine


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Settings(model=str(ensure_fixture_model()), device="cpu"))


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[Engine]:
    settings = Settings(model=str(ensure_fixture_model()), device="cpu", kv_cache_tokens=4096, logprobs=True)
    with started_engine(loaded, settings) as started:
        yield started


def prompt(loaded: LoadedModel, name: str) -> list[int]:
    return _prompt_ids(loaded.tokenizer, scenario(name))  # type: ignore[arg-type]


def free_prompt(loaded: LoadedModel) -> list[int]:
    """A prompt the fixture was not trained on: its continuation is far from certain."""
    messages = [{"role": "user", "content": "Describe a zebra in many words."}]
    text = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    return list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])


def job(response_id: str, prompt_ids: list[int], **options: object) -> GenerationJob:
    fields: dict[str, object] = {"max_output_tokens": 40, "temperature": 0.0, "top_p": 1.0, **options}
    return GenerationJob.model_validate(
        {"response_id": response_id, "model": "fixture", "prompt_token_ids": prompt_ids, **fields}
    )


def generate(engine: Engine, job: GenerationJob, timeout_s: float = 120) -> GenerationOutput:
    assert engine.acquire_slot(5)
    try:
        engine.add(job)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for output in engine.next_outputs(0.5):
                if output.request_id == job.response_id and output.is_finished():
                    return output
        raise TimeoutError(job.response_id)
    finally:
        engine.release_slot()


def reference_logprobs(loaded: LoadedModel, prompt_ids: list[int], generated: list[int]) -> list[float]:
    """The model's own log-probabilities of ``generated`` after ``prompt_ids``, by one forward pass."""
    ids = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        logits = loaded.model(input_ids=ids).logits[0].float()
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(generated)]
    return torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(generated)[:, None]).squeeze(1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_the_models_not_the_samplers(
    engine: Engine, loaded: LoadedModel, temperature: float
) -> None:
    prompt_ids = free_prompt(loaded)
    output = generate(
        engine,
        job(f"resp_logprobs_{temperature}", prompt_ids, temperature=temperature, top_p=0.5, logprobs=True),
    )
    generated = list(output.generated_tokens)
    assert len(output.logprobs) == len(generated) > 5
    expected = reference_logprobs(loaded, prompt_ids, generated)
    assert output.logprobs == pytest.approx(expected, abs=2e-3)
    # The sampler's own distribution (top-k 1 when greedy, a narrow nucleus otherwise) would make
    # every token read 0.0; the model is not that sure of all of this free continuation.
    assert min(output.logprobs) < -0.1


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_top_logprobs_are_the_models_most_likely_tokens(
    engine: Engine, loaded: LoadedModel, temperature: float
) -> None:
    """Each position's alternatives are ``topk(log_softmax(logits))`` of a plain forward pass, the
    sampler's settings aside; a neighbour asking for fewer (and one asking for none) run beside."""
    prompt_ids = free_prompt(loaded)
    asked = job(
        f"resp_top_{temperature}",
        prompt_ids,
        temperature=temperature,
        top_p=0.5,
        logprobs=True,
        top_logprobs=5,
    )
    fewer = job(f"resp_top_fewer_{temperature}", prompt_ids, logprobs=True, top_logprobs=2)
    for neighbour in (fewer, job(f"resp_top_none_{temperature}", prompt_ids, logprobs=True)):
        assert engine.acquire_slot(5)
        engine.add(neighbour)
    try:
        output = generate(engine, asked)
    finally:
        for _ in range(2):
            engine.release_slot()
    generated = list(output.generated_tokens)
    alternatives = engine.alternatives(asked.response_id, 0, len(generated))
    assert alternatives is not None and len(alternatives) == len(generated) > 5
    ids = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        logits = loaded.model(input_ids=ids).logits[0].float()
    rows = torch.log_softmax(logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(generated)], dim=-1)
    expected_values, _ = torch.topk(rows, 5, dim=-1)
    for position, found in enumerate(alternatives):
        # The top five values, each the reference's own for its token (a batch of another shape
        # may round two near-equal alternatives into the other order, so ids are not compared
        # by rank).
        assert [value for _, value in found] == pytest.approx(expected_values[position].tolist(), abs=2e-3)
        assert [value for _, value in found] == pytest.approx(
            [rows[position, token].item() for token, _ in found], abs=2e-3
        ), position
        assert len({token for token, _ in found}) == 5
        assert output.logprobs[position] <= found[0][1] + 1e-4
    # Dropped once published: the publisher asks from what it has published.
    assert engine.alternatives(asked.response_id, len(generated), len(generated)) == []
    assert engine.alternatives(asked.response_id, 0, 1) is None
    for neighbour in (fewer.response_id, f"resp_top_none_{temperature}"):
        engine.cancel(neighbour)


def test_chosen_token_logprobs_equal_log_softmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([4, 0, 49], dtype=torch.int32)
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(3), tokens.long()]
    assert torch.allclose(chosen_token_logprobs(logits, tokens), expected, atol=1e-6)


def test_a_request_stop_token_ends_generation_there(engine: Engine, loaded: LoadedModel) -> None:
    close = loaded.tokenizer.convert_tokens_to_ids("</tool_call>")
    assert isinstance(close, int)
    prompt_ids = prompt(loaded, "two_tool_calls")
    free = generate(engine, job("resp_free", prompt_ids, max_output_tokens=200))
    assert free.generated_tokens.count(close) == 2
    stopping = job("resp_stopped", prompt_ids, max_output_tokens=200, stop_token_ids=[close])
    stopped = generate(engine, stopping)
    assert stopped.generated_tokens[-1] == close
    assert stopped.generated_tokens == free.generated_tokens[: len(stopped.generated_tokens)]
    assert engine.end_tokens(stopping) == sorted(engine.eos_token_ids | {close})


def test_the_engine_samples_with_resqs_step(engine: Engine) -> None:
    # transformers' processor list was the expected one, so its processors never run.
    assert engine.fused_sampling


def test_greedy_generation_repeats_itself_and_is_the_models_argmax(
    engine: Engine, loaded: LoadedModel
) -> None:
    prompt_ids = free_prompt(loaded)
    first = generate(engine, job("resp_greedy_1", prompt_ids, max_output_tokens=24))
    second = generate(engine, job("resp_greedy_2", prompt_ids, max_output_tokens=24))
    assert first.generated_tokens == second.generated_tokens
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(len(first.generated_tokens)):
            ids.append(int(loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert first.generated_tokens == ids[len(prompt_ids) :]


def test_each_request_keeps_its_own_sampling_settings_in_a_shared_batch(
    engine: Engine, loaded: LoadedModel
) -> None:
    prompt_ids = free_prompt(loaded)
    greedy = generate(engine, job("resp_alone", prompt_ids, max_output_tokens=24)).generated_tokens
    together = {
        "resp_mix_greedy": job("resp_mix_greedy", prompt_ids, max_output_tokens=24),
        # A nucleus of (almost) nothing leaves the argmax, whatever the temperature.
        "resp_mix_narrow": job(
            "resp_mix_narrow", prompt_ids, max_output_tokens=24, temperature=1.5, top_p=1e-6
        ),
        "resp_mix_hot": job("resp_mix_hot", prompt_ids, max_output_tokens=24, temperature=2.0, top_p=1.0),
    }
    finished: dict[str, GenerationOutput] = {}
    for _ in together:
        assert engine.acquire_slot(5)
    try:
        for request in together.values():
            engine.add(request)
        deadline = time.monotonic() + 120
        while len(finished) < len(together) and time.monotonic() < deadline:
            for output in engine.next_outputs(0.5):
                if output.request_id in together and output.is_finished():
                    finished[output.request_id] = output
    finally:
        for _ in together:
            engine.release_slot()
    assert finished["resp_mix_greedy"].generated_tokens == greedy
    assert finished["resp_mix_narrow"].generated_tokens == greedy
    # At temperature 2 over the whole vocabulary, 24 tokens do not follow the argmax.
    assert finished["resp_mix_hot"].generated_tokens != greedy
