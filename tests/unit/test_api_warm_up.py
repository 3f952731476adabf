"""The API opens its broker channel and builds its tokenizers at start, so the first response does not pay for them."""

from __future__ import annotations

import time

import pytest
import redis
from kombu.exceptions import OperationalError
from starlette.testclient import TestClient

from api.main import create_app
from api.state import AppState
from resq.catalog import register_model
from resq.settings import Settings
from resq.task_messages import TaskMessages
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


def test_a_broker_that_is_away_neither_delays_the_start_nor_fails_it(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As with Redis away (kombu retries the refused channel for ~6 s, then raises), off the loop.

    Redis itself stays up here: an app on a dead Redis left its reaper thread retrying and logging
    tracebacks into the tests after it, and formatting one (which parses source with ``ast`` in
    CPython 3.11) on that thread made test_boundaries' own ``ast.parse`` fail with "AST constructor
    recursion depth mismatch" in a fresh-clone run."""

    def refused(_self: TaskMessages) -> None:
        time.sleep(2.0)
        raise OperationalError("Error 111 connecting to 127.0.0.1:6390. Connection refused.")

    monkeypatch.setattr(TaskMessages, "connect", refused)
    started = time.monotonic()
    with TestClient(create_app(Settings(redis_url=redis_url, postprocess_workers=1))) as client:
        reply = client.get("/health")
        answered = time.monotonic() - started
        time.sleep(2.5)  # the warm-up has failed by now
        assert not _state(client).task_messages.connected  # left to the first request
    assert reply.status_code in (200, 503)  # whatever the workers say: it answers
    assert answered < 1.5


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
        # Built, and a prompt rendered with it as a request's is: the template compiled, the prompt
        # encoder made, with its length bound and its pieces' splitter (a first request built those).
        deadline = time.monotonic() + 30

        def built() -> set[str]:
            encoder = vars(entry.tokenizer).get("_prompt_encoder")
            return set(vars(encoder)) if encoder is not None else set()

        while "_piece_splitter" not in built() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {"bytes_per_token", "escaper", "_piece_splitter"} <= built()
