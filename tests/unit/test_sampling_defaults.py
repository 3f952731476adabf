"""A model's recommended sampling: read from its generation_config.json, applied to requests that set none."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import GenerationConfig

from api.sampling import OPENAI_SAMPLING, Sampling, request_sampling
from gpu_worker.model_loading import load_model, resolve_model_dir
from gpu_worker.sampling_defaults import RecommendedSampling, recommended_sampling
from resq.catalog import ModelCard
from resq.settings import BUILTIN_MODEL, Settings


def test_a_model_that_sets_them_recommends_its_values() -> None:
    config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    assert recommended_sampling(config) == RecommendedSampling(temperature=0.6, top_p=0.95)


def test_a_model_that_sets_one_recommends_that_one() -> None:
    config = GenerationConfig(do_sample=True, top_p=0.8)
    assert recommended_sampling(config) == RecommendedSampling(temperature=None, top_p=0.8)


def test_transformers_defaults_recommend_nothing() -> None:
    assert recommended_sampling(GenerationConfig()) == RecommendedSampling()
    assert recommended_sampling(None) == RecommendedSampling()


def test_openai_defaults_ignore_the_model() -> None:
    config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95)
    assert recommended_sampling(config, "openai") == RecommendedSampling()


class _SetValues:
    """A generation config whose set values are given as they are (transformers validates its own)."""

    def __init__(self, **values: Any) -> None:
        self._values = values

    def to_diff_dict(self) -> dict[str, Any]:
        return dict(self._values)


@pytest.mark.parametrize(
    "values",
    [
        {"temperature": 2.5, "top_p": 0.0},
        {"temperature": -0.1, "top_p": 1.5},
        {"temperature": float("nan"), "top_p": float("inf")},
        {"temperature": True, "top_p": "0.9"},
    ],
)
def test_values_a_request_could_not_ask_for_are_not_used(
    values: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert recommended_sampling(_SetValues(**values)) == RecommendedSampling()


def test_greedy_is_a_recommendation_like_any_other() -> None:
    assert recommended_sampling(_SetValues(temperature=0, top_p=1)) == RecommendedSampling(0.0, 1.0)


# --- the model card, from the real loading code ------------------------------------------------


@pytest.fixture(scope="module")
def recommending_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model, copied with a generation_config.json that recommends 0.7 and 0.8."""
    source = resolve_model_dir(Settings(model=BUILTIN_MODEL))
    copy = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(source, copy)
    config_path = copy / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update(do_sample=True, temperature=0.7, top_p=0.8)
    config_path.write_text(json.dumps(config))
    return copy


def test_the_loaded_models_card_carries_its_recommendation(recommending_model: Path) -> None:
    card = load_model(Settings(model=str(recommending_model), device="cpu")).card
    assert (card.default_temperature, card.default_top_p) == (0.7, 0.8)


def test_the_card_carries_none_with_openai_defaults(recommending_model: Path) -> None:
    settings = Settings(model=str(recommending_model), device="cpu", sampling_defaults="openai")
    card = load_model(settings).card
    assert (card.default_temperature, card.default_top_p) == (None, None)


def test_a_model_without_a_recommendation_has_none_on_its_card() -> None:
    card = load_model(Settings(model=BUILTIN_MODEL, device="cpu")).card
    assert (card.default_temperature, card.default_top_p) == (None, None)


# --- the API's choice ---------------------------------------------------------------------------


def _card(temperature: float | None, top_p: float | None) -> ModelCard:
    return ModelCard(
        name="m",
        context_length=128,
        chat_template="",
        special_tokens={},
        eos_token_ids=[0],
        tokenizer_sha256="0" * 64,
        created=0,
        source="m",
        default_temperature=temperature,
        default_top_p=top_p,
    )


def test_a_request_that_sets_neither_gets_the_models_values() -> None:
    assert request_sampling(None, None, _card(0.6, 0.95)) == Sampling(0.6, 0.95)


def test_what_a_request_sets_wins_each_on_its_own() -> None:
    card = _card(0.6, 0.95)
    assert request_sampling(0.0, None, card) == Sampling(0.0, 0.95)
    assert request_sampling(None, 0.5, card) == Sampling(0.6, 0.5)
    assert request_sampling(1.2, 0.3, card) == Sampling(1.2, 0.3)


def test_a_model_that_recommends_nothing_gets_openais_defaults() -> None:
    assert request_sampling(None, None, _card(None, None)) == OPENAI_SAMPLING
    assert request_sampling(None, None, _card(None, 0.9)) == Sampling(1.0, 0.9)
