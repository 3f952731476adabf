"""Chat Completions on the Responses pipeline: one request translated, one snapshot for the chunks.

A chat completion is a response of the ``chat`` protocol: the same prompt rendering,
admission, queue, GPU worker, recovery and event log as ``/v1/responses``; only the
post-processor's protocol layer (:mod:`resq.protocols.chat`) and the relay's framing
differ. The request becomes the Responses request it means (messages -> input
items, ``tools`` -> function tools, ``response_format`` -> ``text.format``), never
stored; a 400 for anything that cannot be said that way names the chat parameter.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from api.chat_schemas import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatJsonSchemaFormat,
    ChatTextPart,
    SystemMessage,
    ToolMessage,
    UnsupportedMessage,
    UserMessage,
)
from api.errors import OpenAIError, invalid_value, validation_error_to_openai
from api.schemas import LOGPROBS_INCLUDE, CreateResponseRequest

SYSTEM_FINGERPRINT = "resq"
"""``system_fingerprint`` of every completion (one serving configuration per deployment)."""


@dataclass(frozen=True)
class ChatExtras:
    """What a chat completion asks beyond its Responses translation."""

    stop: tuple[str, ...] = ()
    include_usage: bool = False
    seed: int | None = None


def completion_id(response_id: str) -> str:
    """The ``chatcmpl-`` id of the completion recorded as ``response_id``."""
    return "chatcmpl-" + response_id.removeprefix("resp_")


def completion_template(response_id: str, model: str) -> dict[str, Any]:
    """The fields every chunk and the final completion share."""
    return {
        "id": completion_id(response_id),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "service_tier": "default",
    }


def _text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if isinstance(part, ChatTextPart))


def _has_breakpoint(request: ChatCompletionRequest) -> bool:
    """Whether any message's text part carries a ``prompt_cache_breakpoint`` (explicit prompt caching)."""
    return any(
        isinstance(part, ChatTextPart) and part.prompt_cache_breakpoint is not None
        for message in request.messages
        if not isinstance(message, UnsupportedMessage) and isinstance(message.content, list)
        for part in message.content
    )


def _input_items(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as Responses input items (a 400 for a tool result answering no call)."""
    items: list[dict[str, Any]] = []
    called: set[str] = set()
    for index, message in enumerate(request.messages):
        if isinstance(message, SystemMessage):
            items.append({"type": "message", "role": message.role, "content": _text(message.content)})
        elif isinstance(message, UserMessage):
            items.append({"type": "message", "role": "user", "content": _text(message.content)})
        elif isinstance(message, AssistantMessage):
            reasoning = message.reasoning_content or message.reasoning
            if reasoning:
                items.append(
                    {
                        "type": "reasoning",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": reasoning}],
                    }
                )
            text = _text(message.content)
            if text or not message.tool_calls:
                items.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": text}],
                    }
                )
            for call in message.tool_calls or []:
                called.add(call.id)
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.id,
                        "name": call.function.name,
                        "arguments": call.function.arguments,
                    }
                )
        elif isinstance(message, ToolMessage):
            if message.tool_call_id not in called:
                raise invalid_value(
                    f"Invalid 'messages[{index}].tool_call_id': no earlier assistant message made the "
                    f"tool call {message.tool_call_id!r}.",
                    f"messages[{index}].tool_call_id",
                )
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.tool_call_id,
                    "output": _text(message.content),
                }
            )
        elif isinstance(message, UnsupportedMessage):  # pragma: no cover - refused by validation
            raise invalid_value(f"Invalid role {message.role!r}.", f"messages[{index}].role")
    return items


def _tool_choice(request: ChatCompletionRequest) -> Any:
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "name": choice.function.name}


def _text_format(request: ChatCompletionRequest) -> dict[str, Any] | None:
    form = request.response_format
    if form is None:
        return None
    if isinstance(form, ChatJsonSchemaFormat):
        spec = form.json_schema
        converted: dict[str, Any] = {
            "type": "json_schema",
            "name": spec.name,
            "schema": spec.json_schema if spec.json_schema is not None else {},
        }
        if spec.description is not None:
            converted["description"] = spec.description
        if spec.strict is not None:
            converted["strict"] = spec.strict
        return converted
    return {"type": form.type}


def responses_request(request: ChatCompletionRequest) -> CreateResponseRequest:
    """The Responses request a chat completion means (unstored, foreground)."""
    both = request.max_tokens is not None and request.max_completion_tokens is not None
    if both and request.max_tokens != request.max_completion_tokens:
        raise invalid_value(
            "Give either 'max_tokens' or 'max_completion_tokens' (they differ).", "max_tokens"
        )
    body: dict[str, Any] = {
        "model": request.model,
        "input": _input_items(request),
        "store": False,
        "stream": bool(request.stream),
    }
    limit = request.max_completion_tokens or request.max_tokens
    if limit is not None:
        body["max_output_tokens"] = limit
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "parallel_tool_calls"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    for name in ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if request.prompt_cache_options is not None:
        options = request.prompt_cache_options.model_dump(exclude_none=True)
        if options.get("mode") == "explicit" and _has_breakpoint(request):
            # The messages' parts become plain text: a breakpoint among them (any role) is said here.
            options["mode"] = "implicit"
        body["prompt_cache_options"] = options
    if request.tools:
        body["tools"] = [
            {"type": "function", **tool.function.model_dump(exclude_none=True)} for tool in request.tools
        ]
    choice = _tool_choice(request)
    if choice is not None:
        body["tool_choice"] = choice
    text: dict[str, Any] = {}
    text_format = _text_format(request)
    if text_format is not None:
        text["format"] = text_format
    if request.verbosity is not None:
        text["verbosity"] = request.verbosity
    if text:
        body["text"] = text
    if request.reasoning_effort is not None:
        body["reasoning"] = {"effort": request.reasoning_effort}
    if request.logprobs:
        body["include"] = [LOGPROBS_INCLUDE]
        if request.top_logprobs:
            body["top_logprobs"] = request.top_logprobs
    try:
        return CreateResponseRequest.model_validate(body)
    except ValidationError as invalid:
        raise in_chat_terms(validation_error_to_openai(invalid.errors()), request) from invalid


_PARAM_PREFIXES = (
    ("reasoning.effort", "reasoning_effort"),
    ("input", "messages"),
    ("text.format", "response_format.json_schema"),
    ("text", "response_format"),
)
"""Responses parameter paths and the chat parameters they were translated from."""
_CHAT_WORDING = (
    (", or send truncation 'auto'", ""),  # `truncation` is no chat parameter
    ("reasoning.effort", "reasoning_effort"),
    ("The input has ", "The messages make "),  # an assistant's tool calls are an item each
    ("(compact or truncate the conversation)", "(shorten the conversation)"),
)
"""A Responses message's words, and what chat calls them (or advice it cannot follow, dropped)."""


_FUNCTION_TOOL_FIELD = re.compile(r"^(tools\[\d+\])\.(name|description|parameters|strict)(?=$|[.\[])")
"""A Responses function tool's field, which a chat tool nests under ``function``."""


def in_chat_terms(error: OpenAIError, request: ChatCompletionRequest) -> OpenAIError:
    """A translated request's error (from its validation, or from ``accept``: a tool's or the
    ``response_format``'s schema, the context length), naming the chat parameter it came from
    (the output limit as the request sent it: ``max_completion_tokens`` or ``max_tokens``)."""
    limit_name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    message = error.message.replace("max_output_tokens", limit_name)
    for responses_words, chat_words in _CHAT_WORDING:
        message = message.replace(responses_words, chat_words)
    param = error.param
    if param is not None:
        param = _FUNCTION_TOOL_FIELD.sub(r"\1.function.\2", param)
    if param == "max_output_tokens":
        param = limit_name
    for responses_name, chat_name in _PARAM_PREFIXES:
        if param is not None and (
            param == responses_name or param.startswith((responses_name + ".", responses_name + "["))
        ):
            param = chat_name + param[len(responses_name) :]
            break
    return OpenAIError(error.status_code, message, param=param, type=error.type, code=error.code)


def extras(request: ChatCompletionRequest) -> ChatExtras:
    """The chat-only parts of the request."""
    return ChatExtras(stop=request.stop_sequences, include_usage=request.include_usage, seed=request.seed)
