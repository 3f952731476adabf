"""``/v1/responses``: create (streaming or not, background or not), count input tokens, compact."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from starlette.responses import Response

from api import metrics
from api.compaction import compacted_response, nothing_to_summarise, summary_budget, summary_request
from api.deps import CallerDep, StateDep
from api.foreground import final_json, stream_new_response, wait_for_final
from api.http import json_response
from api.input_tokens import count_input_tokens
from api.prompting import summary_sees_nothing
from api.relay import event_stream_response
from api.schemas import CompactRequest, CreateResponseRequest, InputTokensRequest
from api.submission import accept, served_tokenizer

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1")


@router.post("/responses", response_model=None)
async def create_response(
    body: CreateResponseRequest, state: StateDep, caller: CallerDep, request: Request
) -> Response:
    """Create a response; ``stream`` picks SSE or one JSON body, ``background`` returns at once."""
    accepted = await accept(state, body, caller, follow=bool(body.stream))
    if body.stream:
        body_chunks = stream_new_response(state, accepted, coalesce_after=state.settings.sse_coalesce_after)
        return event_stream_response(body_chunks, state.settings.sse_ping_s)
    if accepted.background:
        return json_response(accepted.created)
    return await wait_for_final(state, accepted, request)


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
    tokenizer = await served_tokenizer(state, body.model)
    if await summary_sees_nothing(state, summarising, tokenizer, caller):
        raise nothing_to_summarise(tokenizer.card.context_length)
    accepted = await accept(state, summarising, caller)
    final = await final_json(state, accepted, request)
    if final is None:
        return Response(status_code=metrics.CLIENT_CLOSED_REQUEST)
    return json_response(compacted_response(final, state.sealer, caller.owner))
