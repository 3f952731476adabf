"""The API's metrics: request counting by route template, stream timing, and the scrape endpoint."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from api import metrics
from api.main import create_app
from api.routes import metrics as metrics_route
from resq import keys
from resq.metrics import stream_entry_age_s
from resq.settings import Settings
from tests.support.processes import free_port


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _events(items: list[tuple[bytes, bytes]]) -> AsyncIterator[tuple[bytes, bytes]]:
    for item in items:
        await asyncio.sleep(0)
        yield item


def _relay(items: list[tuple[bytes, bytes]], new_response: bool = True) -> list[tuple[bytes, bytes]]:
    async def collect() -> list[tuple[bytes, bytes]]:
        return [item async for item in metrics.measured_stream(_events(items), new_response)]

    return asyncio.run(collect())


def _terminal(status: str, model: str, output_tokens: int) -> tuple[bytes, bytes]:
    response = {"status": status, "model": model, "usage": {"output_tokens": output_tokens}}
    return (b"response." + status.encode(), orjson.dumps({"type": "x", "response": response}))


STREAM = [
    (b"response.created", b"{}"),
    (b"response.in_progress", b"{}"),
    (b"response.reasoning_text.delta", b"{}"),
    (b"response.output_text.delta", b"{}"),
    (b"response.output_text.delta", b"{}"),
    (b"response.output_text.done", b"{}"),
    _terminal("completed", "unit-model", 17),
]


def test_a_relayed_stream_is_timed_and_counted_and_passes_unchanged() -> None:
    ttft = sample("resq_time_to_first_token_seconds_count")
    gaps = sample("resq_inter_token_seconds_count")
    tokens = sample("resq_output_tokens_total", model="unit-model")
    completed = sample("resq_responses_delivered_total", status="completed", endpoint="responses")

    assert _relay(STREAM) == STREAM

    assert sample("resq_time_to_first_token_seconds_count") == ttft + 1
    assert sample("resq_inter_token_seconds_count") == gaps + 2  # three deltas, two gaps
    assert sample("resq_output_tokens_total", model="unit-model") == tokens + 17
    assert sample("resq_responses_delivered_total", status="completed", endpoint="responses") == completed + 1
    assert sample("resq_active_streams") == 0


def test_a_resumed_stream_has_no_time_to_first_token() -> None:
    ttft = sample("resq_time_to_first_token_seconds_count")
    _relay(STREAM[3:], new_response=False)
    assert sample("resq_time_to_first_token_seconds_count") == ttft


def test_a_stream_counts_as_active_until_it_is_closed() -> None:
    async def scenario() -> tuple[float, float]:
        stream = metrics.measured_stream(_events(STREAM))
        await stream.__anext__()
        during = sample("resq_active_streams")
        await stream.aclose()  # the client went away
        return during, sample("resq_active_streams")

    during, after = asyncio.run(scenario())
    assert during == 1 and after == 0


def test_stream_entry_age_reads_redis_clock_from_the_id() -> None:
    assert stream_entry_age_s(b"1700000000000-3", now_s=1700000000.25) == pytest.approx(0.25)
    assert stream_entry_age_s("1700000000500-0", now_s=1700000000.0) == 0.0  # clock skew: never negative


@pytest.fixture
def client(redis_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(redis_url=redis_url, postprocess_workers=1))) as test_client:
        yield test_client


def scrape(client: TestClient) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    reply = client.get("/metrics")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(reply.text):
        for metric in family.samples:
            values.setdefault(metric.name, {})[tuple(sorted(metric.labels.items()))] = metric.value
    return values


def test_requests_are_counted_by_route_template_and_status(client: TestClient) -> None:
    before = scrape(client).get("resq_http_requests_total", {})
    client.get("/no/such/path")
    client.post("/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
    after = scrape(client)["resq_http_requests_total"]

    def grew(route: str, method: str, status: str) -> float:
        key = (("method", method), ("route", route), ("status", status))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("<unmatched>", "GET", "404") == 1
    assert grew("/v1/responses", "POST", "400") == 1


def test_response_ids_never_become_labels(client: TestClient) -> None:
    client.get("/v1/responses/resp_0123/input_items")  # whatever answers, the label is a template
    routes = {dict(labels)["route"] for labels in scrape(client)["resq_http_requests_total"]}
    assert routes and not any("resp_0123" in route for route in routes)


def test_the_scrape_reads_queue_depth_and_live_workers_from_redis(
    client: TestClient, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A queue of the test's own: live workers of the session consume the real ones.
    queue = f"unit-{uuid.uuid4().hex}"
    monkeypatch.setattr(metrics_route, "QUEUES", (queue,))
    model = f"unit-model-{uuid.uuid4().hex}"
    redis_client.hset(keys.MODELS, model, "{}")  # a card: its generation queue is measured too
    fresh, stale = f"gpu@unit-{queue}:1", f"gpu@unit-{queue}:2"
    alive_before = scrape(client)["resq_workers_alive"][(("role", "gpu"),)]
    redis_client.rpush(keys.celery_queue(queue), b"m1", b"m2", b"m3")
    redis_client.zadd(keys.GPU_WORKERS, {fresh: time.time(), stale: time.time() - 3600})
    try:
        values = scrape(client)
    finally:
        redis_client.delete(keys.celery_queue(queue))
        redis_client.zrem(keys.GPU_WORKERS, fresh, stale)
        redis_client.hdel(keys.MODELS, model)
    assert values["resq_queue_depth"][(("queue", queue),)] == 3
    assert values["resq_queue_depth"][(("queue", keys.generate_queue(model)),)] == 0
    assert values["resq_workers_alive"][(("role", "gpu"),)] == alive_before + 1
    assert values["resq_redis_up"][()] == 1


def test_the_scrape_reports_redis_down_instead_of_failing() -> None:
    dead = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", postprocess_workers=1)
    with TestClient(create_app(dead)) as dead_client:
        values = scrape(dead_client)
    assert values["resq_redis_up"][()] == 0
