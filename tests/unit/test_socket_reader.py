"""The WebSocket's reader (``api/routes/socket.py``): a few messages ahead at most, and never a
socket left unanswered when reading fails.

The socket object is real; the client side is a fake (one that always has another message ready,
a client flooding the socket; one whose reads fail), and handling a message blocks (a response
streaming).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from api.caller import ANONYMOUS
from api.routes import socket as socket_route

MESSAGE = '{"type": "response.create", "model": "m", "input": "x"}'


class _FloodingClient:
    """A client that sends as fast as the server reads."""

    def __init__(self) -> None:
        self.read = 0

    async def receive(self) -> dict[str, Any]:
        self.read += 1
        await asyncio.sleep(0)
        return {"type": "websocket.receive", "text": MESSAGE}


def test_a_flooding_client_is_read_only_a_few_messages_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    handled: list[Any] = []
    streaming = asyncio.Event()

    async def handle_one_forever(self: socket_route.Socket, message: Any) -> None:
        handled.append(message)
        streaming.set()
        await asyncio.Event().wait()  # the first response never ends

    monkeypatch.setattr(socket_route.Socket, "_handle", handle_one_forever)
    client = _FloodingClient()
    state: Any = SimpleNamespace(settings=SimpleNamespace(websocket_max_s=60.0))

    async def scenario() -> None:
        serving = asyncio.create_task(socket_route.Socket(client, state, ANONYMOUS).serve())  # type: ignore[arg-type]
        await asyncio.wait_for(streaming.wait(), 5)
        for _ in range(200):  # ample turns of the loop for an unbounded reader to run away
            await asyncio.sleep(0)
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)

    asyncio.run(scenario())
    assert len(handled) == 1
    # The one being handled, the queue full, and the one the reader holds waiting for room.
    assert client.read == 1 + socket_route.MESSAGES_AHEAD + 1


class _BrokenClient:
    """A client whose socket cannot be read (a bug in the reading path, not a disconnect)."""

    async def receive(self) -> dict[str, Any]:
        raise KeyError("text")


def test_a_reader_that_fails_ends_the_socket_instead_of_leaving_it_unanswered() -> None:
    state: Any = SimpleNamespace(settings=SimpleNamespace(websocket_max_s=3600.0))

    async def scenario() -> None:
        # Within its hour, the socket is served until its reader says it closed.
        await asyncio.wait_for(socket_route.Socket(_BrokenClient(), state, ANONYMOUS).serve(), 5)  # type: ignore[arg-type]

    asyncio.run(scenario())
