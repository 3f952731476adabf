"""The sampling a model's authors recommend, from its ``generation_config.json``.

Models ship the ``temperature`` and ``top_p`` they are meant to be sampled with (Qwen3:
0.6 and 0.95 when thinking; Llama 3 Instruct: 0.6 and 0.9). Agent clients often send
neither: Codex never sends ``temperature``, and the Vercel AI SDK leaves it out for a
reasoning model, as OpenAI's reasoning models refuse it. With ``RESQ_SAMPLING_DEFAULTS=model`` such a request
gets the model's values instead of OpenAI's 1.0, as vLLM does by default
(``--generation-config auto``). The GPU worker puts them on the model card; the API applies
them to requests that set none and echoes the values used in the Response.

Only values the model's files set away from transformers' defaults count (its
``generation_config.json``, or the generation parameters an older ``config.json`` carries,
which transformers then reads instead). ``do_sample`` is not read, as vLLM does not: a
request is sampled at its temperature either way, and 0 is greedy.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger(__name__)

MAX_TEMPERATURE = 2.0
"""The API's bound on a request's ``temperature``: a recommendation above it is not used."""


@dataclass(frozen=True)
class RecommendedSampling:
    """``temperature`` and ``top_p`` for requests that set none (None: the API's 1.0)."""

    temperature: float | None = None
    top_p: float | None = None


def recommended_sampling(
    generation_config: Any, source: Literal["model", "openai"] = "model"
) -> RecommendedSampling:
    """What ``generation_config`` (a transformers ``GenerationConfig``, or None) recommends.

    ``source`` ``openai`` (``RESQ_SAMPLING_DEFAULTS``): nothing, whatever the model says. A
    value out of the range a request may ask for is left out, with a warning.
    """
    if source == "openai" or generation_config is None:
        return RecommendedSampling()
    set_values: dict[str, Any] = generation_config.to_diff_dict()
    temperature = _number(set_values.get("temperature"))
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        log.warning("generation_config.json's temperature %s is out of [0, 2]; not used", temperature)
        temperature = None
    top_p = _number(set_values.get("top_p"))
    if top_p is not None and not 0 < top_p <= 1:
        log.warning("generation_config.json's top_p %s is out of (0, 1]; not used", top_p)
        top_p = None
    return RecommendedSampling(temperature=temperature, top_p=top_p)


def _number(value: Any) -> float | None:
    # bool is an int: a `true` there is no temperature.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)
