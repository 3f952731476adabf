"""Custom tools: how they are offered, constrained, parsed, streamed and rendered back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from api.errors import OpenAIError
from api.generation_plan import plan_tools
from api.schemas import CreateResponseRequest
from resq.conversation import items_to_messages
from resq.events.assembler import OutputAssembler
from resq.grammars import client_grammar_reference
from resq.options import ProcessingOptions
from resq.postprocess.parsers import make_parser
from resq.postprocess.segments import CustomToolCallSegment, ToolCallSegment

PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
CODE = {
    "type": "custom",
    "name": "code",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]{3}"},
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
EVENT = TypeAdapter(ResponseStreamEvent)


def request(**fields: Any) -> CreateResponseRequest:
    return CreateResponseRequest.model_validate({"model": "tiny", "input": "hi", **fields})


def call_markup(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_a_custom_tool_is_offered_as_a_function_with_one_text_parameter() -> None:
    plan = plan_tools(request(tools=[PATCH]), "hermes", None)
    assert plan.template_tools == [
        {
            "type": "function",
            "function": {
                "name": "apply_patch",
                "description": "Apply a patch.",
                "parameters": {
                    "type": "object",
                    "properties": {"input": {"type": "string"}},
                    "required": ["input"],
                },
            },
        }
    ]
    assert plan.custom_tools == ("apply_patch",) and plan.calls is None  # text format: unconstrained


def test_a_regex_custom_tool_constrains_the_whole_input() -> None:
    plan = plan_tools(
        request(tools=[CODE, WEATHER], tool_choice={"type": "custom", "name": "code"}), "hermes", None
    )
    assert plan.calls is not None and plan.calls.required and plan.forced_prefix == ""
    (function,) = plan.calls.functions
    assert function.name == "code"
    assert function.arguments_schema["properties"]["input"] == {"type": "string", "pattern": "^(?:[A-Z]{3})$"}


def test_a_forced_text_custom_tool_is_prefilled_like_a_function() -> None:
    plan = plan_tools(
        request(tools=[PATCH, WEATHER], tool_choice={"type": "custom", "name": "apply_patch"}), "hermes", None
    )
    assert plan.calls is None and plan.forced_prefix.startswith('<tool_call>\n{"name": "apply_patch"')


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "custom", "name": "get_weather"}}, "tool_choice"),
        ({"tools": [PATCH, {**WEATHER, "name": "apply_patch"}]}, "tools"),
    ],
)
def test_a_choice_or_name_that_cannot_be_honoured_is_a_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        plan_tools(request(**fields), "hermes", None)
    assert caught.value.body()["error"]["param"] == param


def test_a_lark_custom_tool_is_called_with_raw_input() -> None:
    lark = {**CODE, "format": {"type": "grammar", "syntax": "lark", "definition": "start: /a+/"}}
    plan = plan_tools(request(tools=[lark, WEATHER]), "hermes", None)
    assert plan.calls is not None and plan.raw_input_tools == ("code",)
    assert [tool.name for tool in plan.calls.raw_input_tools] == ["code"]
    assert [function.name for function in plan.calls.functions] == ["get_weather"]


def test_the_parser_reads_the_raw_input_form() -> None:
    options = ProcessingOptions(
        model="m",
        tool_parser="hermes",
        tools_enabled=True,
        custom_tools=("apply_patch",),
        raw_input_tools=("apply_patch",),
    )
    parser = make_parser(options)
    patch = '*** Begin Patch\n+ "quoted" {braces}\n*** End Patch'
    text = '<tool_call>\n{"name": "apply_patch"}\n' + patch + "\n</tool_call>"
    segments = [segment for chunk in text for segment in parser.feed(chunk)] + parser.finish()
    assert segments == [CustomToolCallSegment("apply_patch", patch)]


def test_the_raw_input_form_is_text_for_other_names() -> None:
    options = ProcessingOptions(
        model="m", tool_parser="hermes", tools_enabled=True, raw_input_tools=("apply_patch",)
    )
    parser = make_parser(options)
    text = '<tool_call>\n{"name": "other"}\nraw\n</tool_call>'
    segments = parser.feed(text) + parser.finish()
    assert "".join(getattr(segment, "text", "") for segment in segments) == text


def test_the_parser_turns_a_custom_call_into_its_input() -> None:
    options = ProcessingOptions(
        model="m", tool_parser="hermes", tools_enabled=True, custom_tools=("apply_patch",)
    )
    parser = make_parser(options)
    text = call_markup("apply_patch", {"input": 'line 1\nline "2"'}) + "\n" + call_markup("get_weather", {})
    segments = parser.feed(text) + parser.finish()
    assert segments == [
        CustomToolCallSegment("apply_patch", 'line 1\nline "2"'),
        ToolCallSegment("get_weather", "{}"),
    ]


def test_arguments_without_a_text_input_are_the_input_as_written() -> None:
    parser = make_parser(
        ProcessingOptions(model="m", tool_parser="hermes", tools_enabled=True, custom_tools=("x",))
    )
    assert parser.feed(call_markup("x", {"patch": 1})) + parser.finish() == [
        CustomToolCallSegment("x", '{"patch": 1}')
    ]


def test_a_custom_call_streams_as_the_sdk_expects() -> None:
    assembler = OutputAssembler("resp_" + "0" * 32)
    events = assembler.add(CustomToolCallSegment("apply_patch", "*** Begin Patch"))
    assert [event["type"] for event in events] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    for number, event in enumerate(events):
        EVENT.validate_python({**event, "sequence_number": number})
    (item,) = assembler.items
    assert item["type"] == "custom_tool_call" and item["input"] == "*** Begin Patch"
    assert item["id"].startswith("ctc_") and item["call_id"].startswith("call_")


def test_custom_calls_and_their_outputs_render_back_as_tool_calls() -> None:
    items = [
        {"type": "message", "role": "user", "content": "Fix it."},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done."},
    ]
    messages = items_to_messages(items)
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "id": "call_1",
                "function": {"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}},
            }
        ],
    }
    assert messages[2] == {"role": "tool", "content": "Done.", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    ("grammar", "reference"),
    [
        ('start: <[0]> "a"', "<[0]>"),
        ("start: x\nx: <|endoftext|>", "<|endoftext|>"),
        ('start: "a" <think>', "<think>"),
        ("start: @tool_0", "@tool_0"),
        # Inside strings, regexes and comments the same characters are text.
        ('start: "<[0]> @tool_0" /<a>|@b/ // <x> @c\n', None),
        ('start: "\\"<[0]>" /\\/<a>/', None),
        ('start: x -> y\nx: %json {"type": "string", "pattern": "<a>"}', None),
    ],
)
def test_a_client_grammar_may_not_reach_tokens_or_other_grammars(grammar: str, reference: str | None) -> None:
    assert client_grammar_reference(grammar) == reference
