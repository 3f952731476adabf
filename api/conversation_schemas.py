"""The request bodies of ``/v1/conversations``, validated as strictly as ``POST /v1/responses``.

Items are the input items ``POST /v1/responses`` accepts (:data:`api.schemas.InputItem`),
metadata has the same limits as a response's. Unknown fields are refused
(``unknown_parameter``); ``null`` counts as absent where the SDK allows it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator
from pydantic_core import PydanticCustomError

from api.schemas import CreateResponseRequest, InputItem, check_raw_body
from resq.conversations import MAX_ITEMS_PER_ADD

_EXAMPLE_ITEMS: list[JsonValue] = [{"type": "message", "role": "user", "content": "Hello!"}]


def _at_most_per_add(value: Any) -> Any:
    # Counted before each item is validated: a body of 100 000 tiny items is refused at once.
    if isinstance(value, list) and len(value) > MAX_ITEMS_PER_ADD:
        raise PydanticCustomError(
            "too_long",
            "at most {limit} items may be added at a time, not {count}",
            {"limit": MAX_ITEMS_PER_ADD, "count": len(value)},
        )
    return value


def _metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    # The limits of a response's metadata, from the one validator that states them.
    checked: dict[str, str] | None = CreateResponseRequest._metadata_limits(value)
    return checked


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _sane_body(cls, value: Any) -> Any:
        check_raw_body(value)
        return value


class CreateConversationRequest(_Body):
    """``POST /v1/conversations``: up to 20 initial items and metadata, both optional."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{}, {"items": _EXAMPLE_ITEMS, "metadata": {"topic": "demo"}}]},
    )

    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS_PER_ADD)
    metadata: dict[str, str] | None = None

    @field_validator("items", mode="before")
    @classmethod
    def _items_limit(cls, value: Any) -> Any:
        return _at_most_per_add(value)

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _metadata(value)


class UpdateConversationRequest(_Body):
    """``POST /v1/conversations/{id}``: the new metadata (required; ``null`` clears it)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"metadata": {"topic": "x"}}]})

    metadata: dict[str, str] | None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _metadata(value)


class AddItemsRequest(_Body):
    """``POST /v1/conversations/{id}/items``: 1 to 20 items, appended in order."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"items": _EXAMPLE_ITEMS}]})

    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_PER_ADD)

    @field_validator("items", mode="before")
    @classmethod
    def _items_limit(cls, value: Any) -> Any:
        return _at_most_per_add(value)
