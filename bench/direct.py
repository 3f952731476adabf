"""The direct-engine baseline: the GPU worker's engine in-process, no Redis, no HTTP, no queue.

Run as ``python -m bench.direct`` with the same ``RESQ_*`` settings as the GPU
worker: it loads the model the same way, builds the same :class:`Engine`
(transformers continuous batching, same cache and batch sizes, same
per-request sampling), then answers JSON-line commands on stdin, one result
line on stdout per command. It renders prompts with resq's own chat template,
so it decodes exactly the prompt ids the API would send.

With ``--upstream`` it drives transformers' own continuous batching instead
(:class:`UpstreamEngine`): the same model, cache and batch sizes, greedy through
transformers' generation config, and none of the GPU worker's changes to the step
(its sampling step, raw logprobs, prefix-cache accounting), so the bench measures
both what the queue costs and what resq's engine changes gain.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.requests import GenerationOutput

    from gpu_worker.model_loading import LoadedModel
    from resq.settings import Settings
    from resq.wire import GenerationJob

RESULT_PREFIX = "BENCH-RESULT "


@dataclass
class _Timing:
    added: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    finished: bool = False


class UpstreamEngine:
    """transformers' continuous batching as it ships: what the direct loop needs of an engine.

    Built without :class:`gpu_worker.engine.Engine`, whose construction installs resq's
    step wrappers; nothing here imports them. Every request is greedy, as the bench's are.
    """

    def __init__(self, loaded: LoadedModel, settings: Settings) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self._slots = threading.BoundedSemaphore(settings.max_batch)
        generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,
            max_new_tokens=settings.default_max_output_tokens,
            eos_token_id=list(loaded.card.eos_token_ids) or -1,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
        cache_tokens = settings.kv_cache_tokens or 16384
        batching = ContinuousBatchingConfig(
            page_size=settings.kv_page_size,
            num_blocks=-(-cache_tokens // settings.kv_page_size),
            max_batch_tokens=settings.max_batch_tokens,
            max_requests_per_batch=settings.max_batch,
        )
        self._manager = loaded.model.init_continuous_batching(  # type: ignore[operator]
            generation_config=generation_config, continuous_batching_config=batching
        )

    def start(self) -> None:
        """Start transformers' generation thread."""
        import torch

        with torch.inference_mode():
            self._manager.start()

    def stop(self) -> None:
        """Stop the generation thread."""
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=10)

    def is_running(self) -> bool:
        """Whether the generation thread is alive."""
        return bool(self._manager.is_running())

    def acquire_slot(self, timeout_s: float) -> bool:
        """Wait for room in the batch (the same bound as the GPU worker's)."""
        return bool(self._slots.acquire(timeout=timeout_s))

    def release_slot(self) -> None:
        """Give back a finished request's slot."""
        self._slots.release()

    def add(self, job: GenerationJob) -> None:
        """Queue ``job``'s prompt, streamed, with transformers' own sampling (greedy)."""
        self._manager.add_request(
            job.prompt_token_ids,
            request_id=job.response_id,
            max_new_tokens=job.max_output_tokens,
            streaming=True,
        )

    def next_outputs(self, timeout_s: float) -> list[GenerationOutput]:
        """Outputs since the last call, waiting up to ``timeout_s`` for the first."""
        from gpu_worker.engine import drain

        return drain(self._manager.output_router.output_queue, timeout_s)


def _serve(upstream: bool) -> None:
    from tokenizers import Tokenizer

    from gpu_worker.model_loading import load_model
    from resq.catalog import TextTokenizer
    from resq.settings import load_settings
    from resq.wire import GenerationJob

    settings = load_settings()
    loaded = load_model(settings)
    tokenizer = TextTokenizer(loaded.card, Tokenizer.from_str(loaded.tokenizer_json))
    engine: Any
    if upstream:
        engine = UpstreamEngine(loaded, settings)
    else:
        from gpu_worker.engine import Engine

        engine = Engine(loaded, settings)
    engine.start()
    counter = 0
    print(RESULT_PREFIX + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command: dict[str, Any] = json.loads(line)
        if command.get("op") == "stop":
            break
        prompt = tokenizer.encode(tokenizer.render(command["messages"]))
        timings: dict[str, _Timing] = {}
        started = time.perf_counter()
        for _ in range(int(command["concurrency"])):
            counter += 1
            job = GenerationJob(
                response_id=f"direct-{counter}",
                model=loaded.card.name,
                prompt_token_ids=prompt,
                max_output_tokens=int(command["max_tokens"]),
                temperature=0.0,
                top_p=1.0,
            )
            engine.acquire_slot(60)
            timings[job.response_id] = _Timing(time.perf_counter())
            engine.add(job)
        pending = len(timings)
        while pending:
            outputs = engine.next_outputs(1.0)
            now = time.perf_counter()
            for output in outputs:
                timing = timings.get(output.request_id)
                if timing is None or timing.finished:
                    continue
                count = len(output.generated_tokens)
                if count > timing.tokens:
                    timing.first = timing.first or now
                    timing.last = now
                    timing.tokens = count
                if output.is_finished():
                    timing.finished = True
                    pending -= 1
                    engine.release_slot()
            if not outputs and not engine.is_running():
                raise RuntimeError("the engine stopped")
        wall = time.perf_counter() - started
        result = {
            "wall_s": wall,
            "requests": [
                {
                    "ttft_s": (timing.first or timing.added) - timing.added,
                    "decode_s": (timing.last or timing.added) - (timing.first or timing.added),
                    "total_s": (timing.last or timing.added) - timing.added,
                    "tokens": timing.tokens,
                }
                for timing in timings.values()
            ],
        }
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    engine.stop()


if __name__ == "__main__":
    _serve(upstream="--upstream" in sys.argv[1:])
