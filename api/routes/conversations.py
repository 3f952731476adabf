"""``/v1/conversations``: create, retrieve, update and delete conversations, and list, add,
retrieve and delete their items (OpenAI's Conversations API).

Every route goes through :class:`api.conversations.ConversationStore`, which
answers 400 for a malformed id and 404 for an unknown, expired or foreign one.
Query parameters are parsed by hand (like the stored-response routes), so that a
bad value gets OpenAI's envelope naming it; ``openapi_extra`` declares them in
``/openapi.json``. ``include`` is accepted with every value the SDK knows: items
hold nothing more to include.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from api.conversation_schemas import AddItemsRequest, CreateConversationRequest, UpdateConversationRequest
from api.conversations import check_conversation_id, item_list, prepare_items
from api.deps import CallerDep, StateDep
from api.errors import invalid_value
from api.http import json_response
from api.input_items import MAX_LIMIT, PageParameterError, parse_page_request
from api.query import check_include
from api.schemas import KNOWN_INCLUDES, InputItem
from api.sealed_items import check_sealed
from resq.conversations import MAX_ITEM_ID_CHARS
from resq.ids import CONVERSATION_ID_PATTERN

router = APIRouter(prefix="/v1")

ConversationId = Annotated[
    str,
    Path(
        description="The conversation's id.",
        json_schema_extra={"pattern": CONVERSATION_ID_PATTERN.pattern},
    ),
]
ItemId = Annotated[
    str,
    Path(description="The item's id.", json_schema_extra={"minLength": 1, "maxLength": MAX_ITEM_ID_CHARS}),
]


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_INCLUDE = _query(
    "include",
    {"type": "array", "items": {"type": "string", "enum": sorted(KNOWN_INCLUDES)}},
    "Accepted for the SDK's sake: conversation items have nothing more to include.",
)
_INCLUDE_ONLY: dict[str, Any] = {"parameters": [_INCLUDE]}
_LIST_PARAMETERS: dict[str, Any] = {
    "parameters": [
        _query("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}, "Items per page."),
        _query("order", {"type": "string", "enum": ["asc", "desc"]}, "Order of the items."),
        _query("after", {"type": "string"}, "List the items after this item id."),
        _INCLUDE,
    ]
}


def _dumped(items: list[InputItem]) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in items]


@router.post("/conversations", response_model=None)
async def create_conversation(
    state: StateDep, caller: CallerDep, body: CreateConversationRequest | None = None
) -> Response:
    """A new conversation, with up to 20 initial items and metadata."""
    body = body or CreateConversationRequest()
    items = prepare_items(_dumped(body.items or []))
    check_sealed(items, state.sealer, caller.owner)
    stored = await state.conversations.create(caller, items, body.metadata or {})
    return json_response(stored.to_json())


@router.get("/conversations/{conversation_id}", response_model=None)
async def retrieve_conversation(
    conversation_id: ConversationId, state: StateDep, caller: CallerDep
) -> Response:
    """The conversation (id, creation time, metadata)."""
    stored = await state.conversations.get(conversation_id, caller)
    return json_response(stored.to_json())


@router.post("/conversations/{conversation_id}", response_model=None)
async def update_conversation(
    conversation_id: ConversationId, body: UpdateConversationRequest, state: StateDep, caller: CallerDep
) -> Response:
    """Replace the conversation's metadata."""
    stored = await state.conversations.update(conversation_id, caller, body.metadata or {})
    return json_response(stored.to_json())


@router.delete("/conversations/{conversation_id}", response_model=None)
async def delete_conversation(
    conversation_id: ConversationId, state: StateDep, caller: CallerDep
) -> Response:
    """Remove the conversation and every item of it (the responses made in it stay)."""
    await state.conversations.delete(conversation_id, caller)
    return json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


@router.get("/conversations/{conversation_id}/items", response_model=None, openapi_extra=_LIST_PARAMETERS)
async def list_conversation_items(
    conversation_id: ConversationId, state: StateDep, caller: CallerDep, request: Request
) -> Response:
    """One page of the conversation's items (``limit``, ``after``, ``order``; newest first by default)."""
    check_conversation_id(conversation_id)
    query = request.query_params
    try:
        page = parse_page_request(query.get("limit"), query.get("order"), query.get("after"))
    except PageParameterError as exc:
        raise invalid_value(str(exc), exc.param) from exc
    check_include(query)
    return json_response(await state.conversations.list_items(conversation_id, caller, page))


@router.post("/conversations/{conversation_id}/items", response_model=None, openapi_extra=_INCLUDE_ONLY)
async def add_conversation_items(
    conversation_id: ConversationId,
    body: AddItemsRequest,
    state: StateDep,
    caller: CallerDep,
    request: Request,
) -> Response:
    """Append 1 to 20 items; the items added, as a list."""
    check_conversation_id(conversation_id)
    check_include(request.query_params)
    items = prepare_items(_dumped(body.items))
    check_sealed(items, state.sealer, caller.owner)
    added = await state.conversations.add_items(conversation_id, caller, items)
    return json_response(item_list(added, has_more=False))


@router.get(
    "/conversations/{conversation_id}/items/{item_id:path}", response_model=None, openapi_extra=_INCLUDE_ONLY
)
async def retrieve_conversation_item(
    conversation_id: ConversationId, item_id: ItemId, state: StateDep, caller: CallerDep, request: Request
) -> Response:
    """One item of the conversation."""
    check_conversation_id(conversation_id)
    check_include(request.query_params)
    return json_response(await state.conversations.get_item(conversation_id, item_id, caller))


@router.delete("/conversations/{conversation_id}/items/{item_id:path}", response_model=None)
async def delete_conversation_item(
    conversation_id: ConversationId, item_id: ItemId, state: StateDep, caller: CallerDep
) -> Response:
    """Remove one item; the conversation."""
    stored = await state.conversations.delete_item(conversation_id, item_id, caller)
    return json_response(stored.to_json())
