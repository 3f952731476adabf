"""The ``param`` of a 400 names the field the client sent, never a model's class or a union branch."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from api.chat import in_chat_terms
from api.chat_schemas import ChatCompletionRequest
from api.errors import OpenAIError, validation_error_to_openai
from api.routes.socket import create_request
from api.schemas import CreateResponseRequest


def refused(**fields: Any) -> tuple[str | None, str | None]:
    with pytest.raises(ValidationError) as raised:
        CreateResponseRequest.model_validate({"model": "tiny", "input": "hi", **fields})
    error = validation_error_to_openai(raised.value.errors())
    return error.param, error.code


@pytest.mark.parametrize(
    ("conversation", "expected"),
    [
        ({"id": 3}, ("conversation.id", "invalid_type")),
        ({}, ("conversation.id", "missing_required_parameter")),
        (5, ("conversation", "invalid_type")),
    ],
)
def test_a_conversation_object_is_named_by_its_fields(conversation: Any, expected: tuple[str, str]) -> None:
    # pydantic names the union's object branch by its class: conversation.ConversationRef.id.
    assert refused(conversation=conversation) == expected


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "compaction"}, "input[0].encrypted_content"),
        ({"type": "reasoning", "summary": 3}, "input[0].summary"),
        ({"type": "function_call_output", "output": "x"}, "input[0].call_id"),
    ],
)
def test_an_input_items_field_is_named_without_its_type_tag(item: dict[str, Any], param: str) -> None:
    assert refused(input=[item])[0] == param


def test_a_metadata_key_is_named_as_sent() -> None:
    assert refused(metadata={"Foo": 5}) == ("metadata.Foo", "invalid_type")


@pytest.mark.parametrize("stream", [False, "x", 1, {}])
def test_a_socket_message_may_only_leave_stream_out_or_true(stream: Any) -> None:
    message = {"type": "response.create", "model": "tiny", "input": "hi", "stream": stream}
    with pytest.raises(OpenAIError) as raised:
        create_request(message)
    assert (raised.value.status_code, raised.value.param) == (400, "stream")


@pytest.mark.parametrize("fields", [{}, {"stream": True}, {"stream": None}])
def test_a_socket_message_streams_without_saying_so(fields: dict[str, Any]) -> None:
    request, _ = create_request({"type": "response.create", "model": "tiny", "input": "hi", **fields})
    assert request.stream is True


@pytest.mark.parametrize(
    ("responses_param", "chat_param"),
    [
        ("text.format.schema", "response_format.json_schema.schema"),
        ("tools[3].parameters", "tools[3].function.parameters"),
        ("tools[0].parameters.properties.a", "tools[0].function.parameters.properties.a"),
        ("tools[0].name", "tools[0].function.name"),
        ("tools[0]", "tools[0]"),
        ("input[2].content", "messages[2].content"),
        ("max_output_tokens", "max_tokens"),
    ],
)
def test_an_error_of_a_translated_chat_request_names_the_chat_parameter(
    responses_param: str, chat_param: str
) -> None:
    # Raised by accept() about the translated request: a tool's or response_format's schema, the context.
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    error = in_chat_terms(
        OpenAIError(400, "Invalid schema.", param=responses_param, code="invalid_json_schema"), chat
    )
    assert (error.param, error.code, error.message) == (chat_param, "invalid_json_schema", "Invalid schema.")
