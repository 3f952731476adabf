"""A request's ``temperature`` and ``top_p``: what it sent, else the model's recommendation, else 1.0.

The model's recommendation comes from its card (the GPU worker reads it from the model's
``generation_config.json``: :mod:`gpu_worker.sampling_defaults`, ``RESQ_SAMPLING_DEFAULTS``).
Each of the two is chosen on its own: a request that sends only ``top_p`` keeps the model's
``temperature``. The Response echoes what was used.
"""

from __future__ import annotations

from dataclasses import dataclass

from resq.catalog import ModelCard

OPENAI_TEMPERATURE = 1.0
OPENAI_TOP_P = 1.0


@dataclass(frozen=True)
class Sampling:
    """The ``temperature`` and ``top_p`` a response is generated with."""

    temperature: float
    top_p: float


OPENAI_SAMPLING = Sampling(OPENAI_TEMPERATURE, OPENAI_TOP_P)
"""OpenAI's defaults: what a request that sets neither gets from a model that recommends neither."""


def request_sampling(temperature: float | None, top_p: float | None, card: ModelCard) -> Sampling:
    """The values a request asking for ``temperature`` and ``top_p`` (None: unset) is sampled with."""
    if temperature is None:
        temperature = OPENAI_TEMPERATURE if card.default_temperature is None else card.default_temperature
    if top_p is None:
        top_p = OPENAI_TOP_P if card.default_top_p is None else card.default_top_p
    return Sampling(temperature=temperature, top_p=top_p)
