"""The continuous-batching step is wrapped once per concern, however often engines are built."""

from __future__ import annotations

from transformers.generation.continuous_batching import model_runner

from gpu_worker import raw_logprobs, sampling_step


def test_installing_both_wrappers_again_adds_no_layer() -> None:
    raw_logprobs.install()
    sampling_step.install()
    installed = model_runner.ModelRunner._forward_process_and_sample
    # What a second Engine in the same process does: raw logprobs is no longer the outer layer.
    raw_logprobs.install()
    sampling_step.install()
    assert model_runner.ModelRunner._forward_process_and_sample is installed
