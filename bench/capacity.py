"""B4's second half: how many SSE streams one API process holds open at once, and its memory.

A dedicated API process (no GPU worker, no post-process worker behind it) gets
``count`` streaming requests. Nothing ever generates, so each stream stays open
after its ``response.created`` event, waiting on the event log, as a stream
waits for a slow or queued generation. The bench counts the streams that got
their first event, reads the API's resident memory, checks the API still answers
other requests while it holds them, then hangs up every stream.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import psutil

from bench.clients import PROMPT

FIRST_EVENT = b"event: response.created"


@dataclass
class CapacityResult:
    """What holding ``requested`` streams looked like."""

    requested: int
    held: int
    rss_idle_mb: float
    rss_held_mb: float
    open_seconds: float
    models_latency_ms: float
    errors: list[str]

    @property
    def kb_per_stream(self) -> float:
        """Resident memory added per held stream."""
        return (self.rss_held_mb - self.rss_idle_mb) * 1024 / max(1, self.held)


async def _hold(
    client: httpx.AsyncClient, base_url: str, model: str, opened: asyncio.Queue[bool], release: asyncio.Event
) -> None:
    body = {"model": model, "input": PROMPT, "max_output_tokens": 16, "stream": True}
    try:
        async with client.stream("POST", f"{base_url}/v1/responses", json=body) as response:
            seen = b""
            async for chunk in response.aiter_raw():
                seen += chunk
                if FIRST_EVENT in seen:
                    break
            held = response.status_code == 200 and FIRST_EVENT in seen
            await opened.put(held)
            if not held:  # counted as not held; say why with the run's errors
                raise RuntimeError(f"HTTP {response.status_code}: {seen[:200]!r}")
            await release.wait()
    except (httpx.HTTPError, OSError) as exc:
        await opened.put(False)
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc


async def hold_streams(
    base_url: str, model: str, api_pid: int, count: int, timeout_s: float
) -> CapacityResult:
    """Open ``count`` streams against the API at ``base_url`` and measure while all are open."""
    api = psutil.Process(api_pid)
    rss_idle = api.memory_info().rss / 2**20
    opened: asyncio.Queue[bool] = asyncio.Queue()
    release = asyncio.Event()
    limits = httpx.Limits(max_connections=count + 8, max_keepalive_connections=0)
    timeout = httpx.Timeout(timeout_s, connect=timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        started = time.perf_counter()
        tasks = [asyncio.create_task(_hold(client, base_url, model, opened, release)) for _ in range(count)]
        held = 0
        deadline = started + timeout_s
        for _ in range(count):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                held += await asyncio.wait_for(opened.get(), remaining)
            except TimeoutError:
                break
        open_seconds = time.perf_counter() - started
        await asyncio.sleep(1.0)
        rss_held = api.memory_info().rss / 2**20
        probe_started = time.perf_counter()
        await client.get(f"{base_url}/v1/models")
        models_latency_ms = (time.perf_counter() - probe_started) * 1000
        release.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    errors = sorted({str(outcome) for outcome in outcomes if isinstance(outcome, BaseException)})
    return CapacityResult(count, held, rss_idle, rss_held, open_seconds, models_latency_ms, errors[:5])
