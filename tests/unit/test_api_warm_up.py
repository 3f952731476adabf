"""The API opens its broker channel and builds its tokenizers at start, so the first response does not pay for them."""

from __future__ import annotations

import time

import redis
from starlette.testclient import TestClient

from api.main import create_app
from api.state import AppState
from resq.catalog import register_model
from resq.settings import Settings
from tests.support.processes import free_port
from tests.support.redis_server import PrivateRedis
from tests.support.tokenizer import tiny_tokenizer


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


def test_a_model_registered_after_the_start_has_its_tokenizer_built_before_any_request(
    private_redis: PrivateRedis, r: redis.Redis
) -> None:
    tiny = tiny_tokenizer()
    card = tiny.card.model_copy(update={"name": "warm"})
    with TestClient(create_app(Settings(redis_url=private_redis.url, postprocess_workers=1))) as client:
        state = _state(client)
        time.sleep(0.3)  # started, and no GPU worker has registered a model yet
        assert "warm" not in state.catalog._entries
        register_model(r, card, tiny.tokenizer.to_str())  # as a GPU worker does once its model loaded
        deadline = time.monotonic() + 30
        while "warm" not in state.catalog._entries and time.monotonic() < deadline:
            time.sleep(0.05)
        entry = state.catalog._entries["warm"]
        # Built, and a prompt rendered with it: the template compiled, the prompt encoder made.
        deadline = time.monotonic() + 30
        while "_prompt_encoder" not in vars(entry.tokenizer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "_prompt_encoder" in vars(entry.tokenizer)
