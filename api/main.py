"""Assemble the FastAPI app (``uvicorn --factory api.main:create_app``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sse_starlette.sse import AppStatus

from api.body_limit import BodySizeLimit
from api.errors import install_error_handlers
from api.gate import Gate
from api.log_context import ResponseLogContext
from api.metrics import HTTPMetricsMiddleware
from api.openapi import resq_openapi
from api.routes import chat, conversations, health, metrics, models, responses, socket, stored
from api.state import AppState
from resq import __version__, faults
from resq.settings import Settings, get_settings
from resq.startup_heap import freeze_startup_heap


def create_app(settings: Settings | None = None) -> FastAPI:
    """The resq API for ``settings`` (default: from the environment)."""
    resolved = settings or get_settings()
    # sse-starlette cuts every open stream the moment uvicorn is told to stop, and a cut
    # stream cancels its foreground generation: leave open streams to uvicorn's graceful
    # shutdown (`timeout_graceful_shutdown`), as for any other response.
    AppStatus.disable_automatic_graceful_drain()  # type: ignore[no-untyped-call]  # untyped upstream

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = AppState.build(resolved)
        app.state.resq = state
        faults.prepare()  # the settings behind the fault points, read now rather than by a first request
        # Before uvicorn takes connections: what the API loaded to start out of the collector's
        # sight (resq.startup_heap); a full collection stopped every stream for 50-60 ms.
        freeze_startup_heap()
        warming = asyncio.create_task(state.warm_up())
        # No request waits for the catalog's round trip to ask whether its model is still served.
        refreshing = asyncio.create_task(state.catalog.keep_fresh())
        try:
            yield
        finally:
            warming.cancel()
            refreshing.cancel()
            await state.close()

    app = FastAPI(title="resq", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(responses.router)
    app.include_router(chat.router)
    app.include_router(socket.router)
    app.include_router(stored.router)
    app.include_router(conversations.router)
    app.include_router(models.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.openapi = lambda: resq_openapi(app)  # type: ignore[method-assign]
    # The last added runs first: metrics see every request, then the gate (a request without a
    # valid key is refused before its body is read), then the body limit, then routing.
    app.add_middleware(BodySizeLimit, max_bytes=resolved.max_body_bytes)
    app.add_middleware(Gate)
    app.add_middleware(ResponseLogContext)
    app.add_middleware(HTTPMetricsMiddleware)
    return app
