"""What ``RESQ_LOGPROBS`` and ``top_logprobs`` cost the engine: decode throughput with logprobs
off, on, and on with every request asking for its top ``--top`` alternatives.

Runs resq's own :class:`gpu_worker.engine.Engine` in-process (no Redis, no API), with
N concurrent greedy requests of a fixed length, alternating rounds (off, on, top, off, on,
top, ...) so that load drifting on a shared machine hits all alike, and prints the
median tokens/s of each and the medians of the per-round ratios, each round's ratio beside.

    .venv/bin/python scripts/bench_logprobs.py                 # both models, 8 clients, top 20
    .venv/bin/python scripts/bench_logprobs.py --model wide --clients 32 --rounds 7 --top 5
    .venv/bin/python scripts/bench_logprobs.py --top 0         # off and on only

Models: ``builtin`` (the 2-layer built-in model, vocabulary 2,048) and ``wide`` (random
weights, 2 layers of width 256, but Qwen3's vocabulary of 151,936: the logprob cost is
one log-sum-exp over the vocabulary per sampled token, so a real vocabulary is what
matters). The numbers go in the README's logprobs section.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpu_worker.engine import Engine
from gpu_worker.model_loading import LoadedModel, load_model
from resq.settings import Settings
from resq.wire import GenerationJob

PROMPT_TOKENS = 64
QWEN3_VOCAB = 151_936


def load(name: str, settings: Settings) -> LoadedModel:
    """The built-in model, or a random wide-vocabulary one sharing its tokenizer (ids only matter)."""
    builtin = load_model(settings)
    if name == "builtin":
        return builtin
    config = LlamaConfig(
        vocab_size=QWEN3_VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=builtin.card.eos_token_ids,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(builtin.device).eval()
    return replace(builtin, model=model)


def run_round(
    loaded: LoadedModel, settings: Settings, clients: int, tokens: int, logprobs: bool, top: int = 0
) -> float:
    """Decode ``clients`` x ``tokens`` tokens (each asking for ``top`` alternatives); return output
    tokens per second."""
    engine = Engine(loaded, settings.model_copy(update={"logprobs": logprobs}))
    engine.start()
    try:
        jobs = [
            GenerationJob(
                response_id=f"bench-{logprobs}-{index}-{time.monotonic_ns()}",
                model="bench",
                prompt_token_ids=[(17 * index + position) % 1000 + 10 for position in range(PROMPT_TOKENS)],
                max_output_tokens=tokens,
                temperature=0,
                top_p=1.0,
                # No end token: every request runs to its full length.
                stop_token_ids=[],
                logprobs=logprobs,
                top_logprobs=top,
            )
            for index in range(clients)
        ]
        started = time.perf_counter()
        for job in jobs:
            engine.acquire_slot(60)
            engine.add(job)
        produced: dict[str, int] = {}
        finished: set[str] = set()
        while len(finished) < clients:
            for output in engine.next_outputs(1.0):
                produced[output.request_id] = len(output.generated_tokens)
                if output.is_finished():
                    finished.add(output.request_id)
                    if logprobs:
                        assert len(output.logprobs) == len(output.generated_tokens)
                    if top:  # taken as the publisher takes them, once the tokens are out
                        count = len(output.generated_tokens)
                        alternatives = engine.alternatives(output.request_id, 0, count)
                        assert alternatives is not None and len(alternatives) == count
        elapsed = time.perf_counter() - started
        return sum(produced.values()) / elapsed
    finally:
        engine.stop()


def main() -> None:
    """Alternate off/on rounds per model and print the medians."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["builtin", "wide", "both"], default="both")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--top", type=int, default=20, help="top_logprobs of the third variant; 0: none")
    args = parser.parse_args()
    settings = Settings(kv_cache_tokens=8192, max_batch=max(args.clients, 1))
    models = ["builtin", "wide"] if args.model == "both" else [args.model]
    print(
        f"device {load('builtin', settings).device}, torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    print(f"{args.clients} clients x {args.tokens} tokens, greedy, {args.rounds} rounds each (alternating)\n")
    top_columns = f" top {args.top} (tok/s) | top / on, per round |" if args.top else ""
    print(f"| model | logprobs off (tok/s) | logprobs on (tok/s) | on / off, per round |{top_columns}")
    print("|---|---|---|---|" + ("---|---|" if args.top else ""))
    for name in models:
        loaded = load(name, settings)
        run_round(loaded, settings, args.clients, 8, False)  # warm-up
        run_round(loaded, settings, args.clients, 8, True, args.top)
        off: list[float] = []
        on: list[float] = []
        top: list[float] = []
        for _ in range(args.rounds):
            off.append(run_round(loaded, settings, args.clients, args.tokens, False))
            on.append(run_round(loaded, settings, args.clients, args.tokens, True))
            if args.top:
                top.append(run_round(loaded, settings, args.clients, args.tokens, True, args.top))
        row = f"| {name} | {statistics.median(off):.0f} | {statistics.median(on):.0f} | {paired(on, off)} |"
        if args.top:
            row += f" {statistics.median(top):.0f} | {paired(top, on)} |"
        print(row, flush=True)


def paired(new: list[float], base: list[float]) -> str:
    """The median of the per-round ratios, after each round's ratio."""
    ratios = [a / b for a, b in zip(new, base, strict=True)]
    return f"{', '.join(f'{r:.2f}' for r in ratios)} -> **{statistics.median(ratios):.2f}x**"


if __name__ == "__main__":
    main()
