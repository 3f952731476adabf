"""A model's recommended sampling, end to end: the GPU worker reads the model's
``generation_config.json``, its card carries the values, and the API samples a request that sets
no ``temperature`` or ``top_p`` with them and echoes them in the Response.

The model is the fixture model with a ``generation_config.json`` recommending 0.6 and 0.9, served
on a Redis of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.e2e.conftest import Stack, stack_on_own_redis

pytestmark = pytest.mark.e2e

RECOMMENDING = "fixture-recommends"
RECOMMENDED_TEMPERATURE = 0.6
RECOMMENDED_TOP_P = 0.9


@pytest.fixture(scope="module")
def recommending_model_dir(fixture_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture model's files, linked, with a generation_config.json that recommends sampling."""
    copy = tmp_path_factory.mktemp("recommending-model")
    for entry in fixture_model_dir.iterdir():
        if entry.name != "generation_config.json":
            (copy / entry.name).symlink_to(entry)
    config = json.loads((fixture_model_dir / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=RECOMMENDED_TEMPERATURE, top_p=RECOMMENDED_TOP_P)
    (copy / "generation_config.json").write_text(json.dumps(config))
    return copy


@pytest.fixture(scope="module")
def recommending_stack(
    recommending_model_dir: Path,
    base_env: dict[str, str],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """A GPU worker on that model and an API post-processing inline, on a private Redis."""
    env = {**base_env, "RESQ_MODEL": str(recommending_model_dir)}
    redis_dir = tmp_path_factory.mktemp("sampling-redis")
    with stack_on_own_redis(env, log_dir, redis_dir, RECOMMENDING, "recommends", 0) as stack:
        yield stack


@pytest.fixture
def recommending(recommending_stack: Stack) -> OpenAI:
    return recommending_stack.client()


def test_a_request_that_sets_neither_is_sampled_as_the_model_recommends(recommending: OpenAI) -> None:
    response = recommending.responses.create(model=RECOMMENDING, input="Say hello.", max_output_tokens=4)
    assert (response.temperature, response.top_p) == (RECOMMENDED_TEMPERATURE, RECOMMENDED_TOP_P)
    stored = recommending.responses.retrieve(response.id)
    assert (stored.temperature, stored.top_p) == (RECOMMENDED_TEMPERATURE, RECOMMENDED_TOP_P)


def test_what_a_request_sets_wins(recommending: OpenAI) -> None:
    only_top_p = recommending.responses.create(
        model=RECOMMENDING, input="Say hello.", max_output_tokens=4, top_p=0.5
    )
    assert (only_top_p.temperature, only_top_p.top_p) == (RECOMMENDED_TEMPERATURE, 0.5)
    greedy = recommending.responses.create(
        model=RECOMMENDING, input="Say hello.", max_output_tokens=4, temperature=0
    )
    assert (greedy.temperature, greedy.top_p) == (0, RECOMMENDED_TOP_P)


def test_a_stream_shows_the_values_from_its_first_event(recommending: OpenAI) -> None:
    with recommending.responses.stream(model=RECOMMENDING, input="Say hello.", max_output_tokens=4) as stream:
        events = list(stream)
    created = events[0]
    assert created.type == "response.created"
    assert (created.response.temperature, created.response.top_p) == (
        RECOMMENDED_TEMPERATURE,
        RECOMMENDED_TOP_P,
    )


def test_the_suites_model_recommends_nothing(client: OpenAI) -> None:
    response = client.responses.create(model="fixture", input="Say hello.", max_output_tokens=4)
    assert (response.temperature, response.top_p) == (1.0, 1.0)
