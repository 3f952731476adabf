"""The direct-engine baseline: the GPU worker's engine in-process, no Redis, no HTTP, no queue.

Run as ``python -m bench.direct`` with the same ``RESQ_*`` settings as the GPU
worker: it loads the model the same way, builds the same :class:`Engine`
(transformers continuous batching, same cache and batch sizes, same
per-request sampling), then answers JSON-line commands on stdin, one result
line on stdout per command. It renders prompts with resq's own chat template,
so it decodes exactly the prompt ids the API would send.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any

RESULT_PREFIX = "BENCH-RESULT "


@dataclass
class _Timing:
    added: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    finished: bool = False


def _serve() -> None:
    from tokenizers import Tokenizer

    from gpu_worker.engine import Engine
    from gpu_worker.model_loading import load_model
    from resq.catalog import TextTokenizer
    from resq.settings import load_settings
    from resq.wire import GenerationJob

    settings = load_settings()
    loaded = load_model(settings)
    tokenizer = TextTokenizer(loaded.card, Tokenizer.from_str(loaded.tokenizer_json))
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
    _serve()
