"""JSON schemas that structured-output tests constrain a model to, each small enough to finish.

A random-weight model writes valid JSON only if the constraint works, but left to itself it
may also never close a string or stop adding digits: every string has a ``maxLength``, a
``pattern`` or an ``enum``, every number a range, every array a ``maxItems``, and objects
allow no other properties, so that every answer ends well within the token budget.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

NAME: dict[str, Any] = {"type": "string", "maxLength": 8}
SMALL_INT: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 99}


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object with exactly ``properties`` (all required unless ``required`` says otherwise)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": obj({"name": NAME, "age": SMALL_INT}),
    "boolean_and_null": obj({"ok": {"type": "boolean"}, "nothing": {"type": "null"}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "const": obj({"kind": {"const": "point"}, "x": SMALL_INT}),
    "nested": obj({"user": obj({"name": NAME, "address": obj({"city": NAME, "zip": SMALL_INT})})}),
    "array_bounds": obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    "array_of_objects": obj(
        {"points": {"type": "array", "items": obj({"x": SMALL_INT, "y": SMALL_INT}), "maxItems": 2}}
    ),
    "optional_fields": obj({"id": SMALL_INT, "note": NAME, "extra": {"type": "boolean"}}, required=["id"]),
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    "number_range": obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}, "n": SMALL_INT}),
    "negative_range": obj({"t": {"type": "integer", "minimum": -50, "maximum": -10}}),
    "any_of": obj({"value": {"anyOf": [SMALL_INT, {"type": "string", "maxLength": 4}]}}),
    "ref": {
        "$defs": {"item": obj({"sku": {"type": "string", "pattern": "^[a-z]{3}$"}, "qty": SMALL_INT})},
        **obj({"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}}),
    },
    "nullable": obj({"maybe": {"type": ["string", "null"], "maxLength": 5}}),
    "string_length": obj({"word": {"type": "string", "minLength": 3, "maxLength": 6}}),
    "top_level_array": {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 4},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "deep": obj({"a": obj({"b": obj({"c": obj({"d": {"type": "boolean"}})})})}),
    "mixed_array": obj(
        {"row": {"type": "array", "items": {"anyOf": [SMALL_INT, {"type": "boolean"}]}, "maxItems": 3}}
    ),
    "date_like": obj({"day": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$"}}),
}
"""Twenty schemas: nested objects, bounded arrays, enums, optional fields, patterns, ranges, anyOf, $ref."""

WEATHER_PARAMETERS: dict[str, Any] = obj(
    {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}}
)
"""Arguments of a strict function tool."""


def follows(text: str, schema: dict[str, Any]) -> bool:
    """Whether ``text`` is JSON that validates against ``schema``."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
