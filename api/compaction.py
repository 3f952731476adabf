"""Compaction: a conversation replaced by a summary the served model writes.

``POST /v1/responses/compact`` turns a conversation (``input``, and the history of a
``previous_response_id``) into ``{object: "response.compaction", output, usage}``
whose output is one ``compaction`` item: its ``encrypted_content`` seals the summary
(AES-GCM, bound to the caller's key: :mod:`resq.sealed`). OpenAI's output also
repeats the user messages, as ``message`` items with ``input_text`` content that the
SDK's strict validation refuses in an output list; resq leaves them out (the
summary covers them, and a client replays the compaction item alone). Sent back as input, the compaction item stands for every
item before it (:func:`resq.conversation.since_last_compaction`): the next
prompt is the summary and what follows it.

The summary is a generation like any other: :func:`summary_request` is an
unstored create request (the conversation, then :data:`COMPACTION_PROMPT`) that
goes through admission, the queue, a GPU worker and a post-processor, so it
costs GPU time, is metered, survives a worker crash, and any replica serves it.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError

from api.errors import OpenAIError
from api.schemas import SERVER_BUILT, CompactRequest, CreateResponseRequest
from resq import ids, jsonutil, sealed
from resq.conversation import content_text
from resq.sealed import Sealer

Item = dict[str, Any]

COMPACTION_PROMPT = (
    "Summarize the conversation so far for your own later use: the user's goals and requests, "
    "the decisions made, facts and results learned (tool results included), and what is left "
    "to do. Write only the summary."
)
"""The user message that asks the model for the summary, after the conversation."""


MIN_SUMMARY_TOKENS = 16


def summary_budget(conversation_tokens: int, configured: int) -> int:
    """The summary's ``max_output_tokens``: the configured budget, and at most half the conversation
    (never below ``MIN_SUMMARY_TOKENS``), so that the summary is shorter than what it replaces
    whatever the model writes. The prompt after a compaction also holds the summary's framing and
    the last turn again: one of a conversation only a few dozen tokens long can be longer."""
    return max(MIN_SUMMARY_TOKENS, min(configured, conversation_tokens // 2))


def summary_request(request: CompactRequest, max_output_tokens: int) -> CreateResponseRequest:
    """The unstored create request whose answer is the summary of ``request``'s conversation."""
    given: list[Any] = []
    if isinstance(request.input, str):
        given = [{"type": "message", "role": "user", "content": request.input}]
    elif request.input is not None:
        given = [item.model_dump(exclude_none=True) for item in request.input]
    options = request.prompt_cache_options
    return summary_of(
        request.model,
        given,
        request.instructions,
        max_output_tokens,
        request.previous_response_id,
        options.model_dump(exclude_none=True) if options is not None else None,
    )


def summary_of(
    model: str,
    items: list[Item],
    instructions: str | None,
    max_output_tokens: int,
    previous_response_id: str | None = None,
    cache_options: dict[str, Any] | None = None,
) -> CreateResponseRequest:
    """The unstored create request whose answer summarises ``items`` (after a previous response's).

    The items were accepted as input before; one that no longer validates is the server's fault.
    ``cache_options``: the compact request's ``prompt_cache_options`` (never a prewarm: refused).
    """
    try:
        return _summary_of(model, items, instructions, max_output_tokens, previous_response_id, cache_options)
    except ValidationError as exc:
        raise OpenAIError(
            500,
            f"Compaction failed: the conversation could not be summarised ({exc.error_count()} item errors).",
            type="server_error",
            code="server_error",
        ) from exc


def _summary_of(
    model: str,
    items: list[Item],
    instructions: str | None,
    max_output_tokens: int,
    previous_response_id: str | None,
    cache_options: dict[str, Any] | None,
) -> CreateResponseRequest:
    unique = _first_of_each_id(items)
    return CreateResponseRequest.model_validate(
        {
            "model": model,
            "input": [*unique, {"type": "message", "role": "user", "content": COMPACTION_PROMPT}],
            "instructions": instructions,
            "previous_response_id": previous_response_id,
            "store": False,
            "max_output_tokens": max_output_tokens,
            "temperature": 0.0,
            # A conversation too long for the context is exactly what gets compacted.
            "truncation": "auto",
            "prompt_cache_options": cache_options,
        },
        context=SERVER_BUILT,
    )


def nothing_to_summarise(context_length: int) -> OpenAIError:
    """The 400 for a conversation whose most recent turn alone is longer than the context: truncated
    to fit, the summary's request would hold none of it (a summary of nothing, returned as one)."""
    return OpenAIError(
        400,
        "The conversation cannot be compacted: its most recent turn alone is longer than the model's "
        f"context ({context_length} tokens), so a summary would see none of it. Shorten that turn.",
        param="input",
        code="context_length_exceeded",
    )


def _first_of_each_id(items: list[Item]) -> list[Item]:
    """``items`` without the repeats of an id: a history stored before duplicate ids were refused
    may hold one, and the summary's request is validated as input is (its first copy stands)."""
    seen: set[str] = set()
    unique: list[Item] = []
    for item in items:
        item_id = item.get("id")
        if isinstance(item_id, str):
            if item_id in seen:
                continue
            seen.add(item_id)
        unique.append(item)
    return unique


def summary_text(final: dict[str, Any]) -> str:
    """The summary in a finished summary response: its message text (its reasoning if it wrote none)."""
    messages = [item for item in final.get("output", []) if item.get("type") == "message"]
    text = "".join(content_text(item.get("content")) for item in messages).strip()
    if text:
        return text
    reasoning = [item for item in final.get("output", []) if item.get("type") == "reasoning"]
    return "".join(content_text(item.get("content")) for item in reasoning).strip()


def compaction_item(sealer: Sealer, owner: str, response_id: str, summary: str) -> Item:
    """The ``compaction`` item sealing ``summary`` for ``owner``."""
    return {
        "id": ids.item_id("cmp", response_id, 0),
        "type": "compaction",
        "encrypted_content": sealer.seal(sealed.COMPACTION, owner, summary),
    }


def finished_summary(final_json: bytes) -> dict[str, Any]:
    """A finished summary response; a 500 naming the engine's error when it did not finish."""
    final: dict[str, Any] = jsonutil.loads(final_json)
    if final.get("status") not in ("completed", "incomplete"):
        error = final.get("error") or {}
        raise OpenAIError(
            500,
            f"Compaction failed: the summary could not be generated ({error.get('message', final.get('status'))}).",
            type="server_error",
            code="server_error",
        )
    return final


def compacted_response(final_json: bytes, sealer: Sealer, owner: str) -> dict[str, Any]:
    """The ``response.compaction`` object for a finished summary response (a failed one: a 500)."""
    final = finished_summary(final_json)
    response_id = str(final["id"])
    return {
        "id": response_id,
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [compaction_item(sealer, owner, response_id, summary_text(final))],
        "usage": final.get("usage"),
    }
