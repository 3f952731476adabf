"""Pure functions that build OpenAI Responses objects and events as plain dicts.

Plain dicts rather than SDK models: events are built on the hot path of every
token chunk, and the dicts go straight to orjson. ``tests/unit/test_events.py``
validates every builder's output against the ``openai`` SDK's pydantic models,
so the shapes cannot drift from what strict clients accept.

Events are built without ``sequence_number``: :mod:`resq.events.emitter` stamps
it, at the one place events leave the builder.
"""

from __future__ import annotations

from typing import Any, Literal

from resq.events import types

Event = dict[str, Any]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


# --- output items --------------------------------------------------------------------------------


def output_text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_text_part(text: str) -> dict[str, Any]:
    """A ``reasoning_text`` content part."""
    return {"type": "reasoning_text", "text": text}


def message_item(
    item_id: str, status: ItemStatus, content: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """An assistant ``message`` output item."""
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content or []}


def summary_text_part(text: str) -> dict[str, Any]:
    """A ``summary_text`` part of a reasoning item."""
    return {"type": "summary_text", "text": text}


def reasoning_item(
    item_id: str,
    status: ItemStatus,
    content: list[dict[str, Any]] | None = None,
    summary: list[dict[str, Any]] | None = None,
    encrypted_content: str | None = None,
) -> dict[str, Any]:
    """A ``reasoning`` output item: raw reasoning text, the summary when asked, the sealed blob when asked."""
    item: dict[str, Any] = {
        "type": "reasoning",
        "id": item_id,
        "summary": summary or [],
        "content": content or [],
        "status": status,
    }
    if encrypted_content is not None:
        item["encrypted_content"] = encrypted_content
    return item


def function_call_item(
    item_id: str,
    call_id: str,
    name: str,
    arguments: str,
    status: ItemStatus,
    namespace: str | None = None,
) -> dict[str, Any]:
    """A ``function_call`` output item (``namespace`` only for a namespace's function)."""
    item = {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def custom_tool_call_item(
    item_id: str,
    call_id: str,
    name: str,
    input_text: str,
    status: ItemStatus,
    namespace: str | None = None,
) -> dict[str, Any]:
    """A ``custom_tool_call`` output item (``namespace`` only for a namespace's tool)."""
    item = {
        "type": "custom_tool_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "input": input_text,
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


# --- events --------------------------------------------------------------------------------------


def response_event(event_type: str, response: dict[str, Any]) -> Event:
    """``response.created`` / ``.queued`` / ``.in_progress`` / a terminal event, with a snapshot."""
    return {"type": event_type, "response": response}


def output_item_added(output_index: int, item: dict[str, Any]) -> Event:
    """``response.output_item.added``."""
    return {"type": types.OUTPUT_ITEM_ADDED, "output_index": output_index, "item": item}


def output_item_done(output_index: int, item: dict[str, Any]) -> Event:
    """``response.output_item.done``."""
    return {"type": types.OUTPUT_ITEM_DONE, "output_index": output_index, "item": item}


def content_part_added(item_id: str, output_index: int, content_index: int, part: dict[str, Any]) -> Event:
    """``response.content_part.added``."""
    return {
        "type": types.CONTENT_PART_ADDED,
        "item_id": item_id,
        "output_index": output_index,
        "content_index": content_index,
        "part": part,
    }


def content_part_done(item_id: str, output_index: int, content_index: int, part: dict[str, Any]) -> Event:
    """``response.content_part.done``."""
    return {
        "type": types.CONTENT_PART_DONE,
        "item_id": item_id,
        "output_index": output_index,
        "content_index": content_index,
        "part": part,
    }


def _event_logprobs(logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Logprob entries as text events carry them: without the ``bytes`` only parts have (nor do
    their ``top_logprobs``)."""
    return [
        {
            "token": entry["token"],
            "logprob": entry["logprob"],
            "top_logprobs": [
                {"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]
            ],
        }
        for entry in logprobs or []
    ]


def output_text_delta(
    item_id: str,
    output_index: int,
    content_index: int,
    delta: str,
    logprobs: list[dict[str, Any]] | None = None,
) -> Event:
    """``response.output_text.delta`` (``logprobs`` is required by strict clients, so always present)."""
    return {
        "type": types.OUTPUT_TEXT_DELTA,
        "item_id": item_id,
        "output_index": output_index,
        "content_index": content_index,
        "delta": delta,
        "logprobs": _event_logprobs(logprobs),
    }


def output_text_done(
    item_id: str,
    output_index: int,
    content_index: int,
    text: str,
    logprobs: list[dict[str, Any]] | None = None,
) -> Event:
    """``response.output_text.done``."""
    return {
        "type": types.OUTPUT_TEXT_DONE,
        "item_id": item_id,
        "output_index": output_index,
        "content_index": content_index,
        "text": text,
        "logprobs": _event_logprobs(logprobs),
    }


def reasoning_text_delta(item_id: str, output_index: int, content_index: int, delta: str) -> Event:
    """``response.reasoning_text.delta``."""
    return {
        "type": types.REASONING_TEXT_DELTA,
        "item_id": item_id,
        "output_index": output_index,
        "content_index": content_index,
        "delta": delta,
    }


def reasoning_summary_part(
    kind: str, item_id: str, output_index: int, summary_index: int, part: dict[str, Any]
) -> Event:
    """``response.reasoning_summary_part.added`` / ``.done`` (``kind`` is the event type)."""
    return {
        "type": kind,
        "item_id": item_id,
        "output_index": output_index,
        "summary_index": summary_index,
        "part": part,
    }


def reasoning_summary_text_delta(item_id: str, output_index: int, summary_index: int, delta: str) -> Event:
    """``response.reasoning_summary_text.delta``."""
    return {
        "type": types.REASONING_SUMMARY_TEXT_DELTA,
        "item_id": item_id,
        "output_index": output_index,
        "summary_index": summary_index,
        "delta": delta,
    }


def reasoning_summary_text_done(item_id: str, output_index: int, summary_index: int, text: str) -> Event:
    """``response.reasoning_summary_text.done``."""
    return {
        "type": types.REASONING_SUMMARY_TEXT_DONE,
        "item_id": item_id,
        "output_index": output_index,
        "summary_index": summary_index,
        "text": text,
    }


def reasoning_text_done(item_id: str, output_index: int, content_index: int, text: str) -> Event:
    """``response.reasoning_text.done``."""
    return {
        "type": types.REASONING_TEXT_DONE,
        "item_id": item_id,
        "output_index": output_index,
        "content_index": content_index,
        "text": text,
    }


def function_call_arguments_delta(item_id: str, output_index: int, delta: str) -> Event:
    """``response.function_call_arguments.delta``."""
    return {
        "type": types.FUNCTION_CALL_ARGUMENTS_DELTA,
        "item_id": item_id,
        "output_index": output_index,
        "delta": delta,
    }


def function_call_arguments_done(item_id: str, output_index: int, name: str, arguments: str) -> Event:
    """``response.function_call_arguments.done``."""
    return {
        "type": types.FUNCTION_CALL_ARGUMENTS_DONE,
        "item_id": item_id,
        "output_index": output_index,
        "name": name,
        "arguments": arguments,
    }


def custom_tool_call_input_delta(item_id: str, output_index: int, delta: str) -> Event:
    """``response.custom_tool_call_input.delta``."""
    return {
        "type": types.CUSTOM_TOOL_CALL_INPUT_DELTA,
        "item_id": item_id,
        "output_index": output_index,
        "delta": delta,
    }


def custom_tool_call_input_done(item_id: str, output_index: int, input_text: str) -> Event:
    """``response.custom_tool_call_input.done``."""
    return {
        "type": types.CUSTOM_TOOL_CALL_INPUT_DONE,
        "item_id": item_id,
        "output_index": output_index,
        "input": input_text,
    }


# --- usage ---------------------------------------------------------------------------------------


def usage(
    input_tokens: int, output_tokens: int, reasoning_tokens: int = 0, cached_tokens: int = 0
) -> dict[str, Any]:
    """A ``usage`` object (strict clients require ``cache_write_tokens``)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }
