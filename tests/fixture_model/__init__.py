"""A tiny trained causal LM that answers fixed scenarios exactly, for end-to-end tests.

``ensure_fixture_model()`` builds it once (about a minute on two CPU cores) and caches it;
``SCENARIOS`` lists the conversations and the exact greedy completions it produces.
:mod:`tests.fixture_model.long_context` builds a second one, with a 32k context, for Codex CLI.
"""

from tests.fixture_model.build import ADDED_TOKENS, SPECIAL_TOKENS, FixtureBuildError, ensure_fixture_model
from tests.fixture_model.scenarios import (
    ENDLESS_MIN_TOKENS,
    GET_WEATHER_TOOL,
    SCENARIOS,
    TOOL_VARIANTS,
    Scenario,
    scenario,
    variants,
)

__all__ = [
    "ADDED_TOKENS",
    "ENDLESS_MIN_TOKENS",
    "GET_WEATHER_TOOL",
    "SCENARIOS",
    "SPECIAL_TOKENS",
    "TOOL_VARIANTS",
    "FixtureBuildError",
    "Scenario",
    "ensure_fixture_model",
    "scenario",
    "variants",
]
