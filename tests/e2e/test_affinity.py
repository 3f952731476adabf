"""Cache-aware routing with two GPU workers: an agent's turns stay on the worker that holds their
prefix (and reuse it), and go to the other one when that worker is gone."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from resq import keys
from tests.e2e.conftest import MODEL
from tests.e2e.test_faults import StackFactory, make_stack  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e

TURNS = 5


def routed(base_url: str, outcome: str) -> float:
    """``resq_affinity_routed_total{outcome=...}`` of one API process."""
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f'resq_affinity_routed_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_turns_follow_their_prefix_to_one_worker_and_fall_back_when_it_is_gone(
    make_stack: StackFactory,  # noqa: F811  (the fixture imported above)
) -> None:
    stack = make_stack(gpu_workers=2)
    r = stack.redis
    client = stack.client()
    base_url = stack.apis[0][1]
    instructions = f"Agent {uuid.uuid4().hex}. " + " ".join(f"rule{index}" for index in range(150))
    owners: list[str] = []
    cached: list[int] = []
    previous: str | None = None
    for turn in range(TURNS):
        response = client.responses.create(
            model=MODEL,
            instructions=instructions,
            input=f"Turn {turn}: say hello.",
            previous_response_id=previous,
            prompt_cache_key="agent-1",
            temperature=0,
            max_output_tokens=4,
        )
        previous = response.id
        owners.append((r.hget(keys.generation(response.id), "owner") or b"").decode())
        assert response.usage is not None
        cached.append(response.usage.input_tokens_details.cached_tokens)
    assert len(set(owners)) == 1, owners
    assert cached[0] == 0 and all(tokens > 0 for tokens in cached[1:]), cached
    assert routed(base_url, "hit") >= TURNS - 1

    # The worker that holds the prefix goes away: the next turn is served by the other one.
    stack.role_of(owners[0]).kill()
    time.sleep(4)  # its details key expires with its heartbeat (RESQ_WORKER_TTL_S=3)
    fallbacks = routed(base_url, "fallback")
    response = client.responses.create(
        model=MODEL,
        instructions=instructions,
        input="Turn after the loss: say hello.",
        previous_response_id=previous,
        prompt_cache_key="agent-1",
        temperature=0,
        max_output_tokens=4,
    )
    assert response.status in ("completed", "incomplete")
    new_owner = (r.hget(keys.generation(response.id), "owner") or b"").decode()
    assert new_owner and new_owner != owners[0]
    assert routed(base_url, "fallback") == fallbacks + 1
