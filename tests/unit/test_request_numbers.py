"""Numbers a request may hold: what the stored JSON (orjson, 64-bit integers) can write back."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from api.conversation_schemas import CreateConversationRequest
from api.errors import validation_error_to_openai
from api.schemas import LARGEST_INT, SMALLEST_INT, CreateResponseRequest


def annotated(value: Any) -> dict[str, Any]:
    """A request whose assistant turn carries ``value`` where any JSON is allowed."""
    assistant = {
        "role": "assistant",
        "content": [{"type": "output_text", "text": "x", "annotations": [value]}],
    }
    return {"model": "tiny", "input": [{"role": "user", "content": "hi"}, assistant]}


@pytest.mark.parametrize("value", [SMALLEST_INT, LARGEST_INT, 0, True, 1.5e308, -0.0])
def test_numbers_the_store_can_write_are_accepted_and_written_back(value: Any) -> None:
    request = CreateResponseRequest.model_validate(annotated(value))
    dumped = request.model_dump(mode="json", exclude_none=True)
    assert orjson.loads(orjson.dumps(dumped)) == dumped


def test_the_integer_bounds_are_the_store_encoders() -> None:
    assert orjson.loads(orjson.dumps([SMALLEST_INT, LARGEST_INT])) == [SMALLEST_INT, LARGEST_INT]
    for value in (SMALLEST_INT - 1, LARGEST_INT + 1):
        with pytest.raises(TypeError):
            orjson.dumps(value)


@pytest.mark.parametrize("value", [LARGEST_INT + 1, SMALLEST_INT - 1, 10**400, math.nan, math.inf, -math.inf])
def test_numbers_the_store_cannot_write_are_a_400_naming_where(value: Any) -> None:
    with pytest.raises(ValidationError) as raised:
        CreateResponseRequest.model_validate(annotated(value))
    error = validation_error_to_openai(raised.value.errors())
    assert (error.status_code, error.code, error.param) == (
        400,
        "invalid_value",
        "input[1].content[0].annotations[0]",
    )


def test_a_conversation_item_is_held_to_the_same_numbers() -> None:
    body = {"items": annotated(2**64)["input"]}
    with pytest.raises(ValidationError) as raised:
        CreateConversationRequest.model_validate(body)
    assert validation_error_to_openai(raised.value.errors()).param == "items[1].content[0].annotations[0]"


def test_the_http_parser_keeps_large_integers_exact_so_that_they_are_seen() -> None:
    """FastAPI parses bodies with ``json.loads`` (and the WebSocket messages now too): a large integer
    stays an integer there; orjson would have turned it into a float that passes unseen."""
    assert json.loads("18446744073709551616") == 2**64
    assert isinstance(orjson.loads("18446744073709551616"), float)
