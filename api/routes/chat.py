"""``POST /v1/chat/completions``: Chat Completions through the same queue as ``/v1/responses``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from api import chat
from api.chat_schemas import ChatCompletionRequest
from api.deps import CallerDep, StateDep
from api.errors import OpenAIError
from api.foreground import final_json, stream_new_response
from api.http import raw_json_response
from api.metrics import CLIENT_CLOSED_REQUEST
from api.relay import chat_sse_chunks, event_stream_response
from api.submission import accept
from resq import jsonutil

router = APIRouter(prefix="/v1")


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, state: StateDep, caller: CallerDep, request: Request
) -> Response:
    """Create a chat completion; ``stream`` picks ``chat.completion.chunk`` SSE or one JSON body.

    Never stored. A client that hangs up cancels the generation; a generation that fails
    streams an ``{"error": ...}`` body, or answers with it: 400 when the request was at fault
    (its grammar could not be followed to the end), else 500.
    """
    try:
        accepted = await accept(
            state, chat.responses_request(body), caller, chat=chat.extras(body), follow=bool(body.stream)
        )
    except OpenAIError as error:  # named in Responses terms (a schema, the context): say it in chat's
        raise chat.in_chat_terms(error, body) from None
    if body.stream:
        return event_stream_response(
            stream_new_response(state, accepted, chat_sse_chunks), state.settings.sse_ping_s
        )
    final = await final_json(state, accepted, request)
    if final is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    failure = jsonutil.loads(final).get("error")
    if failure is not None:
        status = 400 if failure.get("type") == "invalid_request_error" else 500
        return raw_json_response(final, status_code=status)
    return raw_json_response(final)
