"""The gate in front of ``/v1``: authentication, then the per-key rate limit.

It runs before routing and body parsing, so a request without a valid key gets
its 401 whatever else is wrong with it (as OpenAI answers), and learns nothing
about routes or ids. ``/health``, ``/metrics`` and FastAPI's schema pages stay
open. The caller it proves is left in the ASGI scope for
:func:`api.deps.get_caller`.
"""

from __future__ import annotations

import logging

from redis.exceptions import RedisError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from api.caller import Caller
from api.errors import OpenAIError, rate_limited
from api.http import json_response
from api.state import AppState
from resq import jsonutil
from resq.logs import printable

log = logging.getLogger(__name__)

CALLER_SCOPE_KEY = "resq.caller"
"""Where the gate leaves the authenticated :class:`api.caller.Caller` in the ASGI scope."""


def protected(path: str) -> bool:
    """Whether ``path`` needs an API key: ``/v1`` and everything under it."""
    return path == "/v1" or path.startswith("/v1/")


class Gate:
    """ASGI middleware: 401 without a valid key, 429 over the key's rate limit, on ``/v1`` paths."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point (HTTP requests and WebSocket handshakes alike)."""
        if scope["type"] not in ("http", "websocket") or not protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        state: AppState = scope["app"].state.resq
        try:
            caller = state.keyring.authenticate(Headers(scope=scope).get("authorization"))
            if scope["type"] == "http":  # a socket's messages are counted, one by one, not its handshake
                await check_rate(state, caller)
        except OpenAIError as error:
            # Never the header itself: the key must not reach a log. The path is the client's,
            # decoded (`%0A` is a newline): escaped, it cannot start a forged log line.
            path = printable(scope["path"])
            method = scope.get("method", "WEBSOCKET")
            log.info("%s %s refused (%d): %s", method, path, error.status_code, error.code)
            if scope["type"] == "websocket":
                await receive()  # websocket.connect
                if "websocket.http.response" in scope.get("extensions", {}):
                    # The upgrade refused with the answer HTTP gives (a 401 and its OpenAI body).
                    await _deny_upgrade(error, send)
                else:  # a server without the extension refuses it with a bare 403
                    await send({"type": "websocket.close", "code": 1008, "reason": error.code or ""})
                return
            await json_response(error.body(), error.status_code, error.headers)(scope, receive, send)
            return
        scope[CALLER_SCOPE_KEY] = caller
        await self.app(scope, receive, send)


async def _deny_upgrade(error: OpenAIError, send: Send) -> None:
    body = jsonutil.dumps(error.body())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((name.lower().encode(), value.encode()) for name, value in (error.headers or {}).items()),
    ]
    await send({"type": "websocket.http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


async def check_rate(state: AppState, caller: Caller) -> None:
    """Take one request from ``caller``'s rate limit; a 429 ``rate_limit_exceeded`` when none is left."""
    limiter = state.rate_limiter
    if limiter is None:
        return
    try:
        wait_s = await limiter.take(caller)
    except (RedisError, OSError) as exc:
        # The limit protects capacity, not data: without Redis the request fails on its own anyway.
        log.warning("rate limit not checked, Redis did not answer: %s", exc)
        return
    if wait_s is not None:
        raise rate_limited(
            f"Rate limit reached on requests per min (RPM): Limit {limiter.requests_per_minute}. "
            f"Please try again in {wait_s:.1f}s.",
            wait_s,
        )


def caller_of(scope: Scope) -> Caller | None:
    """The caller the gate proved for this request, None when it did not run."""
    caller = scope.get(CALLER_SCOPE_KEY)
    return caller if isinstance(caller, Caller) else None
