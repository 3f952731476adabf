"""``make soak``: many concurrent streams for minutes; no event lost or duplicated, memory bounded.

Starts its own stack (a GPU worker on the fixture model, post-process workers, one API)
on the test Redis database (``RESQ_TEST_REDIS_URL``, flushed first), then keeps
``--streams`` streaming requests open for ``--duration`` seconds: each client starts a new
request as soon as its stream ends (the streams open at the deadline still run to their end). Every stream is checked with
:func:`tests.support.invariants.check_stream` (``sequence_number`` 0..n-1, exactly one
terminal event, deltas adding up to the final text) and against what the fixture model
must answer. The RSS of every process is sampled throughout.

Outside the default suite (it runs for minutes); exits non-zero when any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from tests.fixture_model import ensure_fixture_model, scenario
from tests.support.invariants import check_stream, output_text
from tests.support.processes import (
    START_TIMEOUT_S,
    ProcessGroup,
    RoleProcess,
    api_healthy,
    free_port,
    model_registered,
    wait_until,
)

MODEL = "fixture"
ENDLESS_TOKENS = 48
"""Output limit of the endless requests: they run to it, so their length is known exactly."""
RSS_GROWTH_LIMIT = 1.5
"""A process whose RSS at the end exceeds this times its settled RSS (plus 64 MiB) fails."""
RSS_SLACK_BYTES = 64 * 2**20
SAMPLE_EVERY_S = 5.0


@dataclass
class Tally:
    """What the clients saw."""

    streams: int = 0
    events: int = 0
    failures: list[str] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)


def _request(index: int) -> tuple[dict[str, Any], str | None]:
    """Alternately a short answer with a known text and an endless one cut at a known length."""
    if index % 2 == 0:
        return {"model": MODEL, "input": "Say hello.", "temperature": 0, "stream": True}, scenario(
            "hello"
        ).completion
    body = {
        "model": MODEL,
        "input": "Repeat forever.",
        "temperature": 0,
        "stream": True,
        "max_output_tokens": ENDLESS_TOKENS,
    }
    return body, None


async def _one_stream(client: httpx.AsyncClient, base_url: str, index: int, tally: Tally) -> None:
    body, expected = _request(index)
    events: list[dict[str, Any]] = []
    async with client.stream("POST", f"{base_url}/v1/responses", json=body) as reply:
        if reply.status_code != 200:
            tally.failures.append(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
            return
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    tally.streams += 1
    tally.events += len(events)
    try:
        final = check_stream(events)
        tally.statuses[final["status"]] += 1
        if expected is not None:
            assert final["status"] == "completed", final["status"]
            assert output_text(final) == expected, output_text(final)
        else:
            assert final["status"] == "incomplete", final["status"]
            assert final["usage"]["output_tokens"] == ENDLESS_TOKENS, final["usage"]
    except AssertionError as exc:
        tally.failures.append(f"stream {index}: {exc}"[:500])


async def _client_loop(
    client: httpx.AsyncClient, base_url: str, first_index: int, stride: int, deadline: float, tally: Tally
) -> None:
    index = first_index
    while time.monotonic() < deadline:
        try:
            await _one_stream(client, base_url, index, tally)
        except httpx.HTTPError as exc:
            tally.failures.append(f"stream {index}: {exc!r}")
        index += stride


def _rss(processes: dict[str, psutil.Process]) -> dict[str, int]:
    return {name: process.memory_info().rss for name, process in processes.items()}


async def _sample_rss(
    processes: dict[str, psutil.Process], samples: list[dict[str, int]], every_s: float, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        samples.append(_rss(processes))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def soak(
    base_url: str, processes: dict[str, psutil.Process], streams: int, duration_s: float
) -> dict[str, Any]:
    """Run the load; the figures and failures as a dict.

    RSS is bounded when the end value is within :data:`RSS_GROWTH_LIMIT` of the value a
    quarter into the run (by then every pool, buffer and cache has its working size).
    """
    tally = Tally()
    # One connection per stream, never reused: with hundreds of streams on one client event
    # loop, a connection may sit idle past the server's keep-alive timeout before its next
    # request, and the race with the server closing it would look like a server fault.
    limits = httpx.Limits(max_connections=streams + 10, max_keepalive_connections=0)
    before = _rss(processes)
    samples: list[dict[str, int]] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0, connect=60.0)) as client:
        sampler = asyncio.create_task(_sample_rss(processes, samples, SAMPLE_EVERY_S, stop))
        started = time.monotonic()
        deadline = started + duration_s
        await asyncio.gather(
            *(_client_loop(client, base_url, index, streams, deadline, tally) for index in range(streams))
        )
        elapsed = time.monotonic() - started
        stop.set()
        await sampler
    end = _rss(processes)
    settled = samples[min(len(samples) - 1, int(duration_s / 4 / SAMPLE_EVERY_S))] if samples else before
    rss = {
        name: {
            "before_mib": _mib(before[name]),
            "settled_mib": _mib(settled[name]),
            "max_mib": _mib(max(sample[name] for sample in [*samples, end])),
            "end_mib": _mib(end[name]),
        }
        for name in processes
    }
    for name in processes:
        if end[name] > settled[name] * RSS_GROWTH_LIMIT + RSS_SLACK_BYTES:
            tally.failures.append(
                f"RSS of {name} grew from {rss[name]['settled_mib']} to {rss[name]['end_mib']} MiB"
            )
    return {
        "streams": streams,
        "duration_s": round(elapsed, 1),
        "responses": tally.streams,
        "events": tally.events,
        "statuses": dict(tally.statuses),
        "responses_per_s": round(tally.streams / elapsed, 1),
        "events_per_s": round(tally.events / elapsed, 1),
        "rss": rss,
        "failures": len(tally.failures),
        "first_failures": tally.failures[:20],
    }


def _mib(value: int) -> float:
    return round(value / 2**20, 1)


def _start(
    redis_url: str, log_dir: Path, postprocess_workers: int, streams: int
) -> tuple[ProcessGroup, str, dict[str, RoleProcess]]:
    model_dir = ensure_fixture_model()
    env = {
        "RESQ_REDIS_URL": redis_url,
        "RESQ_MODEL": str(model_dir),
        "RESQ_MODEL_NAME": MODEL,
        "RESQ_LOG_LEVEL": "warning",
        "RESQ_REASONING_PARSER": "qwen3",
        "RESQ_TOOL_PARSER": "hermes",
        "RESQ_MAX_BATCH": "64",
        "RESQ_KV_CACHE_TOKENS": "65536",
        # Every stream may be queued or running at once: backpressure must not refuse any.
        "RESQ_MAX_PENDING": str(max(256, 2 * streams)),
        "RESQ_POSTPROCESS_WORKERS": str(postprocess_workers),
    }
    group = ProcessGroup(log_dir, env)
    roles = {"gpu-worker": group.start("gpu-worker", "soak-gpu-worker")}
    for index in range(postprocess_workers):
        roles[f"postprocess-{index}"] = group.start("postprocess-worker", f"soak-postprocess-{index}")
    port = free_port()
    roles["api"] = group.start("api", "soak-api", RESQ_PORT=str(port))
    base_url = f"http://127.0.0.1:{port}"
    watched = list(roles.values())
    wait_until(lambda: model_registered(redis_url, MODEL), START_TIMEOUT_S, "the GPU worker", watched)
    wait_until(lambda: api_healthy(base_url), START_TIMEOUT_S, "the API", watched)
    return group, base_url, roles


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m tests.load.soak [--streams N] [--duration S]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--streams", type=int, default=500, help="concurrent streams (default 500)")
    parser.add_argument(
        "--duration", type=float, default=180.0, help="seconds of load after warm-up (default 180)"
    )
    parser.add_argument("--postprocess-workers", type=int, default=2)
    parser.add_argument(
        "--redis-url", default=os.environ.get("RESQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    client = redis.Redis.from_url(args.redis_url)
    client.flushdb()
    log_dir = Path(tempfile.mkdtemp(prefix="resq-soak-"))
    group, base_url, roles = _start(args.redis_url, log_dir, args.postprocess_workers, args.streams)
    try:
        processes = {name: psutil.Process(role.process.pid) for name, role in roles.items()}
        redis_before = int(client.info("memory")["used_memory"])
        figures = asyncio.run(soak(base_url, processes, args.streams, args.duration))
        dead = [name for name, role in roles.items() if not role.alive()]
        if dead:
            figures["failures"] += len(dead)
            figures["first_failures"].append(f"processes died: {dead}")
        figures["redis_used_memory_mib"] = {
            "start": round(redis_before / 2**20, 1),
            "end": round(int(client.info("memory")["used_memory"]) / 2**20, 1),
        }
        figures["logs"] = str(log_dir)
    finally:
        group.stop_all()
        client.close()
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
