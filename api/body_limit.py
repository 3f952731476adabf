"""The request-body size limit (``RESQ_MAX_BODY_BYTES``), enforced before anything parses JSON.

A declared ``Content-Length`` over the limit is refused at once, without reading the
body; a chunked body (no ``Content-Length``) is read up to the limit and refused as
soon as it passes it. Either way the client gets a 413 in OpenAI's error envelope,
and the app never holds more than the limit of one request in memory.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import OpenAIError
from api.http import json_response


def too_large(limit: int) -> OpenAIError:
    """The 413 for a body over ``limit`` bytes."""
    return OpenAIError(
        413,
        f"The request body is larger than this server accepts ({limit} bytes).",
        code="request_too_large",
    )


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server rejects a malformed Content-Length itself
    return None


class BodySizeLimit:
    """ASGI middleware: requests with a body over ``max_bytes`` get a 413.

    The body is read here in full (the JSON routes read it whole anyway) and handed
    to the app as one message; later ``receive`` calls (disconnect checks) pass through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = too_large(self.max_bytes)
        # Close the connection: the rest of the body is never read.
        reply = json_response(error.body(), status_code=413, headers={"Connection": "close"})
        await reply(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
