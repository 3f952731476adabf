"""The GPU worker's decode attention: per request (resq's default) against transformers' packed call.

Two resq stacks on one host, each with its own GPU worker, post-process workers, API and private
redis-server, one GPU worker with ``RESQ_DECODE_ATTENTION`` on (its default: a decode step reads
each request's keys padded and attends it to its own, :mod:`gpu_worker.decode_attention`) and
one with it off (transformers' packed ``sdpa`` over the whole batch's keys under a
block-diagonal mask), measured as :mod:`bench.configurations` measures configurations:
``clients`` concurrent greedy streams of ``tokens`` tokens, rounds in rotated order after a
full-width warm-up; tok/s, tokens per delta, TTFT p50 and B7's CPU per streamed token outside
the engine thread, by process. Ratios are medians of per-round ratios against the packed call.

What it answers: what the per-request attention gives a whole resq stack, where the engine
shares the host with the queue's processes. ``python -m bench.decode_attention`` (``make
bench-attention``) prints the table; ``make bench``'s B1 has the engine alone against upstream
transformers.
"""

from __future__ import annotations

import click

from bench.configurations import load_options, print_configuration_ab

SCENARIO = "decode-attention"
CONFIGURATIONS = {
    "transformers' packed attention": {"gpu_worker_env": {"RESQ_DECODE_ATTENTION": "false"}},
    "per-request attention": {},
}


@click.command()
@load_options(rounds=4)
def main(model: str, rounds: int, concurrency: int, tokens: int) -> None:
    """Throughput and CPU per token of resq with either decode attention, paired per round."""
    print_configuration_ab(
        CONFIGURATIONS, SCENARIO, (model, rounds, concurrency, tokens), "Decode attention", "decode attention"
    )


if __name__ == "__main__":
    main()
