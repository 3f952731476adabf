"""OpenAI error envelopes: every error leaves the API as
``{"error": {"message", "type", "param", "code"}}`` with a 4xx (or 5xx) status.

Validation errors become 400 (never FastAPI's 422) with ``param`` naming the
field the way OpenAI does (``input[0].content``) and a code saying what is
wrong: ``missing_required_parameter``, ``unknown_parameter``, ``invalid_type``,
``invalid_value`` or ``unsupported_parameter``.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from api.http import json_response

log = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error the API reports to the client in OpenAI's shape."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON envelope."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def store_unavailable() -> OpenAIError:
    """503 ``server_overloaded``: Redis is unreachable, or every pooled connection stayed busy past
    the pool's wait (a burst of thousands of requests at once). The request can be retried, as the
    SDKs do on a 503 by themselves: nothing of it was admitted, or its recovery record remains."""
    return OpenAIError(
        503,
        "The server is overloaded or its store is unreachable; please retry the request.",
        type="server_error",
        code="server_overloaded",
        headers={"Retry-After": "1"},
    )


def internal_error() -> OpenAIError:
    """500 ``server_error``: a fault of the server; what it was is logged, never sent."""
    return OpenAIError(500, "The server had an error while processing your request.", type="server_error")


def as_openai_error(failure: BaseException) -> OpenAIError:
    """What the client is told of ``failure``, raised while handling its request: the answer the
    HTTP exception handlers give it (the WebSocket mode answers with the same error). Logs what is
    not the client's fault."""
    if isinstance(failure, OpenAIError):
        return failure
    if isinstance(failure, RedisConnectionError | RedisTimeoutError):
        log.warning("Redis unavailable while handling a request: %s", failure)
        return store_unavailable()
    log.error("unhandled error", exc_info=failure)
    return internal_error()


def invalid_value(message: str, param: str | None, code: str = "invalid_value") -> OpenAIError:
    """A 400 for a bad value of ``param``."""
    return OpenAIError(400, message, param=param, code=code)


def response_not_found(response_id: str) -> OpenAIError:
    """The 404 for an unknown (or foreign, or expired) response id."""
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id", code=None)


def rate_limited(message: str, retry_after_s: float) -> OpenAIError:
    """A 429 ``rate_limit_exceeded`` with ``Retry-After`` (whole seconds, at least 1)."""
    seconds = max(1, math.ceil(retry_after_s))
    return OpenAIError(
        429, message, type="requests", code="rate_limit_exceeded", headers={"Retry-After": str(seconds)}
    )


_TYPE_ERRORS = re.compile(r"(_type$|_parsing$|^model_attributes_type$|^is_instance_of$|^dict_type$)")
_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Union branches pydantic names in `loc`, which are not fields.
_NOT_FIELDS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function", "other"})
# Union tags pydantic names after a field: `tool_choice` tags every string choice "mode"
# (`reasoning.mode` is a real field), `text.format` names its branch by type.
_TAG_AFTER: dict[str, frozenset[str]] = {
    "tool_choice": frozenset({"mode", "allowed_tools"}),
    "format": frozenset({"text", "json_schema", "json_object", "grammar"}),
    "response_format": frozenset({"text", "json_schema", "json_object"}),
}


@functools.cache
def _request_model_names() -> frozenset[str]:
    """The class names of the API's request models: in a union that is not tagged, pydantic names
    the branch by its class in ``loc`` (``conversation.ConversationRef.id``), which is no field.
    Read at the first error, when every route's models are long defined."""
    names: set[str] = set()
    pending: list[type[BaseModel]] = list(BaseModel.__subclasses__())
    while pending:
        model = pending.pop()
        pending.extend(model.__subclasses__())
        if model.__module__.startswith("api."):
            names.add(model.__name__)
    return frozenset(names)


CHAT_FIELDS = frozenset({"function"})
"""Names that are fields of a Chat Completions body (a tool's, a tool call's, a ``tool_choice``'s
``function``), where in a Responses body they are union tags."""


def _param_path(
    loc: Sequence[int | str], skip_tags: bool = True, fields: frozenset[str] = frozenset()
) -> str | None:
    parts: list[str] = []
    for index, component in enumerate(loc):
        if index == 0 and component == "body":
            continue
        if isinstance(component, int):
            if parts:
                parts[-1] += f"[{component}]"
            continue
        if not _WORD.match(component):
            continue  # e.g. "list[tagged-union[...]]", "function-after[...]"
        if component in fields:
            parts.append(component)
            continue
        if index > 0 and component in _TAG_AFTER.get(str(loc[index - 1]), frozenset()):
            continue
        if index > 0 and component in _request_model_names():
            continue
        if skip_tags and component in _NOT_FIELDS | {
            "message",
            "function_call",
            "function_call_output",
            "custom",
            "custom_tool_call",
            "custom_tool_call_output",
            "reasoning",
            "item_reference",
            "compaction",
            "namespace",
            "input_text",
            "output_text",
            "refusal",
            # Chat Completions: messages tagged by role, content parts by type.
            "system",
            "user",
            "assistant",
            "tool",
            "text",
        }:
            # A tag name appears right after an index; a real field never does.
            if index > 0 and isinstance(loc[index - 1], int):
                continue
            if component in _NOT_FIELDS:
                continue
        parts.append(component)
    return ".".join(parts) or None


def _pick(errors: Sequence[Any]) -> dict[str, Any]:
    # For unions pydantic reports one error per branch; the deepest names the real culprit,
    # and errors we raise on purpose (unsupported, limits) beat type mismatches of other branches.
    def rank(error: dict[str, Any]) -> tuple[int, int]:
        custom = (
            1
            if error["type"]
            in (
                "unsupported_parameter",
                "metadata_limit",
                "invalid_unicode",
                "nesting_limit",
                "items_limit",
                "number_range",
                "unknown_tool_type",
                "invalid_function_parameters",
            )
            else 0
        )
        return (custom, len(error["loc"]))

    return max(errors, key=rank)


RAW_BODY_ERRORS = ("invalid_unicode", "nesting_limit", "items_limit", "number_range")
"""The errors of :func:`api.schemas.check_raw_body`: their messages are written for the client."""


def validation_error_to_openai(errors: Sequence[Any], fields: frozenset[str] = frozenset()) -> OpenAIError:
    """One OpenAI error for pydantic's list of errors; ``fields``: names that are fields of this
    body (:data:`CHAT_FIELDS`) though a Responses body has them as union tags."""
    if not errors:
        return invalid_value("The request is invalid.", None)
    error = _pick(errors)
    kind: str = error["type"]
    param = _param_path(error["loc"], fields=fields)
    if kind in RAW_BODY_ERRORS:
        return invalid_value(str(error["msg"]), (error.get("ctx") or {}).get("param"))
    if kind == "json_invalid" or (kind == "missing" and param is None):  # no body at all
        return OpenAIError(
            400,
            "We could not parse the JSON body of your request. The body must be a JSON object.",
            code="invalid_json",
        )
    if kind == "missing":
        return invalid_value(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        return invalid_value(f"Unknown parameter: '{param}'.", param, "unknown_parameter")
    if kind == "unsupported_parameter":
        return invalid_value(str(error["msg"]), param, "unsupported_parameter")
    if kind == "unknown_tool_type":
        return invalid_value(str(error["msg"]), param)
    if kind == "invalid_function_parameters":
        return invalid_value(str(error["msg"]), param, kind)
    if kind == "union_tag_invalid":
        return invalid_value(f"Invalid value for '{param}': unknown type.", param)
    if _TYPE_ERRORS.search(kind):
        where = f"'{param}'" if param else "the request body (a JSON object is expected)"
        return invalid_value(f"Invalid type for {where}: {_clause(error['msg'])}.", param, "invalid_type")
    return invalid_value(f"Invalid value for '{param}': {_clause(error['msg'])}.", param)


def _clause(message: str) -> str:
    """A validator's message as the end of our sentence: without its own full stop (no "..")."""
    return message.rstrip(".")


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the OpenAI envelope."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> Response:
        return json_response(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        chat = request.url.path.endswith("/chat/completions")
        error = validation_error_to_openai(exc.errors(), CHAT_FIELDS if chat else frozenset())
        return json_response(error.body(), status_code=error.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:  # FastAPI could not decode the body (bad encoding, nesting)
            error = validation_error_to_openai([{"type": "json_invalid", "loc": ("body",), "msg": ""}])
            return json_response(error.body(), status_code=400)
        messages = {404: "Not found.", 405: "Method not allowed.", 413: "Request body too large."}
        error = OpenAIError(
            exc.status_code,
            str(exc.detail)
            if exc.detail and exc.detail not in ("Not Found",)
            else messages.get(exc.status_code, ""),
            type="invalid_request_error",
        )
        return json_response(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    @app.exception_handler(Exception)
    async def _server_side(_: Request, exc: Exception) -> Response:
        error = as_openai_error(exc)
        return json_response(error.body(), status_code=error.status_code, headers=error.headers)
