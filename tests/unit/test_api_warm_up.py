"""The API opens its broker channel at start, so the first response does not pay for it."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from api.main import create_app
from api.state import AppState
from resq.settings import Settings
from tests.support.processes import free_port


def _state(client: TestClient) -> AppState:
    state: AppState = client.app.state.resq  # type: ignore[attr-defined]
    return state


def test_the_broker_channel_is_open_before_any_request(redis_url: str) -> None:
    with TestClient(create_app(Settings(redis_url=redis_url, postprocess_workers=1))) as client:
        deadline = time.monotonic() + 30
        while not _state(client).task_messages.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(client).task_messages.connected


def test_a_redis_that_is_away_neither_delays_the_start_nor_fails_it() -> None:
    away = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with TestClient(create_app(Settings(redis_url=away, postprocess_workers=1))) as client:
        reply = client.get("/health")
        answered = time.monotonic() - started
        assert not _state(client).task_messages.connected  # left to the first request
    assert reply.status_code == 503
    assert answered < 3.0  # kombu retries the refused channel for ~6 s, off the loop
