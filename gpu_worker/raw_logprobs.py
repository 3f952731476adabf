"""Logprobs of the model's own distribution, from transformers' continuous batching.

With ``ContinuousBatchingConfig(return_logprobs=True)`` the engine reports the
sampled token's log-probability under the *processed* distribution: after the
per-request temperature, top-k and top-p processors. resq samples greedily with
top-k = 1 (the engine's argmax switch is global), so every greedy token would
read ``0.0``, and sampled ones would depend on temperature and the nucleus.
OpenAI (and vLLM's default ``raw_logprobs``) report the model's distribution.

:func:`install` wraps ``ModelRunner._forward_process_and_sample``: the model's
logits are captured on their way into the original step, and once the step has
sampled, the logprob row it wrote is replaced with
``log_softmax(logits)[token]`` over the raw logits (in float32), on the device,
inside the same (possibly graph-captured) step. (The fused log-softmax kernel is
four times faster on CPU than ``logit - logsumexp``, which takes several passes.)
It relies on the runner's layout (``output_ids`` row 1 holds the
float32 logprobs as int32 bits, one column per sampled token), which
``tests/unit/test_engine_logprobs.py`` checks against a plain forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpu_worker.runner_step import Step, wrap_step

_MARK = "_resq_raw_logprobs"


class _LogitsTap:
    """Calls the model and keeps the logits of its last call."""

    def __init__(self, model: Callable[..., Any]) -> None:
        self._model = model
        self.logits: torch.Tensor | None = None

    def __call__(self, **kwargs: Any) -> Any:
        output = self._model(**kwargs)
        self.logits = output.logits
        return output


def raw_distribution(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)`` per row, in float32: the model's own log-probabilities."""
    return torch.log_softmax(logits.float(), dim=-1)


def chosen_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[row, tokens[row]]`` per row (float32)."""
    return token_logprobs(raw_distribution(logits), tokens)


def token_logprobs(distribution: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``distribution[row, tokens[row]]`` per row, ``distribution`` from :func:`raw_distribution`."""
    return distribution.gather(1, tokens.long().unsqueeze(1)).squeeze(1)


def install() -> None:
    """Make every continuous-batching runner report raw-logit logprobs (idempotent)."""

    def wrap(original: Step) -> Step:
        def forward_process_and_sample(
            self: Any,
            model: Any,
            batch_data: dict[str, Any],
            carry_over_ids: torch.Tensor,
            prev_output_ids: torch.Tensor,
            output_ids: torch.Tensor,
        ) -> None:
            if not self.return_logprobs:
                original(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids)
                return
            tap = _LogitsTap(model)
            original(self, tap, batch_data, carry_over_ids, prev_output_ids, output_ids)
            logits = tap.logits
            assert logits is not None, "the continuous-batching step did not call the model"
            if "logits_to_keep" not in batch_data:
                logits = logits[:, batch_data["logits_indices"], :]
            rows = logits[0]
            count = rows.shape[0]
            logprobs = chosen_token_logprobs(rows, output_ids[0, :count])
            output_ids[1, :count].copy_(logprobs.view(dtype=torch.int32))

        return forward_process_and_sample

    wrap_step(_MARK, wrap)
