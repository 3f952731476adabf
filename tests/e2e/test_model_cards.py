"""The wrong model is never served: cards expire with their workers, a restart with another model
under the same name replaces the card.

On a Redis of its own (a GPU worker on the suite's Redis would take the suite's jobs): a GPU
worker serves ``model-a`` (the fixture model) and stops; another starts with the built-in model,
first as ``model-b``, then as ``model-a``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from resq import keys
from resq.catalog import ModelCard
from tests.e2e.conftest import Stack, start_stack
from tests.support.processes import START_TIMEOUT_S, ProcessGroup, model_registered, wait_until
from tests.support.redis_server import PrivateRedis

pytestmark = pytest.mark.e2e

WORKER_TTL_S = 3.0


@pytest.fixture
def cards_env(tmp_path: Path, fixture_model_dir: Path) -> Iterator[dict[str, str]]:
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    try:
        yield {
            "RESQ_REDIS_URL": server.url,
            "RESQ_MODEL": str(fixture_model_dir),
            "RESQ_MODEL_NAME": "model-a",
            "RESQ_LOG_LEVEL": "info",
            "RESQ_HEARTBEAT_S": "0.5",
            "RESQ_WORKER_TTL_S": str(WORKER_TTL_S),
            "RESQ_KV_CACHE_TOKENS": "4096",
        }
    finally:
        server.stop()


def listed(stack: Stack) -> list[str]:
    reply = httpx.get(f"{stack.base_url}/v1/models", timeout=30)
    assert reply.status_code == 200
    return sorted(model["id"] for model in reply.json()["data"])


def create(stack: Stack, model: str) -> httpx.Response:
    body = {"model": model, "input": "Say hello.", "max_output_tokens": 4}
    return httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=60)


def test_a_restart_with_another_model_serves_only_that_model(
    cards_env: dict[str, str], log_dir: Path
) -> None:
    workers = ProcessGroup(log_dir, cards_env)
    first = workers.start("gpu-worker", "gpu-worker-model-a")
    wait_until(
        lambda: model_registered(cards_env["RESQ_REDIS_URL"], "model-a"), START_TIMEOUT_S, "model-a", [first]
    )
    stack = start_stack(cards_env, log_dir, 0, "cards")
    try:
        assert listed(stack) == ["model-a"]
        assert create(stack, "model-a").status_code == 200
        first.stop()

        # Another model on the same Redis: the old card stays in the hash, but is no longer served.
        second = workers.start(
            "gpu-worker", "gpu-worker-model-b", RESQ_MODEL="builtin", RESQ_MODEL_NAME="model-b"
        )
        wait_until(lambda: listed(stack) == ["model-b"], START_TIMEOUT_S, "only model-b listed", [second])
        refused = create(stack, "model-a")
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
        assert create(stack, "model-b").status_code == 200
        second.stop()

        # The same name, other weights: the card is the new worker's, not the old one.
        client = redis.Redis.from_url(cards_env["RESQ_REDIS_URL"])
        old_source = ModelCard.model_validate_json(client.hget(keys.MODELS, "model-a") or b"").source
        third = workers.start("gpu-worker", "gpu-worker-model-a-again", RESQ_MODEL="builtin")
        wait_until(lambda: listed(stack) == ["model-a"], START_TIMEOUT_S, "model-a listed again", [third])
        card = ModelCard.model_validate_json(client.hget(keys.MODELS, "model-a") or b"")
        assert card.source != old_source and "builtin" in card.source
        assert create(stack, "model-a").status_code == 200
    finally:
        stack.group.stop_all()
        workers.stop_all()


def test_two_models_on_one_redis_each_job_goes_to_its_models_worker(
    cards_env: dict[str, str], log_dir: Path
) -> None:
    """Each model's jobs wait in that model's queue (``generate:<model>``), which only its workers
    consume: with one shared queue a worker of the other model would take half of them."""
    workers = ProcessGroup(log_dir, cards_env)
    worker_a = workers.start("gpu-worker", "gpu-worker-two-a")
    worker_b = workers.start(
        "gpu-worker", "gpu-worker-two-b", RESQ_MODEL="builtin", RESQ_MODEL_NAME="model-b"
    )
    url = cards_env["RESQ_REDIS_URL"]
    wait_until(
        lambda: model_registered(url, "model-a") and model_registered(url, "model-b"),
        START_TIMEOUT_S,
        "both models",
        [worker_a, worker_b],
    )
    stack = start_stack(cards_env, log_dir, 0, "two-models")
    client = redis.Redis.from_url(url)
    try:
        assert listed(stack) == ["model-a", "model-b"]
        owners: dict[str, set[str]] = {"model-a": set(), "model-b": set()}
        for _ in range(4):
            for model in owners:
                reply = create(stack, model)
                assert reply.status_code == 200, reply.text
                assert (
                    reply.json()["status"] in ("completed", "incomplete") and reply.json()["model"] == model
                )
                owner = client.hget(keys.generation(reply.json()["id"]), "owner")
                owners[model].add((owner or b"").decode().rsplit(":", 1)[-1])
        assert owners == {"model-a": {str(worker_a.process.pid)}, "model-b": {str(worker_b.process.pid)}}
        assert "serves 'model-" not in worker_a.log_tail(400) + worker_b.log_tail(400)
    finally:
        client.close()
        stack.group.stop_all()
        workers.stop_all()
