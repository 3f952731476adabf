"""``/v1/responses``: create (streaming or not, background or not), count input tokens, compact."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from starlette.responses import Response

from api import metrics
from api.compaction import compacted_response, summary_budget, summary_request
from api.deps import CallerDep, StateDep
from api.errors import response_not_found
from api.http import json_response, raw_json_response
from api.input_tokens import count_input_tokens
from api.relay import event_stream_response, follow_event_batches, sse_chunks, wait_for_terminal
from api.schemas import CompactRequest, CreateResponseRequest, InputTokensRequest
from api.state import AppState
from api.submission import Accepted, accept
from resq import keys

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1")

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


async def client_left(state: AppState, accepted: Accepted) -> None:
    """The client of a foreground response left before its end: stop it, and drop it if unstored."""
    if accepted.store:
        await _cancel_generation(state, accepted.response_id)
    else:
        await forget_unstored(state, accepted.response_id)
        log.info("client left %s before it ended; unstored, so dropped", accepted.response_id)


async def _stream_new_response(state: AppState, accepted: Accepted) -> AsyncIterator[bytes]:
    finished = False
    try:
        batches = metrics.measured_batches(follow_event_batches(state.redis, accepted.response_id))
        async for chunk in sse_chunks(batches):
            yield chunk
        finished = True
    finally:
        if not finished and not accepted.background:
            await client_left(state, accepted)
        elif finished and not accepted.store:
            await forget_unstored(state, accepted.response_id)


@router.post("/responses", response_model=None)
async def create_response(
    body: CreateResponseRequest, state: StateDep, caller: CallerDep, request: Request
) -> Response:
    """Create a response; ``stream`` picks SSE or one JSON body, ``background`` returns at once."""
    accepted = await accept(state, body, caller)
    if body.stream:
        return event_stream_response(_stream_new_response(state, accepted), state.settings.sse_ping_s)
    if accepted.background:
        return json_response(accepted.created)
    return await _wait_for_final(state, accepted, request)


async def _wait_for_final(state: AppState, accepted: Accepted, request: Request) -> Response:
    final = await _final_json(state, accepted, request)
    if final is None:  # the client left: nobody reads this answer, and no server error happened
        return Response(status_code=metrics.CLIENT_CLOSED_REQUEST)
    return raw_json_response(final)


async def _final_json(state: AppState, accepted: Accepted, request: Request) -> bytes | None:
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

        group.start_soon(wait)
        group.start_soon(watch_client)
    if not result:
        return None
    if result[0] is None:
        # Deleted (or expired) while generating: a 5xx would make the SDK retry, creating it again.
        raise response_not_found(response_id)
    metrics.record_delivered_json(result[0])
    if not accepted.store:
        await forget_unstored(state, response_id)
    return result[0]


@router.post("/responses/input_tokens", response_model=None)
async def input_tokens(body: InputTokensRequest, state: StateDep, caller: CallerDep) -> Response:
    """The number of prompt tokens a create with this body would give the engine."""
    count = await count_input_tokens(state, body, caller)
    return json_response({"object": "response.input_tokens", "input_tokens": count})


@router.post("/responses/compact", response_model=None)
async def compact(body: CompactRequest, state: StateDep, caller: CallerDep, request: Request) -> Response:
    """The conversation compacted into one ``compaction`` item, its summary written by the served model."""
    counting = InputTokensRequest.model_validate(
        body.model_dump(include={"model", "input", "instructions", "previous_response_id"}, exclude_none=True)
    )
    conversation_tokens = await count_input_tokens(state, counting, caller)
    budget = summary_budget(conversation_tokens, state.settings.compaction_max_output_tokens)
    summarising = summary_request(body, budget)
    accepted = await accept(state, summarising, caller)
    final = await _final_json(state, accepted, request)
    if final is None:
        return Response(status_code=metrics.CLIENT_CLOSED_REQUEST)
    return json_response(compacted_response(final, state.sealer, caller.owner))
