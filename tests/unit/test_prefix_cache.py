"""Prefix caching on the fixture model (CPU): the engine reuses a shared prompt prefix, and what it
reports reused is what it skipped; with ``RESQ_PREFIX_CACHING=false`` nothing is."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from gpu_worker.engine import Engine
from gpu_worker.model_loading import LoadedModel, load_model
from resq.settings import Settings
from resq.wire import GenerationJob
from tests.fixture_model import ensure_fixture_model
from tests.support.engine import chat_prompt_ids, greedy_job, started_engine

PAGE = 16


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Settings(model=str(ensure_fixture_model()), device="cpu"))


def engine_with(loaded: LoadedModel, prefix_caching: bool) -> Engine:
    settings = Settings(
        model=str(ensure_fixture_model()),
        device="cpu",
        kv_cache_tokens=4096,
        kv_page_size=PAGE,
        prefix_caching=prefix_caching,
    )
    engine = Engine(loaded, settings)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def caching(loaded: LoadedModel) -> Iterator[Engine]:
    engine = engine_with(loaded, True)
    try:
        yield engine
    finally:
        engine.stop()


def reused_by(engine: Engine, request_id: str, prompt_ids: list[int], owner: str = "") -> int:
    """Generate 4 tokens of ``prompt_ids`` for ``owner``; the prompt tokens the engine reported reused."""
    assert engine.acquire_slot(5)
    engine.add(greedy_job(request_id, prompt_ids, 4, cache_owner=owner))
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if any(
                output.request_id == request_id and output.is_finished()
                for output in engine.next_outputs(0.5)
            ):
                return engine.cached_tokens(request_id)
        raise AssertionError(f"{request_id} did not finish")
    finally:
        engine.forget(request_id)
        engine.release_slot()


def test_a_shared_prefix_is_reused_in_whole_pages(caching: Engine, loaded: LoadedModel) -> None:
    shared = "Session notes: " + " ".join(f"item{index}" for index in range(60))
    first = chat_prompt_ids(loaded, shared + " First question?")
    second = chat_prompt_ids(loaded, shared + " Second question?")
    common = next(index for index, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert common >= 4 * PAGE
    assert reused_by(caching, "resp_first", first) == 0
    reused = reused_by(caching, "resp_second", second)
    # Whole pages of the common prefix, never the whole prompt.
    assert reused % PAGE == 0 and (common // PAGE - 1) * PAGE <= reused <= common < len(second)
    # Forgotten with the request.
    assert caching.cached_tokens("resp_second") == 0


def test_blocks_are_shared_within_one_key_only(caching: Engine, loaded: LoadedModel) -> None:
    """Another key's hit told it that a prompt of this key's had been sent, a page at a time."""
    secret = chat_prompt_ids(loaded, "Private notes: " + " ".join(f"secret{index}" for index in range(60)))
    assert reused_by(caching, "resp_alice", secret, owner="alice") == 0
    assert reused_by(caching, "resp_mallory", secret, owner="mallory") == 0
    assert reused_by(caching, "resp_no_key", secret) == 0  # no key: its own space too
    again = reused_by(caching, "resp_alice_again", secret, owner="alice")
    assert again >= len(secret) - 2 * PAGE  # the key's own turns still hit


def test_an_unrelated_prompt_reuses_nothing(caching: Engine, loaded: LoadedModel) -> None:
    assert (
        reused_by(caching, "resp_unrelated", chat_prompt_ids(loaded, "Completely different words here.")) == 0
    )


def test_without_prefix_caching_nothing_is_reused(loaded: LoadedModel) -> None:
    engine = engine_with(loaded, False)
    try:
        prompt = chat_prompt_ids(loaded, "Repeated: " + " ".join(f"word{index}" for index in range(60)))
        assert reused_by(engine, "resp_once", prompt) == 0
        assert reused_by(engine, "resp_twice", prompt) == 0
    finally:
        engine.stop()


def finish(engine: Engine, job: GenerationJob) -> list[int]:
    """Run ``job`` to its end; the tokens it generated."""
    assert engine.acquire_slot(5)
    engine.add(job)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            for output in engine.next_outputs(0.5):
                if output.request_id == job.response_id and output.is_finished():
                    return list(output.generated_tokens)
        raise AssertionError(f"{job.response_id} did not finish")
    finally:
        engine.forget(job.response_id)
        engine.release_slot()


def test_a_prefill_only_job_leaves_its_prompt_pages_to_the_next_turn(
    caching: Engine, loaded: LoadedModel
) -> None:
    """A prewarm (``prefill_only``, two steps whatever it samples) leaves its prompt's pages; a job the
    engine ended in the step that computed its prompt leaves none (transformers 5.25 registers a page
    after its step, and skips a request that step finished: why a prewarm runs two)."""
    for name, prefill_only, tokens in (("one_step", False, 1), ("prewarm", True, 2)):
        shared = f"{name}: " + " ".join(f"rule{index}" for index in range(60))
        warm = greedy_job(f"resp_{name}", chat_prompt_ids(loaded, shared + " Ready?"), tokens)
        generated = finish(caching, warm.model_copy(update={"prefill_only": prefill_only}))
        assert len(generated) == tokens
        reused = reused_by(caching, f"resp_{name}_next", chat_prompt_ids(loaded, shared + " Go on."))
        assert (reused > 0) == prefill_only, (name, reused)


def test_a_full_cache_evicts_the_prompts_used_longest_ago(loaded: LoadedModel) -> None:
    """An agent's history, resent every other request while new prompts fill a cache too small for
    them all, hits on every turn; the new prompt sent first, unused since, made room. transformers
    evicted every cached block at once when a prompt did not fit (or free room fell under its
    margin), the agent's history with them: its turn after each such eviction computed it all
    again (every other turn here)."""
    settings = Settings(
        model=str(ensure_fixture_model()), device="cpu", kv_cache_tokens=1024, kv_page_size=PAGE
    )
    with started_engine(loaded, settings) as engine:
        agent = chat_prompt_ids(
            loaded, "Agent history: " + " ".join(f"step{k} did {k * 5}" for k in range(30))
        )
        others = [
            chat_prompt_ids(
                loaded, f"Record {index}: " + " ".join(f"item{index}-{k} costs {k * 3}" for k in range(30))
            )
            for index in range(10)
        ]
        # Ten prompts of 18+ pages each, and the agent's: several times the cache's 64 pages.
        assert all(len(prompt) > 18 * PAGE for prompt in others)
        assert reused_by(engine, "agent-0", agent) == 0
        whole_pages = len(agent) // PAGE * PAGE
        for index, prompt in enumerate(others):
            assert reused_by(engine, f"other-{index}", prompt) == 0
            assert reused_by(engine, f"agent-{index + 1}", agent) >= whole_pages - PAGE
        assert reused_by(engine, "other-0-again", others[0]) == 0
