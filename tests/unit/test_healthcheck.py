"""``resq healthcheck ROLE``: the verdicts Docker's HEALTHCHECK acts on."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import redis
from click.testing import CliRunner
from starlette.testclient import TestClient

from api.main import create_app
from resq import keys
from resq.cli import main
from resq.healthcheck import check
from resq.settings import Settings
from tests.support.processes import free_port


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings(redis_url=redis_url, worker_ttl_s=10.0)


@pytest.fixture
def host() -> str:
    """A host name of this test's own: live workers of the session beat under theirs."""
    return f"container-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def beat(redis_client: redis.Redis) -> Iterator[Callable[[str, str, float], None]]:
    """Write a heartbeat ``age_s`` old; removed after the test."""
    written: list[tuple[str, str]] = []

    def write(members_key: str, member: str, age_s: float) -> None:
        redis_client.zadd(members_key, {member: time.time() - age_s})
        written.append((members_key, member))

    yield write
    for members_key, member in written:
        redis_client.zrem(members_key, member)


def test_a_worker_with_a_fresh_heartbeat_on_this_host_is_healthy(
    settings: Settings, host: str, beat: Callable[[str, str, float], None]
) -> None:
    beat(keys.POSTPROCESS_WORKERS, f"postprocess@{host}:1", 1.0)
    health = check("postprocess-worker", settings, hostname=host)
    assert health.healthy, health.detail


def test_a_stale_heartbeat_is_unhealthy(
    settings: Settings, host: str, beat: Callable[[str, str, float], None]
) -> None:
    beat(keys.GPU_WORKERS, f"gpu@{host}:1", 30.0)
    health = check("gpu-worker", settings, hostname=host)
    assert not health.healthy and "old" in health.detail


def test_another_hosts_heartbeat_does_not_count(
    settings: Settings, host: str, beat: Callable[[str, str, float], None]
) -> None:
    beat(keys.GPU_WORKERS, f"gpu@{host}-other:1", 0.0)
    beat(keys.POSTPROCESS_WORKERS, f"postprocess@{host}:1", 0.0)
    health = check("gpu-worker", settings, hostname=host)
    assert not health.healthy and "no gpu worker" in health.detail


def test_a_worker_is_unhealthy_when_redis_does_not_answer(host: str) -> None:
    settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    health = check("postprocess-worker", settings, hostname=host)
    assert not health.healthy and "does not answer" in health.detail


class _HealthEndpoint(BaseHTTPRequestHandler):
    status = 200
    body: ClassVar[dict[str, object]] = {}

    def do_GET(self) -> None:
        payload = json.dumps(self.body).encode()
        self.send_response(self.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HealthEndpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("status", "body", "healthy"),
    [
        (200, {"status": "ok", "redis": "ok", "gpu_workers": 1}, True),
        # Workers missing: the API itself is fine; restarting it would not help.
        (503, {"status": "unavailable", "redis": "ok", "missing": ["gpu_worker"]}, True),
        (503, {"status": "unavailable", "redis": "unreachable: refused", "missing": ["redis"]}, False),
    ],
)
def test_the_api_is_healthy_when_it_answers_and_reaches_redis(
    api_port: int, status: int, body: dict[str, object], healthy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_HealthEndpoint, "status", status)
    monkeypatch.setattr(_HealthEndpoint, "body", body)
    health = check("api", Settings(host="0.0.0.0", port=api_port))
    assert health.healthy is healthy, health.detail


def test_an_api_that_does_not_answer_is_unhealthy() -> None:
    health = check("api", Settings(port=free_port()))
    assert not health.healthy and "does not answer" in health.detail


def test_the_command_exits_non_zero_and_says_why() -> None:
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    result = CliRunner().invoke(main, ["healthcheck", "postprocess-worker", "--redis-url", dead_redis])
    assert result.exit_code == 1
    assert result.output.startswith("unhealthy: Redis at") and "does not answer" in result.output


def test_the_open_health_endpoint_never_says_where_redis_is(
    redis_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/health`` needs no key: Redis' host and port go to the log, not to whoever asks."""
    where = "Error 111 connecting to redis-internal.example:6390. Connection refused."

    async def refused() -> None:
        raise redis.exceptions.ConnectionError(where)

    with TestClient(create_app(Settings(redis_url=redis_url, postprocess_workers=1))) as client:
        monkeypatch.setattr(client.app.state.resq.redis, "ping", refused)  # type: ignore[attr-defined]
        with caplog.at_level(logging.WARNING, logger="api.routes.health"):
            reply = client.get("/health")
    assert reply.status_code == 503
    report = reply.json()
    assert report["redis"] == "unreachable" and "redis" in report["missing"]
    assert "redis-internal" not in reply.text and "6390" not in reply.text
    assert any(where in record.getMessage() for record in caplog.records)
