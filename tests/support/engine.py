"""Driving a GPU worker's :class:`~gpu_worker.engine.Engine` directly in unit tests: one batch of jobs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from transformers.generation.continuous_batching.requests import GenerationOutput

from gpu_worker.engine import Engine
from gpu_worker.model_loading import LoadedModel
from resq.settings import Settings
from resq.wire import GenerationJob


@contextmanager
def started_engine(loaded: LoadedModel, settings: Settings) -> Iterator[Engine]:
    """An :class:`Engine` of ``loaded`` under ``settings``, started, and stopped on the way out."""
    engine = Engine(loaded, settings)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def greedy_job(response_id: str, prompt_ids: list[int], budget: int, **fields: Any) -> GenerationJob:
    """A greedy job of ``prompt_ids`` for ``budget`` tokens (``fields`` override any job field)."""
    values: dict[str, Any] = {
        "max_output_tokens": budget,
        "temperature": 0.0,
        "top_p": 1.0,
        **fields,
    }
    return GenerationJob.model_validate(
        {"response_id": response_id, "model": "fixture", "prompt_token_ids": prompt_ids, **values}
    )


def chat_prompt_ids(loaded: LoadedModel, text: str) -> list[int]:
    """The token ids of one user message ``text`` through the model's chat template."""
    messages = [{"role": "user", "content": text}]
    rendered = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(rendered, str)
    return list(loaded.tokenizer(rendered, add_special_tokens=False)["input_ids"])


def run_batch(
    engine: Engine,
    jobs: list[GenerationJob],
    generated: dict[str, list[int]] | None = None,
    timeout_s: float = 120,
) -> dict[str, GenerationOutput]:
    """Run ``jobs`` in one batch (``generated``: the tokens each replays); the final output of each.

    Stops early if the engine stops; whatever did not finish is cancelled and left out.
    """
    for job in jobs:
        assert engine.acquire_slot(5)
        engine.add(job, (generated or {}).get(job.response_id))
    results: dict[str, GenerationOutput] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(jobs) and time.monotonic() < deadline and engine.is_running():
            for output in engine.next_outputs(0.5):
                if output.is_finished():
                    results[output.request_id] = output
                    engine.forget(output.request_id)
                    engine.release_slot()
    finally:
        for job in jobs:
            if job.response_id not in results:
                engine.cancel(job.response_id)
                engine.release_slot()
    return results


def batch_tokens(
    engine: Engine,
    jobs: list[GenerationJob],
    generated: dict[str, list[int]] | None = None,
    timeout_s: float = 120,
) -> dict[str, list[int]]:
    """:func:`run_batch`, every job required to finish: the tokens each generated."""
    results = run_batch(engine, jobs, generated, timeout_s)
    assert len(results) == len(jobs), "some generations did not finish"
    return {request_id: list(output.generated_tokens) for request_id, output in results.items()}
