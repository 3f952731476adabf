"""Tagging the log lines of a request about one response with its id."""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from resq.logs import RESPONSE_ID

RESPONSE_PATH = re.compile(r"^/v1/responses/(resp_[0-9A-Za-z]+)")


class ResponseLogContext:
    """Binds the response id of ``/v1/responses/{id}...`` paths for the request's log lines.

    A create request has no id until it is accepted; :func:`resq.logs.bind_response_id`
    tags the rest of it then. Either way the binding ends with the request.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        match = RESPONSE_PATH.match(scope["path"])
        token = RESPONSE_ID.set(match.group(1) if match else None)
        try:
            await self.app(scope, receive, send)
        finally:
            RESPONSE_ID.reset(token)
