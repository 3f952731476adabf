"""Errors outside the request's own fault keep the OpenAI envelope and a retryable status."""

from __future__ import annotations

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.errors import install_error_handlers


def _app(error: Exception) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/responses")
    async def create() -> None:
        raise error

    return app


@pytest.mark.parametrize(
    "error",
    [RedisConnectionError("No connection available."), RedisTimeoutError("Timeout reading from socket")],
)
def test_redis_unavailable_is_a_retryable_503_not_a_500(error: Exception) -> None:
    """A burst that outwaits the API's Redis pool (B4 at 4,000 streams) gets 503s the SDKs retry."""
    with TestClient(_app(error)) as client:
        reply = client.post("/v1/responses", json={})
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1"
    body = reply.json()["error"]
    assert body["type"] == "server_error" and body["code"] == "server_overloaded"
    assert "retry" in body["message"]


def test_the_sdk_reads_the_503_as_a_server_error() -> None:
    app = _app(RedisConnectionError("No connection available."))
    with TestClient(app) as http:
        sdk = openai.OpenAI(api_key="x", base_url="http://testserver/v1", http_client=http, max_retries=0)
        with pytest.raises(openai.InternalServerError) as raised:
            sdk.responses.create(model="m", input="hi")
    assert raised.value.status_code == 503


def test_anything_else_unexpected_is_still_a_500_in_the_envelope() -> None:
    with TestClient(_app(ValueError("bug")), raise_server_exceptions=False) as client:
        reply = client.post("/v1/responses", json={})
    assert reply.status_code == 500
    assert reply.json()["error"]["type"] == "server_error"
