"""Foreground responses: waiting for the end, and what happens when the client leaves first."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import anyio
from fastapi import Request
from redis.exceptions import RedisError
from starlette.responses import Response

from api import metrics, stopping
from api.errors import OpenAIError, response_not_found
from api.http import raw_json_response
from api.relay import coalesced_when_behind, follow_event_batches, sse_chunks, wait_for_terminal
from api.state import AppState
from api.submission import Accepted
from resq import keys

log = logging.getLogger(__name__)

CLEANUP_TIMEOUT_S = 5.0


async def _cancel_generation(state: AppState, response_id: str) -> None:
    """Tell the GPU worker to stop generating ``response_id`` (the client left)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
        await state.redis.set(keys.cancel(response_id), "1", ex=state.settings.transient_ttl_s)
        log.info("client left %s before it ended; generation cancelled", response_id)


async def forget_unstored(state: AppState, response_id: str) -> None:
    """Drop the keys of a ``store=false`` response once its client has it, or has left.

    Nobody can read it again either way. A generation still running keeps only its cancel
    flag (:meth:`api.store.ResponseStore.delete_keys`): the GPU worker stops within a step,
    and nothing of it outlives the flag's TTL.
    """
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT_S):
        await state.store.delete_keys(response_id)


async def client_left(state: AppState, accepted: Accepted, *, stopped_by_server: bool = False) -> None:
    """The client of a foreground response left before its end: stop it, and drop it if unstored.

    ``stopped_by_server``: this API process, stopping (:mod:`api.stopping`), ended the stream or
    closed the socket; the client did not leave. A stored response then runs on, for its client
    to resume on another replica (``starting_after``), as after a ``kill -9`` of the API. An
    unstored one, which nobody could resume, is still dropped.
    """
    if accepted.store and stopped_by_server:
        log.info("the API is stopping; %s runs on, for its client to resume elsewhere", accepted.response_id)
    elif accepted.store:
        await _cancel_generation(state, accepted.response_id)
    else:
        await forget_unstored(state, accepted.response_id)
        log.info("client left %s before it ended; unstored, so dropped", accepted.response_id)


async def stream_new_response(
    state: AppState,
    accepted: Accepted,
    framing: Callable[[AsyncIterator[list[tuple[bytes, bytes]]]], AsyncIterator[bytes]] = sse_chunks,
    coalesce_after: int = 0,
) -> AsyncIterator[bytes]:
    """The SSE body of a response just created, framed by ``framing`` (the protocol's).

    With ``coalesce_after`` (the Responses stream's ``RESQ_SSE_COALESCE_AFTER``), the deltas a
    slow client fell behind on are merged (:func:`api.relay.coalesced_when_behind`); 0 (Chat
    Completions) relays every event as logged. A client that leaves before the end cancels a
    foreground generation (and drops an unstored one); an unstored one is dropped once it was
    delivered, too.
    """
    finished = redis_lost = False
    try:
        followed = follow_event_batches(state.redis, accepted.response_id, opened=accepted.opened)
        # Measured after merging: the metrics count and time the events the client is sent.
        batches = metrics.measured_batches(coalesced_when_behind(followed, coalesce_after))
        async for chunk in framing(batches):
            yield chunk
        finished = True
    except (RedisError, OSError) as error:
        # Redis is gone past the client's retries: the body ends here, without its terminal event
        # (docs/reliability.md). Raised on, it was logged as an unhandled error of a response
        # already started. The client did not leave: nothing to cancel (nor could it be).
        log.warning(
            "Redis unreachable while relaying %s (%s); its stream ends here", accepted.response_id, error
        )
        redis_lost = True
    finally:
        if redis_lost:
            pass
        elif not finished and not accepted.background:
            # An SSE stream's end cannot tell a client that left from a stopping server ending it:
            # while this process stops, it is taken for the server's (a client that leaves in
            # those seconds leaves its generation running to its end).
            await client_left(state, accepted, stopped_by_server=stopping.is_stopping())
        elif finished and not accepted.store:
            await forget_unstored(state, accepted.response_id)


async def wait_for_final(state: AppState, accepted: Accepted, request: Request) -> Response:
    """The final object as the response body; 499 (nobody reads it) when the client left first."""
    final = await final_json(state, accepted, request)
    if final is None:  # the client left: nobody reads this answer, and no server error happened
        return Response(status_code=metrics.CLIENT_CLOSED_REQUEST)
    return raw_json_response(final)


async def final_json(state: AppState, accepted: Accepted, request: Request) -> bytes | None:
    """The final Response JSON of a foreground response; None when the client left first."""
    response_id = accepted.response_id
    async with anyio.create_task_group() as group:
        result: list[bytes | None] = []

        async def wait() -> None:
            result.append(await wait_for_terminal(state.redis, response_id))
            group.cancel_scope.cancel()

        async def watch_client() -> None:
            # A non-streaming client that hangs up must not keep the GPU busy either.
            # Starlette reports a disconnect only when asked: poll.
            while not await request.is_disconnected():  # noqa: ASYNC110
                await anyio.sleep(0.5)
            await client_left(state, accepted)
            group.cancel_scope.cancel()

        async def watch_shutdown() -> None:
            # Waits until just before uvicorn would cancel this request on a SIGTERM (a bare 500,
            # which the SDK retries as a new generation), then gives up the wait for an answer.
            while not stopping.is_stopping():  # noqa: ASYNC110
                await anyio.sleep(0.5)
            await anyio.sleep(stopping.GRACEFUL_SHUTDOWN_S - stopping.ANSWER_MARGIN_S)
            cut_short.append(True)
            group.cancel_scope.cancel()

        cut_short: list[bool] = []
        group.start_soon(wait)
        group.start_soon(watch_client)
        group.start_soon(watch_shutdown)
    if cut_short and not result:
        await _stopped_first(state, accepted)
    if not result:
        return None
    if result[0] is None:
        # Deleted (or expired) while generating: a 5xx would make the SDK retry, creating it again.
        raise response_not_found(response_id)
    metrics.record_delivered_json(result[0])
    if not accepted.store:
        await forget_unstored(state, response_id)
    return result[0]


async def _stopped_first(state: AppState, accepted: Accepted) -> NoReturn:
    """This process is stopping before ``accepted`` ended: a 503 the SDK does not retry
    (``x-should-retry: false``), saying where the response can be read; an unstored one, which
    nobody could read, is dropped."""
    response_id = accepted.response_id
    if accepted.store:
        where = f"retrieve it with GET /v1/responses/{response_id} once it ends"
    else:
        await forget_unstored(state, response_id)
        where = "it was not stored, so it is dropped"
    raise OpenAIError(
        503,
        f"This server is shutting down before response {response_id} ended: {where}.",
        type="server_error",
        headers={"x-should-retry": "false"},
    )
