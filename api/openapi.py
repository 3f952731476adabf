"""``/openapi.json`` as the API really behaves, so that clients and fuzzers read the truth.

FastAPI's generated schema promises 422 validation errors, which resq never sends
(every error is a 4xx in OpenAI's envelope), and knows nothing of the query
parameters the stored-response routes parse by hand (:mod:`api.query`), nor the shape
of a response id. This fixes all three.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.input_items import MAX_LIMIT
from api.query import MAX_POSITION
from resq.ids import RESPONSE_ID_PATTERN

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


QUERY_PARAMETERS: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("/v1/responses/{response_id}", "get"): [
        _query("stream", {"type": "boolean"}, "Stream the response's events (SSE) instead of one JSON body."),
        _query(
            "starting_after",
            {"type": "integer", "minimum": 0, "maximum": MAX_POSITION},
            "With `stream`, replay only the events after this sequence number.",
        ),
    ],
    ("/v1/responses/{response_id}/input_items", "get"): [
        _query("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}, "Items per page."),
        _query("order", {"type": "string", "enum": ["asc", "desc"]}, "Order of the items."),
        _query("after", {"type": "string"}, "List the items after this item id."),
    ],
}


def resq_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI schema: OpenAI error envelopes for 4xx, the hand-parsed query parameters."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["Error"] = ERROR_SCHEMA
    error_response = {
        "description": "An OpenAI-style error.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            responses["4XX"] = error_response
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "response_id":
                    parameter["schema"]["pattern"] = RESPONSE_ID_PATTERN.pattern
            extra = QUERY_PARAMETERS.get((path, method))
            if extra:
                operation["parameters"] = [*operation.get("parameters", []), *extra]
    app.openapi_schema = schema
    return schema
