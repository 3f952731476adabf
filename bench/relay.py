"""The API's relay alone: CPU per relayed frame, against the bare floor, paired per round.

``python -m bench.relay`` (``make bench-relay``; ``--base <rev>`` adds that commit's API) starts an
API process (no GPU worker, no post-process worker) and the B4 floor (:mod:`bench.floor`). Each
round, ``clients`` streams follow live event logs through ``GET /v1/responses/{id}?stream=true``
while the bench itself appends one ``response.output_text.delta`` event to every log each
``interval`` (one pipeline per tick), then the terminal event; the floor's streams send the same
frames on the same clock. What is measured is each server process's CPU per delta frame relayed
(psutil), and its ratio to the floor's in the same round. Records and first events are written
with resq's own code (:func:`resq.records.create`, :func:`resq.postprocess.event_log.stage_first_events`),
so the API reads what a post-processor would have written.

This isolates B4's per-frame cost from the per-request work (validation, prompt, the queue) and
from the engine's pace: B4 itself measures both at once, with as many tokens per frame as the
engine's speed gives.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
from collections.abc import Coroutine
from functools import partial
from pathlib import Path
from typing import Any

import click
import httpx
import psutil
import redis

from bench import clients
from bench.procs import ProcGroup, free_port, http_ok, wait_until
from bench.report import Table, fmt, fmt_paired, to_markdown
from bench.results import ResultSet, RunRecord
from bench.stats import alternated
from bench.systems import Floor
from bench.versus import REPO, _worktree
from resq import ids, jsonutil, keys, records
from resq.embedded_redis import EmbeddedRedis
from resq.events import builders as build
from resq.events import types
from resq.events.emitter import EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess.event_log import stage_first_events
from resq.redis_types import StreamFields

SCENARIO = "relay"
HERE = "this checkout"
FLOOR = "floor"
MODEL = "relay"
ITEM_ID = "msg_0123456789abcdef0123456789abcdef"


def new_logged_response(redis_client: redis.Redis) -> str:
    """A response record and its first event, as the API writes them for a new response."""
    response_id = ids.new_response_id()
    created = {"id": response_id, "object": "response", "status": "in_progress", "model": MODEL, "output": []}
    first = EventEmitter(0).emit(build.response_event(types.CREATED, created))
    options = ProcessingOptions(model=MODEL, first_sequence_number=1)
    record = records.NewRecord("in_progress", jsonutil.dumps(created), options, True, False, "")
    pipe = redis_client.pipeline()
    records.create(pipe, response_id, record, 3600)
    stage_first_events(pipe, response_id, [first], 3600)
    pipe.execute()
    return response_id


def _delta(number: int) -> StreamFields:
    event = EventEmitter(number).emit(build.output_text_delta(ITEM_ID, 0, 0, " the"))
    return {"type": event.type.encode(), "data": event.data}


def _terminal(response_id: str, number: int) -> StreamFields:
    done = {"id": response_id, "object": "response", "status": "completed", "model": MODEL, "output": []}
    event = EventEmitter(number).emit(build.response_event(types.COMPLETED, done))
    return {"type": event.type.encode(), "data": event.data}


async def _api_round(
    base_url: str, redis_client: redis.Redis, count: int, frames: int, interval_s: float
) -> int:
    """``count`` clients follow logs the bench appends to; the delta frames they received."""
    response_ids = [new_logged_response(redis_client) for _ in range(count)]
    received: list[int] = []

    async def follow(client: httpx.AsyncClient, response_id: str) -> None:
        deltas = 0
        async with client.stream(
            "GET", f"{base_url}/v1/responses/{response_id}", params={"stream": "true"}
        ) as reply:
            async for line in reply.aiter_lines():
                deltas += line.startswith("event: response.output_text.delta")
        received.append(deltas)

    async def append() -> None:
        await asyncio.sleep(0.3)  # every client is following by then
        for number in range(1, frames + 2):
            pipe = redis_client.pipeline(transaction=False)
            for response_id in response_ids:
                fields = _delta(number) if number <= frames else _terminal(response_id, number)
                pipe.xadd(keys.events(response_id), fields, id=keys.event_entry_id(number))
            pipe.execute()
            await asyncio.sleep(interval_s)

    async with clients.new_client() as client:
        await asyncio.gather(append(), *(follow(client, response_id) for response_id in response_ids))
    return sum(received)


async def _floor_round(base_url: str, count: int, frames: int, interval_s: float) -> int:
    async with clients.new_client() as client:
        timings, _ = await clients.concurrently(
            count, lambda: clients.floor_stream(client, base_url, frames, interval_s)
        )
    return sum(timing.frames for timing in timings)


def _measured(pid: int, run: Coroutine[Any, Any, int]) -> tuple[float, int]:
    """The CPU seconds of process ``pid`` while ``run`` runs, and what ``run`` returned."""
    process = psutil.Process(pid)
    before = process.cpu_times()
    relayed = asyncio.run(run)
    after = process.cpu_times()
    return (after.user - before.user) + (after.system - before.system), relayed


@click.command()
@click.option("--base", default=None, help="Also relay with this commit's API (a git worktree).")
@click.option("--clients", "count", type=int, default=64, show_default=True)
@click.option("--frames", type=int, default=200, show_default=True, help="Delta frames per stream.")
@click.option("--interval-ms", type=float, default=5.0, show_default=True, help="Time between two frames.")
@click.option("--rounds", type=int, default=5, show_default=True)
def main(base: str | None, count: int, frames: int, interval_ms: float, rounds: int) -> None:
    """API CPU per relayed frame, and the floor's, paired per round."""
    logs = Path(tempfile.mkdtemp(prefix="resq-bench-relay-"))
    base_tree = _worktree(base) if base else None
    server = EmbeddedRedis()
    server.start()
    redis_client = redis.Redis.from_url(server.url)
    groups = {HERE: ProcGroup(logs / "here")}
    if base_tree is not None and base is not None:
        groups[base] = ProcGroup(logs / "base", tree=base_tree)
    apis = {}
    floor = Floor(ProcGroup(logs / "floor"))
    interval_s = interval_ms / 1000
    try:
        for name, group in groups.items():
            port = free_port()
            proc = group.start_role(
                "api", f"{name}-api", {"RESQ_REDIS_URL": server.url, "RESQ_PORT": str(port)}
            )
            apis[name] = (f"http://127.0.0.1:{port}", proc)
        floor.start()
        for url, proc in apis.values():
            wait_until(partial(http_ok, f"{url}/v1/models"), 60, "the API", [proc])
        floor.wait_ready()
        assert floor.proc is not None
        systems = [*apis, FLOOR]
        click.echo(f"{count} clients x {frames} frames, one every {interval_ms:g} ms; logs in {logs}")
        for url, _ in apis.values():  # warm-up
            asyncio.run(_api_round(url, redis_client, count, 20, interval_s))
        asyncio.run(_floor_round(floor.base_url, count, 20, interval_s))
        results = ResultSet()
        for round_index in range(rounds):
            for name in alternated(systems, round_index):
                if name == FLOOR:
                    cpu, relayed = _measured(
                        floor.proc.pid, _floor_round(floor.base_url, count, frames, interval_s)
                    )
                else:
                    url, proc = apis[name]
                    cpu, relayed = _measured(
                        proc.pid, _api_round(url, redis_client, count, frames, interval_s)
                    )
                if relayed != count * frames:
                    raise RuntimeError(f"{name} relayed {relayed} delta frames of {count * frames}")
                metrics = {"cpu_us_per_frame": cpu * 1e6 / relayed}
                results.add(RunRecord(SCENARIO, name, MODEL, count, round_index, metrics))
                click.echo(
                    f"round {round_index + 1}: {name}: {metrics['cpu_us_per_frame']:.1f} us CPU per frame"
                )
        rows = [
            [
                name,
                fmt(results.scalar(SCENARIO, name, "cpu_us_per_frame", MODEL, count)),
                fmt_paired(results.per_round_ratios(SCENARIO, name, FLOOR, "cpu_us_per_frame", MODEL, count))
                if name != FLOOR
                else "-",
                fmt_paired(results.per_round_ratios(SCENARIO, HERE, name, "cpu_us_per_frame", MODEL, count))
                if name not in (HERE, FLOOR)
                else "-",
            ]
            for name in systems
        ]
        click.echo("")
        click.echo(
            to_markdown(
                Table(
                    f"Relay alone, {count} clients (CPU us per delta frame, medians of rounds; ratios paired per round)",
                    ["server", "us / frame", "/ floor", f"{HERE} / it"],
                    rows,
                )
            )
        )
    finally:
        for group in [*groups.values(), floor.group]:
            group.stop_all()
        server.stop()
        if base_tree is not None:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=False
            )


if __name__ == "__main__":
    main()
