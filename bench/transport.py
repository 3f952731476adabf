"""Redis over loopback TCP against a Unix socket, paired per round.

Two resq stacks on one host, each with its own GPU worker, post-process workers, API and private
redis-server, one reaching its Redis over ``redis://127.0.0.1:<port>`` and one over
``unix:///.../redis.sock`` (:mod:`resq.redis_urls`), measured as :mod:`bench.configurations`
measures configurations: ``clients`` concurrent greedy streams of ``tokens`` tokens, rounds in
rotated order after a full-width warm-up; tok/s, tokens per delta, TTFT p50 and B7's CPU per
streamed token outside the engine thread, by process. Ratios are medians of per-round ratios
against TCP.

What it answers: how much of the queue's CPU per token is the loopback TCP stack that every hop
of a token chunk crosses (published, read, logged, read again), on a host where every process
can reach Redis's socket. ``python -m bench.transport`` (``make bench-transport``) prints the table.
"""

from __future__ import annotations

import click

from bench.configurations import load_options, print_configuration_ab

SCENARIO = "transport"
TRANSPORTS = {"loopback TCP": {}, "Unix socket": {"redis_unix_socket": True}}


@click.command()
@load_options(rounds=4)
def main(model: str, rounds: int, concurrency: int, tokens: int) -> None:
    """Throughput and CPU per token of resq on Redis over TCP and over a Unix socket, paired per round."""
    print_configuration_ab(
        TRANSPORTS, SCENARIO, (model, rounds, concurrency, tokens), "Redis transport", "transport"
    )


if __name__ == "__main__":
    main()
