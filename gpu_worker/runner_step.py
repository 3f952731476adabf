"""Wrapping transformers' continuous-batching step, once per concern.

resq changes two things in ``ModelRunner._forward_process_and_sample`` (a private
method of transformers 5.x): logprobs of the raw distribution
(:mod:`gpu_worker.raw_logprobs`) and its own sampling (:mod:`gpu_worker.sampling_step`).
Each wraps the step it finds; this module does the wrapping so that installing a
concern twice (one ``Engine`` per test, say) never stacks a second layer of it,
whatever was wrapped on top since.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.generation.continuous_batching import model_runner

Step = Callable[[Any, Any, dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``(runner, model, batch_data, carry_over_ids, prev_output_ids, output_ids) -> None``."""

_ATTRIBUTE = "_forward_process_and_sample"
_MARKS = "_resq_step_marks"


def wrap_step(mark: str, wrap: Callable[[Step], Step]) -> None:
    """Replace the runner's step with ``wrap(current step)`` unless ``mark`` already wraps it."""
    runner_class = model_runner.ModelRunner
    current: Step = getattr(runner_class, _ATTRIBUTE)
    marks: frozenset[str] = getattr(current, _MARKS, frozenset())
    if mark in marks:
        return
    wrapped = wrap(current)
    setattr(wrapped, _MARKS, marks | {mark})
    setattr(runner_class, _ATTRIBUTE, wrapped)
