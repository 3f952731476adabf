"""Chaos: streams run while a driver kills (-9) and freezes (SIGSTOP, then SIGCONT) random roles.

Two GPU workers, two post-process workers and two APIs on a private Redis. Background
responses are created on any live API; meanwhile a seeded driver picks a random role every
1.5-3 s, and kills it (a replacement starts) or freezes it for 1-4 s, past or short of the
worker TTL. At the end, every response ended: completed with exactly the greedy text of an
undisturbed run, or failed cleanly (``server_error``, after too many losses); its event log
holds every event once, in order, with one terminal event.

``RESQ_CHAOS_S`` (default 40) is how long the driver runs; ``RESQ_CHAOS_SEED`` its seed.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import openai
import pytest
import redis

from resq import keys
from tests.e2e.conftest import MODEL
from tests.e2e.test_faults import (  # noqa: F401  (fixtures)
    FaultStack,
    References,
    StackFactory,
    comparable,
    make_stack,
    references,
)
from tests.support.invariants import as_dict, check_stream
from tests.support.processes import RoleProcess

pytestmark = pytest.mark.e2e

CHAOS_S = float(os.environ.get("RESQ_CHAOS_S", "40"))
SEED = int(os.environ.get("RESQ_CHAOS_SEED", "1"))
REQUEST = {"input": "Repeat forever.", "temperature": 0, "max_output_tokens": 60}
STREAMS = 8


class Driver:
    """Kills and freezes random roles of ``stack`` until stopped; replaces what it killed."""

    def __init__(self, stack: FaultStack, seed: int) -> None:
        self._stack = stack
        self._random = random.Random(seed)
        self._stop = threading.Event()
        self.faults: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _roles(self) -> list[tuple[str, RoleProcess]]:
        stack = self._stack
        return [
            *(("gpu", role) for role in stack.gpu_workers if role.alive()),
            *(("postprocess", role) for role in stack.postprocess_workers if role.alive()),
            *(("api", role) for role, _ in stack.apis if role.alive()),
        ]

    def _run(self) -> None:
        while not self._stop.wait(self._random.uniform(1.5, 3.0)):
            kind, victim = self._random.choice(self._roles())
            if self._random.random() < 0.5:
                victim.kill()
                self.faults.append(f"kill {victim.name}")
                self._replace(kind)
            else:
                frozen_s = self._random.uniform(1.0, 4.0)
                os.kill(victim.process.pid, signal.SIGSTOP)
                self.faults.append(f"freeze {victim.name} {frozen_s:.1f}s")
                self._stop.wait(frozen_s)
                os.kill(victim.process.pid, signal.SIGCONT)

    def _replace(self, kind: str) -> None:
        stack = self._stack
        if kind == "gpu":
            stack.start_gpu_worker(wait=False)
        elif kind == "postprocess":
            stack.start_postprocess_worker()
        else:
            stack.start_api(wait=False)


def live_client(stack: FaultStack) -> openai.OpenAI:
    """A client of an API that answers now (the driver may have killed or frozen the others)."""
    deadline = time.monotonic() + 60
    while True:
        for index, (role, _) in enumerate(stack.apis):
            if role.alive():
                client = stack.client(index).with_options(timeout=5)
                try:
                    client.models.list()
                    return client
                except openai.APIError:
                    continue
        assert time.monotonic() < deadline, "no API answered for a minute"
        time.sleep(0.2)


def with_a_live_api(stack: FaultStack, call: Any) -> Any:
    """``call(client)`` on a live API, retried on another when the one it reached goes away."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return call(live_client(stack))
        except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError):
            assert time.monotonic() < deadline, "no API completed the call"
            time.sleep(0.2)


@pytest.mark.timeout(900)
def test_streams_survive_random_kills_and_freezes(
    make_stack: StackFactory,  # noqa: F811  (the fixture imported above)
    references: References,  # noqa: F811
) -> None:
    stack = make_stack(gpu_workers=2, postprocess_workers=2, apis=2)
    expected = references(**REQUEST)
    driver = Driver(stack, SEED)
    created: list[str] = []
    driver.start()
    try:
        started_at = time.monotonic()
        while time.monotonic() - started_at < CHAOS_S:
            if len(created) < STREAMS * max(1, int(CHAOS_S // 10)):
                response = with_a_live_api(
                    stack, lambda client: client.responses.create(model=MODEL, background=True, **REQUEST)
                )
                created.append(response.id)
            time.sleep(1.0)
    finally:
        driver.stop()
    for role in [*stack.gpu_workers, *stack.postprocess_workers, *(api for api, _ in stack.apis)]:
        if role.alive():
            os.kill(role.process.pid, signal.SIGCONT)
    print(f"chaos (seed {SEED}): {len(driver.faults)} faults: {'; '.join(driver.faults)}")

    r = stack.redis
    outcomes: dict[str, int] = {}
    for response_id in created:
        events = with_a_live_api(stack, lambda client, rid=response_id: replay(client, rid))
        final = check_stream(events, background=True)
        logged = r.xlen(keys.events(response_id))
        assert logged == len(events), (response_id, logged, len(events))
        outcomes[final["status"]] = outcomes.get(final["status"], 0) + 1
        if final["status"] == "failed":
            assert final["error"]["code"] == "server_error", final["error"]
        else:
            assert comparable(final) == expected, (response_id, driver.faults, stack.logs())
    print(f"chaos: {len(created)} responses: {outcomes}")
    assert outcomes.get("incomplete", 0) >= len(created) // 2, outcomes
    assert_settled(r)


def replay(client: openai.OpenAI, response_id: str) -> list[dict[str, Any]]:
    """Every event of ``response_id``, from the start, as it is logged."""
    return [as_dict(event) for event in client.responses.retrieve(response_id, stream=True)]


def assert_settled(r: redis.Redis) -> None:
    """Nothing left in flight: the reaper's list and the leases are empty."""
    deadline = time.monotonic() + 60
    while r.zcard(keys.GENERATIONS) or r.zcard(keys.POSTPROCESS_LEASES):
        assert time.monotonic() < deadline, (
            r.zrange(keys.GENERATIONS, 0, -1),
            r.zrange(keys.POSTPROCESS_LEASES, 0, -1),
        )
        time.sleep(0.5)
