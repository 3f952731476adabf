"""The WebSocket mode's server-side failures (``api/routes/socket.py``): an ``error`` event with
the status and OpenAI error HTTP answers with, and a socket that stays usable.

Over HTTP, Redis being unreachable is a 503 ``server_overloaded`` and anything unexpected a 500
(``api/errors.py``); a relay that fails mid-stream ends the body, which the client sees. A socket
has no status line and no end of body: without an ``error`` event its client waits for a
terminal event that never comes. The socket object is real; the client, ``accept`` and the
event log's relay are fakes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from starlette.websockets import WebSocketDisconnect

from api.caller import ANONYMOUS
from api.routes import socket as socket_route
from api.submission import Accepted

MESSAGE = {"type": "response.create", "model": "m", "input": "x", "stream_id": "s1"}
TERMINAL = {"type": "response.completed", "sequence_number": 1, "response": {"status": "completed"}}


class _Client:
    """A client that sends ``messages`` one after another, then waits; it records what it is sent."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self._messages = [json.dumps(message) for message in messages]
        self.sent: list[dict[str, Any]] = []
        self.all_answered = asyncio.Event()
        self._expected = len(messages)

    async def receive(self) -> dict[str, Any]:
        if self._messages:
            return {"type": "websocket.receive", "text": self._messages.pop(0)}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send_text(self, text: str) -> None:
        event = json.loads(text)
        self.sent.append(event)
        if sum(1 for sent in self.sent if _ends_a_message(sent)) == self._expected:
            self.all_answered.set()


def _ends_a_message(event: dict[str, Any]) -> bool:
    return event["type"] in ("error", "response.completed")


def _serve(client: _Client, state: Any) -> None:
    async def scenario() -> None:
        serving = asyncio.create_task(socket_route.Socket(client, state, ANONYMOUS).serve())  # type: ignore[arg-type]
        answered = asyncio.create_task(client.all_answered.wait())
        await asyncio.wait({serving, answered}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert not serving.done(), f"the socket stopped serving: {serving.exception()!r}"
        assert answered.done(), f"not every message was answered: {client.sent}"
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)

    asyncio.run(scenario())


def _state() -> Any:
    return SimpleNamespace(
        settings=SimpleNamespace(websocket_max_s=3600.0, sse_coalesce_after=0), redis=None, rate_limiter=None
    )


def _accepted(response_id: str) -> Accepted:
    return Accepted(response_id=response_id, created={}, background=False, store=True)


@pytest.fixture
def left(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The responses whose generation the socket stopped as a leaving client's."""
    stopped: list[str] = []

    async def client_left(_state: Any, accepted: Accepted, *, stopped_by_server: bool = False) -> None:
        assert not stopped_by_server  # no test here stops the server
        stopped.append(accepted.response_id)

    monkeypatch.setattr(socket_route, "client_left", client_left)
    return stopped


def _accept_failing_first(monkeypatch: pytest.MonkeyPatch, failure: Exception) -> None:
    calls: list[int] = []

    async def accept(*_: Any, **__: Any) -> Accepted:
        calls.append(1)
        if len(calls) == 1:
            raise failure
        return _accepted(f"resp_{len(calls)}")

    async def follow(_redis: Any, _response_id: str, **_: Any) -> AsyncIterator[list[tuple[bytes, bytes]]]:
        yield [(b"response.completed", json.dumps(TERMINAL).encode())]

    monkeypatch.setattr(socket_route, "accept", accept)
    monkeypatch.setattr(socket_route, "follow_event_batches", follow)


def _answers_to_two_messages(monkeypatch: pytest.MonkeyPatch, failure: Exception) -> list[dict[str, Any]]:
    """What a client sending two messages gets when accepting the first raises ``failure``."""
    _accept_failing_first(monkeypatch, failure)
    client = _Client([MESSAGE, MESSAGE])
    _serve(client, _state())
    return client.sent


def test_redis_unreachable_is_a_503_error_event_and_the_socket_stays_usable(
    monkeypatch: pytest.MonkeyPatch, left: list[str]
) -> None:
    error, completed = _answers_to_two_messages(monkeypatch, RedisConnectionError("Connection refused"))
    assert error["type"] == "error"
    assert error["status"] == 503
    assert error["error"]["code"] == "server_overloaded"
    assert error["error"]["type"] == "server_error"
    assert error["stream_id"] == "s1"
    assert completed["type"] == "response.completed"
    assert left == []


def test_an_unexpected_failure_is_a_500_error_event_and_the_socket_stays_usable(
    monkeypatch: pytest.MonkeyPatch, left: list[str]
) -> None:
    error, completed = _answers_to_two_messages(monkeypatch, ValueError("a bug"))
    assert (error["type"], error["status"], error["error"]["type"]) == ("error", 500, "server_error")
    assert "a bug" not in error["error"]["message"]  # an internal detail is logged, not sent
    assert completed["type"] == "response.completed"


def test_a_relay_that_fails_mid_stream_ends_that_response_with_an_error_event(
    monkeypatch: pytest.MonkeyPatch, left: list[str]
) -> None:
    calls: list[int] = []

    async def accept(*_: Any, **__: Any) -> Accepted:
        calls.append(1)
        return _accepted(f"resp_{len(calls)}")

    async def follow(_redis: Any, response_id: str, **_: Any) -> AsyncIterator[list[tuple[bytes, bytes]]]:
        if response_id == "resp_1":
            yield [(b"response.created", b'{"type":"response.created","sequence_number":0}')]
            raise RedisConnectionError("Connection reset by peer")
        yield [(b"response.completed", json.dumps(TERMINAL).encode())]

    monkeypatch.setattr(socket_route, "accept", accept)
    monkeypatch.setattr(socket_route, "follow_event_batches", follow)
    client = _Client([MESSAGE, MESSAGE])
    _serve(client, _state())
    created, error, completed = client.sent
    assert created["type"] == "response.created"
    assert (error["type"], error["status"], error["error"]["code"]) == ("error", 503, "server_overloaded")
    assert error["stream_id"] == "s1"
    # The client gets no more of it: its generation is stopped, as when a client leaves.
    assert left == ["resp_1"]
    assert completed["type"] == "response.completed"


def test_a_cleanup_that_meets_redis_down_does_not_end_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    async def accept(*_: Any, **__: Any) -> Accepted:
        calls.append(1)
        return Accepted(response_id=f"resp_{len(calls)}", created={}, background=False, store=False)

    async def follow(_redis: Any, response_id: str, **_: Any) -> AsyncIterator[list[tuple[bytes, bytes]]]:
        if response_id == "resp_1":
            raise RedisConnectionError("Connection refused")
        yield [(b"response.completed", json.dumps(TERMINAL).encode())]

    async def unreachable(*_: Any) -> None:
        raise RedisConnectionError("Connection refused")

    monkeypatch.setattr(socket_route, "accept", accept)
    monkeypatch.setattr(socket_route, "follow_event_batches", follow)
    # Stopping the failed response and dropping the delivered unstored one both meet Redis down.
    monkeypatch.setattr(socket_route, "client_left", unreachable)
    monkeypatch.setattr(socket_route, "forget_unstored", unreachable)
    client = _Client([MESSAGE, MESSAGE, MESSAGE])
    _serve(client, _state())
    assert [event["type"] for event in client.sent] == ["error", "response.completed", "response.completed"]


class _LeavingClient(_Client):
    """A client that sends its messages and closes the socket once the first is being handled."""

    def __init__(self, messages: list[dict[str, Any]], first_handled: asyncio.Event) -> None:
        super().__init__(messages)
        self._first_handled = first_handled

    async def receive(self) -> dict[str, Any]:
        if self._messages:
            return await super().receive()
        await self._first_handled.wait()
        return {"type": "websocket.disconnect", "code": 1000}

    async def send_text(self, text: str) -> None:
        raise WebSocketDisconnect(1000)  # closed: every send fails


def test_messages_left_behind_by_a_client_that_closed_are_not_accepted(
    monkeypatch: pytest.MonkeyPatch, left: list[str]
) -> None:
    accepted: list[Any] = []

    async def scenario() -> None:
        first_handled = asyncio.Event()

        async def accept(*_: Any, **__: Any) -> Accepted:
            accepted.append(1)
            first_handled.set()
            await asyncio.sleep(0.05)  # while it is accepted, the client closes
            return _accepted(f"resp_{len(accepted)}")

        async def follow(
            _redis: Any, _response_id: str, **_: Any
        ) -> AsyncIterator[list[tuple[bytes, bytes]]]:
            yield [(b"response.completed", json.dumps(TERMINAL).encode())]

        monkeypatch.setattr(socket_route, "accept", accept)
        monkeypatch.setattr(socket_route, "follow_event_batches", follow)
        client = _LeavingClient([MESSAGE, MESSAGE, MESSAGE], first_handled)
        # Ends by itself, quietly: the send that met the closed socket is not an error.
        await asyncio.wait_for(socket_route.Socket(client, _state(), ANONYMOUS).serve(), 5)  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert len(accepted) == 1
