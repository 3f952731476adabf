"""Input items as ``GET /v1/responses/{id}/input_items`` lists them: their stored shape and paging.

Pure functions. Items are normalised when a response is accepted, so that the
list endpoint returns stored JSON as it is and every item already has the shape
of the SDK's ``ResponseItem`` union: an id, a ``type``, message content as a
list of parts (``input_text`` for user, system and developer messages,
``output_text`` with ``annotations`` for assistant ones) and a ``status``.
The text the chat template sees is unchanged by normalising (a unit test checks
``items_to_messages`` gives the same messages either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from api.query import decimal
from resq import ids

Item = dict[str, Any]
Order = Literal["asc", "desc"]

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
DEFAULT_ORDER: Order = "desc"


class PageParameterError(ValueError):
    """A paging query parameter has a bad value; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _text_parts(content: Any, assistant: bool) -> list[dict[str, Any]]:
    if isinstance(content, str):
        content = [{"type": "input_text", "text": content}]
    parts: list[dict[str, Any]] = []
    for part in content or []:
        kind = part.get("type")
        if kind == "refusal" and assistant:
            parts.append({"type": "refusal", "refusal": part.get("refusal", "")})
        elif kind in ("input_text", "output_text", "refusal"):
            text = part.get("refusal", "") if kind == "refusal" else part.get("text", "")
            if assistant:
                parts.append(
                    {"type": "output_text", "text": text, "annotations": part.get("annotations") or []}
                )
            else:
                normal: dict[str, Any] = {"type": "input_text", "text": text}
                if part.get("prompt_cache_breakpoint") is not None:
                    # Kept: a later turn's explicit prompt caching counts its history's breakpoints.
                    normal["prompt_cache_breakpoint"] = part["prompt_cache_breakpoint"]
                parts.append(normal)
    return parts


def normalise_item(item: Item, item_id: str) -> Item:
    """``item`` (as the request sent it) in the shape the API lists it, with ``item_id`` if it had none."""
    kind = item.get("type") or "message"
    identifier = item.get("id") or item_id
    if kind == "message":
        role = item["role"]
        assistant = role == "assistant"
        return {
            "id": identifier,
            "type": "message",
            "role": role,
            "content": _text_parts(item.get("content"), assistant),
            "status": item.get("status") or "completed",
        }
    if kind in ("function_call", "custom_tool_call"):
        payload = "arguments" if kind == "function_call" else "input"
        call = {
            "id": identifier,
            "type": kind,
            "call_id": item["call_id"],
            "name": item["name"],
            payload: item.get(payload, ""),
            "status": item.get("status") or "completed",
        }
        if item.get("namespace") is not None:
            call["namespace"] = item["namespace"]
        return call
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {
            "id": identifier,
            "type": kind,
            "call_id": item["call_id"],
            "output": item.get("output", ""),
            "status": item.get("status") or "completed",
        }
    normalised = {**item, "id": identifier}
    if kind == "compaction":
        # The SDK's compaction item has no status: listed with one, it could not be sent back.
        normalised.pop("status", None)
    else:
        normalised.setdefault("status", "completed")
    return normalised


def normalise_input(items: list[Item], response_id: str) -> list[Item]:
    """Every input item of ``response_id`` normalised, numbered by position when it has no id."""
    return [normalise_item(item, ids.input_item_id(response_id, index)) for index, item in enumerate(items)]


def duplicate_id(new_items: list[Item], history: list[Item]) -> str | None:
    """The first id of ``new_items`` (normalised) that another of them, or ``history``, already has.

    OpenAI refuses such an input (400, "Duplicate item found with id ..."); a conversation would
    otherwise hold two items of one id, and its append would overwrite the first.
    """
    seen = {item.get("id") for item in history}
    for item in new_items:
        item_id = item.get("id")
        if item_id in seen:
            return str(item_id)
        seen.add(item_id)
    return None


@dataclass(frozen=True)
class PageRequest:
    """What a client asked of the list: ``limit`` items after ``after``, in ``order``."""

    limit: int = DEFAULT_LIMIT
    order: Order = DEFAULT_ORDER
    after: str | None = None


def parse_page_request(limit: str | None, order: str | None, after: str | None) -> PageRequest:
    """The query parameters checked (``limit`` 1-100, ``order`` ``asc``/``desc``)."""
    parsed_limit = DEFAULT_LIMIT
    if limit is not None:
        try:
            parsed_limit = decimal(limit)
        except ValueError:
            raise PageParameterError("limit", f"Invalid 'limit': {limit!r} is not an integer.") from None
        if not 1 <= parsed_limit <= MAX_LIMIT:
            raise PageParameterError(
                "limit", f"Invalid 'limit': {parsed_limit}. It must be between 1 and {MAX_LIMIT}."
            )
    parsed_order: Order = DEFAULT_ORDER
    if order is not None:
        if order not in ("asc", "desc"):
            raise PageParameterError("order", f"Invalid 'order': {order!r}. Expected 'asc' or 'desc'.")
        parsed_order = "asc" if order == "asc" else "desc"
    return PageRequest(parsed_limit, parsed_order, after or None)


def paginate(items: list[Item], request: PageRequest) -> dict[str, Any]:
    """One page of ``items`` (stored in input order), OpenAI's list shape (``ResponseItemList``).

    ``has_more`` is true exactly when items remain after this page in the chosen
    order, so a client following ``last_id`` stops at the end.
    """
    ordered = items if request.order == "asc" else items[::-1]
    start = 0
    if request.after is not None:
        positions = [index for index, item in enumerate(ordered) if item.get("id") == request.after]
        if not positions:
            raise PageParameterError("after", f"No input item with id {request.after!r} in this response.")
        start = positions[0] + 1
    page = ordered[start : start + request.limit]
    return {
        "object": "list",
        "data": page,
        # "" for an empty page, as the conversation item list: the SDK types both as str.
        "first_id": page[0]["id"] if page else "",
        "last_id": page[-1]["id"] if page else "",
        "has_more": start + len(page) < len(ordered),
    }
