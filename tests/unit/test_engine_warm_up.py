"""The GPU worker's engine warms up with one short request before any job, and leaves nothing behind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpu_worker.engine import WARM_UP_REQUEST_ID, Engine
from gpu_worker.model_loading import LoadedModel, load_model
from resq.settings import Settings
from tests.fixture_model import ensure_fixture_model
from tests.support.engine import batch_tokens, chat_prompt_ids, greedy_job, started_engine


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Settings(model=str(ensure_fixture_model()), device="cpu"))


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[Engine]:
    settings = Settings(model=str(ensure_fixture_model()), device="cpu", kv_cache_tokens=4096, max_batch=4)
    with started_engine(loaded, settings) as started:
        yield started


def test_the_warm_up_runs_a_request_to_its_end_and_frees_its_slot(
    engine: Engine, loaded: LoadedModel
) -> None:
    assert engine.warm_up(timeout_s=60)
    # Nothing of it is left for the publisher: no output, and every slot free.
    assert [output for output in engine.next_outputs(0.2) if output.request_id == WARM_UP_REQUEST_ID] == []
    assert all(engine.acquire_slot(0) for _ in range(engine.max_batch))
    for _ in range(engine.max_batch):
        engine.release_slot()
    # The engine then generates as before.
    job = greedy_job("resp_after_warm_up", chat_prompt_ids(loaded, "Describe a zebra in many words."), 5)
    assert len(batch_tokens(engine, [job])["resp_after_warm_up"]) == 5


def test_a_warm_up_that_finds_no_slot_does_not_run(engine: Engine) -> None:
    held = [engine.acquire_slot(0) for _ in range(engine.max_batch)]
    try:
        assert all(held)
        assert not engine.warm_up(timeout_s=5)
    finally:
        for _ in held:
            engine.release_slot()
