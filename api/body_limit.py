"""The request-body size limit (``RESQ_MAX_BODY_BYTES``), enforced before anything parses JSON.

A declared ``Content-Length`` over the limit is refused at once, without reading the
body; a chunked body (no ``Content-Length``) is read up to the limit and refused as
soon as it passes it. Either way the client gets a 413 in OpenAI's error envelope,
and the app never holds more than the limit of one request in memory.

A compressed body (``Content-Encoding``, see ``api.body_encoding``) is held to the limit
twice: as sent, as above, and decoded, so a zip bomb gets the same 413. The app then
sees a plain body: no ``Content-Encoding``, a ``Content-Length`` that matches it.
"""

from __future__ import annotations

import anyio.to_thread
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import body_encoding
from api.errors import OpenAIError
from api.http import json_response


def too_large(limit: int, *, decoded: bool = False) -> OpenAIError:
    """The 413 for a body over ``limit`` bytes (``decoded``: once decompressed)."""
    counted = " once decompressed" if decoded else ""
    return OpenAIError(
        413,
        f"The request body is larger{counted} than this server accepts ({limit} bytes).",
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

    The body is read here in full (the JSON routes read it whole anyway), decoded if
    it has a ``Content-Encoding``, and handed to the app as one message; later
    ``receive`` calls (disconnect checks) pass through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            codings = body_encoding.content_codings(scope.get("headers", []))
        except OpenAIError as error:
            await _refuse(error, scope, receive, send, close=True)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _refuse(too_large(self.max_bytes), scope, receive, send, close=True)
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
                await _refuse(too_large(self.max_bytes), scope, receive, send, close=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks  # one copy of the body while it is decoded, not two
        if codings:
            if body:
                try:
                    # Off the event loop: inflating megabytes takes milliseconds, and a tiny
                    # body can inflate to the limit, so no compressed size is safe inline.
                    body = await anyio.to_thread.run_sync(body_encoding.decode, body, codings, self.max_bytes)
                except body_encoding.DecodedTooLargeError:
                    await _refuse(too_large(self.max_bytes, decoded=True), scope, receive, send)
                    return
                except OpenAIError as error:
                    await _refuse(error, scope, receive, send)
                    return
            scope = _decoded_scope(scope, len(body))
        await self.app(scope, _replay(body, receive), send)


async def _refuse(
    error: OpenAIError, scope: Scope, receive: Receive, send: Send, *, close: bool = False
) -> None:
    # ``close``: the body is left unread, so the connection cannot carry another request.
    headers = {"Connection": "close"} if close else None
    reply = json_response(error.body(), status_code=error.status_code, headers=headers)
    await reply(scope, receive, send)


def _decoded_scope(scope: Scope, length: int) -> Scope:
    """``scope`` for the decoded body: the app must neither decode it again nor trust the old length."""
    dropped = (b"content-encoding", b"content-length", b"transfer-encoding")
    headers = [(name, value) for name, value in scope.get("headers", []) if name not in dropped]
    headers.append((b"content-length", str(length).encode("ascii")))
    return {**scope, "headers": headers}


def _replay(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
