"""Open Responses conformance: every Response and stream event, checked against the spec.

The SDK's strict models (``_strict_response_validation=True``) say what the ``openai`` client
accepts; these checks add the Open Responses specification (https://www.openresponses.org),
through ``openresponses-types``, the pydantic models generated from the spec's
``public/openapi/openapi.json`` (version 2026-04-24; the package records the file's hash).
Everything is validated in pydantic's strict JSON mode, so a string where the spec has a
number, or a missing required-but-nullable key (``strict`` on a function tool,
``presence_penalty`` on a Response), fails.

Unions are not left to pydantic (its errors would list every branch): output items, content
parts, tools and ``tool_choice`` are dispatched on their ``type`` and checked one by one, so a
failure names the exact item and field, e.g.
``event #4 response.created: response.tools[0] (function).strict: Field required``.

Where the spec and the ``openai`` SDK disagree, the SDK wins (resq is an OpenAI-compatible
server first). Each such point is listed in :data:`DIVERGENCES`, and the code that tolerates it
names its key:

- ``reasoning-text-event-names``: the SDK (and OpenAI) stream reasoning text as
  ``response.reasoning_text.delta``/``.done``; the spec names them ``response.reasoning.delta``/
  ``.done`` with the same fields. The SDK names are checked against the spec's models.
- ``custom-tool-call-input-events``: ``response.custom_tool_call_input.delta``/``.done`` (custom
  tools) are SDK-only; only their envelope (``sequence_number``, ``item_id``, ``output_index``)
  is checked here.
- ``error-event-shape``: the SDK's ``error`` event has ``code``/``message``/``param`` at the top
  level; the spec nests them under ``error``. Either shape is accepted.
- ``custom-tool-call-items``: ``custom_tool_call`` output items (custom tools) are SDK-only.
- ``non-function-tools``: the spec's ``Tool`` is only ``function``; resq echoes ``custom``,
  namespace and hosted tools (``web_search``, ``mcp``, ...) as the SDK types them.
- ``non-function-tool-choice``: the spec's ``tool_choice`` is a mode, ``{"type": "function"}`` or
  ``allowed_tools`` over functions; the SDK adds ``custom``, hosted-tool and ``mcp`` choices and
  ``allowed_tools`` entries of every tool type.
- ``json-schema-format-schema``: the spec types ``text.format.schema`` (``json_schema`` format) as
  null only, a generator artefact (its own description says "a JSON Schema object"); the SDK
  types it as an object.
- ``reasoning-effort-values``: the SDK's ``reasoning.effort`` also allows ``minimal`` and ``max``,
  which the spec's enum lacks.
- ``sdk-float-timestamps``: the SDK types a Response's ``created_at``/``completed_at`` as floats,
  so a Response that went through its models (``model_dump``) shows ``1700000000.0``; the spec
  has integers. Integral floats are accepted there (the compliance suite still sees the wire).
- ``sdk-dump-aliases``: ``model_dump()`` without ``by_alias`` (``invariants.as_dict``) writes a
  json_schema format's ``schema`` as ``schema_``; that key is read as ``schema``.
- ``event-logprob-bytes``: the logprob entries of ``response.output_text.delta``/``.done`` (and
  their ``top_logprobs``) have no ``bytes`` in the SDK (nor on OpenAI's wire); the spec's
  ``LogProb`` requires it. Only the ``output_text`` content part's entries must carry ``bytes``.

Only the keys above are tolerated; anything else the spec does not know (an event type, an
output item type) fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pydantic
from openresponses_types import types as spec

DIVERGENCES: dict[str, str] = {
    "reasoning-text-event-names": (
        "SDK/OpenAI event names response.reasoning_text.delta/.done, spec response.reasoning.delta/.done"
    ),
    "custom-tool-call-input-events": "response.custom_tool_call_input.delta/.done exist in the SDK only",
    "error-event-shape": "the SDK's error event has code/message/param at the top level, the spec under `error`",
    "custom-tool-call-items": "custom_tool_call output items exist in the SDK only",
    "non-function-tools": "the spec's Tool is function-only; the SDK types custom, namespace and hosted tools",
    "non-function-tool-choice": "custom, hosted-tool, mcp choices and non-function allowed_tools are SDK-only",
    "json-schema-format-schema": "the spec types text.format.schema as null only (generator artefact)",
    "reasoning-effort-values": "the SDK allows reasoning.effort minimal and max, the spec's enum does not",
    "sdk-float-timestamps": "the SDK types created_at/completed_at as float; its dumps show 1700000000.0",
    "sdk-dump-aliases": "an SDK model_dump() without by_alias writes text.format.schema as schema_",
    "event-logprob-bytes": "output_text.delta/.done logprob entries have no `bytes` in the SDK; the spec requires it",
}

# Spec event name for the SDK's name of the same event (``reasoning-text-event-names``).
EVENT_RENAMES: dict[str, str] = {
    "response.reasoning_text.delta": "response.reasoning.delta",
    "response.reasoning_text.done": "response.reasoning.done",
}
# SDK-only events, checked for their envelope only (``custom-tool-call-input-events``).
SDK_ONLY_EVENTS = frozenset({"response.custom_tool_call_input.delta", "response.custom_tool_call_input.done"})
# SDK-only output items (``custom-tool-call-items``).
SDK_ONLY_ITEMS = frozenset({"custom_tool_call"})
# SDK-only reasoning efforts (``reasoning-effort-values``).
SDK_ONLY_EFFORTS = frozenset({"minimal", "max"})

# Events whose logprob entries may lack ``bytes`` (``event-logprob-bytes``).
_LOGPROB_EVENTS = frozenset({"response.output_text.delta", "response.output_text.done"})

_LIFECYCLE_EVENTS = frozenset(
    {
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.completed",
        "response.failed",
        "response.incomplete",
    }
)
_ITEM_EVENTS = frozenset({"response.output_item.added", "response.output_item.done"})
_PART_EVENTS = frozenset(
    {
        "response.content_part.added",
        "response.content_part.done",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_part.done",
    }
)

_ITEM_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "message": spec.Message,
    "function_call": spec.FunctionCall,
    "function_call_output": spec.FunctionCallOutput,
    "reasoning": spec.ReasoningBody,
    "compaction": spec.CompactionBody,
}
_PART_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "input_text": spec.InputTextContent,
    "output_text": spec.OutputTextContent,
    "text": spec.TextContent,
    "summary_text": spec.SummaryTextContent,
    "reasoning_text": spec.ReasoningTextContent,
    "refusal": spec.RefusalContent,
    "input_image": spec.InputImageContent,
    "input_file": spec.InputFileContent,
    "input_video": spec.InputVideoContent,
}
_TOOL_CHOICE_MODES = frozenset(mode.value for mode in spec.ToolChoiceValueEnum)


def _event_models() -> dict[str, type[pydantic.BaseModel]]:
    """Spec event type -> its model, read from the models' ``type`` enums."""
    models: dict[str, type[pydantic.BaseModel]] = {}
    for name, value in vars(spec).items():
        if not (name.endswith("StreamingEvent") and isinstance(value, type)):
            continue
        if not issubclass(value, pydantic.BaseModel):
            continue
        annotation = value.model_fields["type"].annotation
        for member in getattr(annotation, "__members__", {}).values():
            models[member.value] = value
    return models


_EVENT_MODELS = _event_models()


def _fail(where: str, errors: list[str]) -> None:
    if errors:
        raise AssertionError(f"{where} does not conform to Open Responses:\n  " + "\n  ".join(errors))


def _validate(
    model: type[pydantic.BaseModel], data: Any, where: str, delegated: Iterable[str] = ()
) -> list[str]:
    """Errors of ``data`` against ``model`` (strict JSON mode), as ``where.field: message``
    (``where field: message`` when ``where`` ends with a colon).

    Errors inside the ``delegated`` fields are dropped (the caller checks those fields itself),
    except the one saying a delegated field itself is missing.
    """
    skip = frozenset(delegated)
    try:
        model.model_validate_json(json.dumps(data), strict=True)
    except pydantic.ValidationError as error:
        found = []
        for issue in error.errors():
            loc = issue["loc"]
            if loc and loc[0] in skip and not (len(loc) == 1 and issue["type"] == "missing"):
                continue
            path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
            if where.endswith(":"):  # an event: ``event #3 response.output_text.delta: delta``
                path = " " + path.removeprefix(".")
            got = "" if issue["type"] == "missing" else f" (got {json.dumps(issue['input'])[:80]})"
            found.append(f"{where}{path}: {issue['msg']}{got}")
        return found
    return []


def _dispatch(value: Any, where: str, models: Mapping[str, type[pydantic.BaseModel]], kind: str) -> list[str]:
    """Check a union member by its ``type``."""
    if not isinstance(value, dict):
        return [f"{where}: expected an object, got {json.dumps(value)[:80]}"]
    model = models.get(value.get("type"))  # type: ignore[arg-type]
    if model is None:
        return [f"{where}: {kind} type {value.get('type')!r} is not in the spec"]
    return _validate(model, value, where)


def _check_list(
    value: Any, where: str, check: Callable[[Any, str], list[str]], *, nullable: bool = False
) -> list[str]:
    if value is None and nullable:
        return []
    if not isinstance(value, list):
        return [f"{where}: expected an array, got {json.dumps(value)[:80]}"]
    return [error for index, entry in enumerate(value) for error in check(entry, f"{where}[{index}]")]


def _check_part(part: Any, where: str) -> list[str]:
    return _dispatch(part, where, _PART_MODELS, "content part")


def _check_item(item: Any, where: str) -> list[str]:
    """An output item (in ``output`` or an ``output_item`` event)."""
    if not isinstance(item, dict):
        return [f"{where}: expected an output item object, got {json.dumps(item)[:80]}"]
    kind = item.get("type")
    if kind in SDK_ONLY_ITEMS:
        return []  # custom-tool-call-items
    model = _ITEM_MODELS.get(kind)  # type: ignore[arg-type]
    if model is None:
        return [f"{where}: output item type {kind!r} is not in the spec"]
    where = f"{where} ({kind})"
    if kind == "message":
        errors = _validate(model, item, where, delegated=["content"])
        if "content" in item:
            errors += _check_list(item["content"], f"{where}.content", _check_part)
        return errors
    if kind == "reasoning":
        errors = _validate(model, item, where, delegated=["content", "summary"])
        errors += _check_list(item.get("content"), f"{where}.content", _check_part, nullable=True)
        if "summary" in item:
            errors += _check_list(item["summary"], f"{where}.summary", _check_part)
        return errors
    return _validate(model, item, where)


def _check_tool(tool: Any, where: str) -> list[str]:
    if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
        return [f"{where}: a tool must be an object with a string `type`, got {json.dumps(tool)[:80]}"]
    if tool["type"] != "function":
        return []  # non-function-tools
    return _validate(spec.FunctionTool, tool, f"{where} (function)")


def _check_tool_choice(choice: Any, where: str) -> list[str]:
    if isinstance(choice, str):
        if choice in _TOOL_CHOICE_MODES:
            return []
        return [f"{where}: {choice!r} is not one of {sorted(_TOOL_CHOICE_MODES)}"]
    if not isinstance(choice, dict):
        return [f"{where}: expected a mode or an object, got {json.dumps(choice)[:80]}"]
    if choice.get("type") == "function":
        return _validate(spec.FunctionToolChoice, choice, where)
    if choice.get("type") == "allowed_tools":
        errors = _validate(spec.AllowedToolChoice, choice, where, delegated=["tools"])

        def check(entry: Any, at: str) -> list[str]:
            if isinstance(entry, dict) and entry.get("type") == "function":
                return _validate(spec.FunctionToolChoice, entry, at)
            return []  # non-function-tool-choice

        return errors + _check_list(choice.get("tools"), f"{where}.tools", check)
    if isinstance(choice.get("type"), str):
        return []  # non-function-tool-choice
    return [f"{where}: a tool choice object needs a string `type`"]


_FORMAT_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "text": spec.TextResponseFormat,
    "json_object": spec.JsonObjectResponseFormat,
    "json_schema": spec.JsonSchemaResponseFormat,
}


def _check_text(text: Any, where: str) -> list[str]:
    """``text`` (already through :func:`_spec_view`), its ``format`` dispatched on its type."""
    errors = _validate(spec.TextField, text, where, delegated=["format"])
    if isinstance(text, dict) and "format" in text:
        errors += _dispatch(text["format"], f"{where}.format", _FORMAT_MODELS, "text format")
    return errors


def _spec_view(response: dict[str, Any]) -> dict[str, Any]:
    """``response`` with the tolerated divergences of its scalar settings replaced by spec values."""
    view = dict(response)
    for key in ("created_at", "completed_at"):  # sdk-float-timestamps
        if isinstance(view.get(key), float) and view[key].is_integer():
            view[key] = int(view[key])
    text = view.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        fmt = dict(text["format"])
        if "schema_" in fmt and "schema" not in fmt:  # sdk-dump-aliases
            fmt["schema"] = fmt.pop("schema_")
        if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
            fmt["schema"] = None  # json-schema-format-schema
        view["text"] = {**text, "format": fmt}
    reasoning = view.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") in SDK_ONLY_EFFORTS:
        view["reasoning"] = {**reasoning, "effort": None}  # reasoning-effort-values
    return view


def response_errors(response: Any, where: str = "response") -> list[str]:
    """Every way ``response`` (a Response as a JSON dict) departs from the spec."""
    if not isinstance(response, dict):
        return [f"{where}: expected a Response object, got {json.dumps(response)[:80]}"]
    view = _spec_view(response)
    errors = _validate(
        spec.ResponseResource, view, where, delegated=["output", "tools", "tool_choice", "text"]
    )
    if "text" in view:
        errors += _check_text(view["text"], f"{where}.text")
    if "output" in response:
        errors += _check_list(response["output"], f"{where}.output", _check_item)
    if "tools" in response:
        errors += _check_list(response["tools"], f"{where}.tools", _check_tool)
    if "tool_choice" in response:
        errors += _check_tool_choice(response["tool_choice"], f"{where}.tool_choice")
    return errors


def check_response(response: dict[str, Any]) -> None:
    """Assert that a Response (JSON dict, as on the wire) conforms to Open Responses."""
    name = response.get("id") if isinstance(response, dict) else None
    _fail(f"Response {name}", response_errors(response))


def _with_bytes(entry: Any) -> Any:
    """A text event's logprob entry with the ``bytes`` the SDK leaves out (``event-logprob-bytes``)."""
    if not isinstance(entry, dict):
        return entry
    fixed = {"bytes": [], **entry}
    if isinstance(entry.get("top_logprobs"), list):
        fixed["top_logprobs"] = [
            {"bytes": [], **top} if isinstance(top, dict) else top for top in entry["top_logprobs"]
        ]
    return fixed


def event_errors(event: Any) -> list[str]:
    """Every way ``event`` (a stream event as a JSON dict) departs from the spec."""
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        return [f"event: expected an object with a string `type`, got {json.dumps(event)[:80]}"]
    kind: str = event["type"]
    spec_kind = EVENT_RENAMES.get(kind, kind)  # reasoning-text-event-names
    where = f"event #{event.get('sequence_number')} {kind}:"
    if kind in SDK_ONLY_EVENTS:  # custom-tool-call-input-events
        errors = []
        for key, expected in (("sequence_number", int), ("item_id", str), ("output_index", int)):
            if not isinstance(event.get(key), expected) or isinstance(event.get(key), bool):
                errors.append(
                    f"{where} {key}: expected {expected.__name__}, got {json.dumps(event.get(key))}"
                )
        return errors
    if kind == "error" and "error" not in event and "message" in event:  # error-event-shape
        errors = []
        if not isinstance(event.get("sequence_number"), int):
            errors.append(f"{where} sequence_number: expected int")
        if not isinstance(event["message"], str):
            errors.append(f"{where} message: expected a string")
        return errors
    model = _EVENT_MODELS.get(spec_kind)
    if model is None:
        return [f"{where} event type {kind!r} is not in the spec (nor an allowed SDK divergence)"]
    data = {**event, "type": spec_kind}
    if kind in _LOGPROB_EVENTS and isinstance(event.get("logprobs"), list):
        data["logprobs"] = [_with_bytes(entry) for entry in event["logprobs"]]  # event-logprob-bytes
    if kind in _LIFECYCLE_EVENTS:
        errors = _validate(model, data, where, delegated=["response"])
        if "response" in event:
            errors += response_errors(event["response"], f"{where} response")
    elif kind in _ITEM_EVENTS:
        errors = _validate(model, data, where, delegated=["item"])
        if "item" in event:
            errors += _check_item(event["item"], f"{where} item")
    elif kind in _PART_EVENTS:
        errors = _validate(model, data, where, delegated=["part"])
        if "part" in event:
            errors += _check_part(event["part"], f"{where} part")
    else:
        errors = _validate(model, data, where)
    return errors


def check_event(event: dict[str, Any]) -> None:
    """Assert that one stream event (JSON dict, as on the wire) conforms to Open Responses."""
    _fail("stream event", event_errors(event))


def wire_dict(value: Any) -> dict[str, Any]:
    """A dict as is; an SDK model as the JSON it was parsed from (only the keys that were sent).

    ``exclude_unset`` matters: a plain dump would add the SDK's defaults (``strict: None`` on a
    tool that had no ``strict``) and hide exactly what these checks look for; ``by_alias`` keeps
    ``schema`` from turning into ``schema_``.
    """
    if isinstance(value, dict):
        return value
    dumped: dict[str, Any] = value.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return dumped


def check_events(events: Iterable[Any]) -> None:
    """Assert that every event of a stream conforms (the Responses inside lifecycle events too).

    The hook of ``tests/support/invariants.py:check_stream``; takes dicts or SDK event models.
    """
    errors = [error for event in events for error in event_errors(wire_dict(event))]
    _fail("stream", errors)


# The endpoints whose JSON body is a Response: create, retrieve, cancel.
_RESPONSE_PATH = re.compile(r"/v1/responses(?:/[^/]+(?:/cancel)?)?")


def check_http_response(response: Any) -> None:
    """An httpx ``response`` event hook: :func:`check_response` on every JSON Response the API sends.

    For ``OpenAI(http_client=DefaultHttpxClient(event_hooks={"response": [check_http_response]}))``;
    streams (``text/event-stream``) are left alone, :func:`check_events` covers them. An
    ``AssertionError`` raised here reaches the test as is (the SDK wraps only transport errors).
    """
    if response.status_code != 200 or not _RESPONSE_PATH.fullmatch(response.request.url.path):
        return
    if not response.headers.get("content-type", "").startswith("application/json"):
        return
    response.read()
    body = response.json()
    # DELETE answers {"id", "object": "response", "deleted": true}: no Response.
    if isinstance(body, dict) and body.get("object") == "response" and "deleted" not in body:
        check_response(body)
