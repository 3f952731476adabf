"""``/v1/responses/{id}``: retrieve (JSON or a resumable event stream), cancel, delete, input items.

Every route reads the response through :class:`api.store.ResponseStore`, which
answers 400 for a malformed id and 404 for an unknown, expired, unstored
(``store=false``) or foreign one. Everything lives in Redis, so any API process
serves any response, including a stream resumed from the middle.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from redis.exceptions import RedisError
from starlette.responses import Response

from api.deps import CallerDep, StateDep
from api.errors import invalid_value, response_not_found
from api.http import json_response, raw_json_response
from api.input_items import PageParameterError, paginate, parse_page_request
from api.query import boolean, check_include, non_negative_int
from api.relay import coalesced_when_behind, event_stream_response, follow_event_batches, sse_chunks
from api.state import AppState

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1")


async def _replay(state: AppState, response_id: str, starting_after: int | None) -> AsyncIterator[bytes]:
    # A client leaving a resumed stream cancels nothing: only the creating request owns
    # the generation (and a background one outlives every stream). The first batch is the replay
    # of what is logged, sent exactly; only a live one's later lag is merged.
    followed = follow_event_batches(state.redis, response_id, starting_after)
    batches = coalesced_when_behind(followed, state.settings.sse_coalesce_after)
    try:
        async for chunk in sse_chunks(batches):
            yield chunk
    except (RedisError, OSError) as error:
        # As a new response's stream (api.foreground): the body ends, not an unhandled error.
        log.warning("Redis unreachable while relaying %s (%s); its stream ends here", response_id, error)


@router.get("/responses/{response_id}", response_model=None)
async def retrieve_response(
    response_id: str, state: StateDep, caller: CallerDep, request: Request
) -> Response:
    """The Response; with ``stream=true``, its events after ``starting_after`` (all without it), then live ones."""
    stream = boolean(request.query_params.get("stream"), "stream")
    starting_after = non_negative_int(request.query_params.get("starting_after"), "starting_after")
    stored = await state.store.get(response_id, caller)
    if stream:
        return event_stream_response(_replay(state, response_id, starting_after), state.settings.sse_ping_s)
    return raw_json_response(stored.current_json())


@router.post("/responses/{response_id}/cancel", response_model=None)
async def cancel_response(response_id: str, state: StateDep, caller: CallerDep) -> Response:
    """Cancel a background response; answers with the final cancelled Response (the same every time).

    A response that ended before the cancel keeps its status and is returned as it is.
    """
    stored = await state.store.get(response_id, caller)
    if not stored.background:
        raise invalid_value("Only responses created with 'background' set to true can be cancelled.", None)
    if not stored.final:
        if not await state.store.cancel(stored):
            raise response_not_found(response_id)
        stored = await state.store.wait_until_final(response_id, caller, state.settings.cancel_wait_s)
    return raw_json_response(stored.current_json())


@router.delete("/responses/{response_id}", response_model=None)
async def delete_response(response_id: str, state: StateDep, caller: CallerDep) -> Response:
    """Remove every key of the response; a generation still running is stopped."""
    stored = await state.store.get(response_id, caller)
    if not await state.store.delete(stored):
        raise response_not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


@router.get("/responses/{response_id}/input_items", response_model=None)
async def list_input_items(
    response_id: str, state: StateDep, caller: CallerDep, request: Request
) -> Response:
    """One page of the response's input items (``limit``, ``after``, ``order``)."""
    query = request.query_params
    check_include(query)
    stored = await state.store.get(response_id, caller)
    try:
        page_request = parse_page_request(query.get("limit"), query.get("order"), query.get("after"))
        page = paginate(await state.store.input_items(stored), page_request)
    except PageParameterError as exc:
        raise invalid_value(str(exc), exc.param) from exc
    return json_response(page)
