"""How tools, tool_choice, parallel_tool_calls, reasoning effort and include shape generation."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import ValidationError
from tokenizers import Tokenizer

from api.errors import OpenAIError, validation_error_to_openai
from api.generation_plan import THINKING_SWITCH, plan_generation, plan_tools, thinking_context, wants_logprobs
from api.prompting import render_prompt
from api.schemas import (
    MAX_ALLOWED_TOOLS,
    MAX_CONTENT_PARTS,
    MAX_INPUT_ITEMS,
    MAX_TOOLS,
    CreateResponseRequest,
)
from api.submission import initial_response, stop_token_ids
from resq.catalog import TextTokenizer
from resq.cli import main
from resq.conversation import input_to_items, items_to_messages
from resq.settings import load_settings
from tests.fixture_model import ensure_fixture_model, scenario
from tests.support.scenarios import scenario_input, scenario_tools
from tests.support.tokenizer import tiny_tokenizer

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {"type": "function", "name": "get_time", "parameters": None}
OPENING = '<tool_call>\n{"name": "'


def request(**fields: Any) -> CreateResponseRequest:
    return CreateResponseRequest.model_validate({"model": "tiny", "input": "hi", **fields})


def refusal(call: Any) -> dict[str, Any]:
    with pytest.raises(OpenAIError) as caught:
        call()
    assert caught.value.status_code == 400
    return caught.value.body()["error"]


# --- tools and tool_choice --------------------------------------------------------------------------


def test_auto_offers_the_tools_as_the_template_expects() -> None:
    plan = plan_tools(request(tools=[WEATHER, TIME]), "hermes", "qwen3")
    assert plan.tools_enabled and plan.forced_prefix == "" and plan.max_calls is None
    assert plan.template_tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER["description"],
                "parameters": WEATHER["parameters"],
            },
        },
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
        },
    ]


def test_none_offers_nothing_and_parses_no_calls() -> None:
    plan = plan_tools(request(tools=[WEATHER], tool_choice="none"), "hermes", None)
    assert plan.template_tools is None and not plan.tools_enabled and plan.forced_prefix == ""
    # Even without a tool parser: nothing is asked that the server cannot do.
    assert not plan_tools(request(tools=[WEATHER], tool_choice="none"), None, None).tools_enabled


def test_required_opens_a_call_and_names_the_only_tool() -> None:
    assert (
        plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), "hermes", None).forced_prefix
        == OPENING
    )
    only = plan_tools(request(tools=[WEATHER], tool_choice="required"), "hermes", None)
    assert only.forced_prefix == OPENING + 'get_weather", "arguments":'


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_where_decoding_is_constrained_a_forced_choice_is_a_grammar_of_calls(choice: Any) -> None:
    """Not a prefill a model may leave: calls only, of the allowed names, any object for a tool
    that is not strict."""
    plan = plan_tools(
        request(tools=[WEATHER, TIME], tool_choice=choice), "hermes", None, constrain_forced=True
    )
    assert plan.forced_prefix == "" and plan.calls is not None and plan.calls.required
    names = [function.name for function in plan.calls.functions]
    assert names == (["get_weather"] if isinstance(choice, dict) else ["get_weather", "get_time"])
    assert all(function.arguments_schema == {"type": "object"} for function in plan.calls.functions)


def test_a_named_function_is_prefilled_up_to_its_arguments() -> None:
    choice = {"type": "function", "name": "get_time"}
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice=choice), "hermes", None)
    assert plan.forced_prefix == OPENING + 'get_time", "arguments":'
    # Where the template opened <think>, reasoning is closed first.
    opened = plan_tools(request(tools=[WEATHER, TIME], tool_choice=choice), "hermes", "deepseek_r1")
    assert opened.forced_prefix == "</think>\n\n" + plan.forced_prefix


def test_impossible_choices_are_refused() -> None:
    missing = refusal(
        lambda: plan_tools(
            request(tools=[WEATHER], tool_choice={"type": "function", "name": "x"}), "hermes", None
        )
    )
    assert missing["param"] == "tool_choice" and "get_weather" in missing["message"]
    no_tools = refusal(lambda: plan_tools(request(tool_choice="required"), "hermes", None))
    assert no_tools["param"] == "tool_choice"
    no_parser = refusal(lambda: plan_tools(request(tools=[WEATHER]), None, None))
    assert (no_parser["param"], no_parser["code"]) == ("tools", "unsupported_parameter")


def test_without_tools_nothing_changes() -> None:
    plan = plan_tools(request(), None, None)
    assert plan.template_tools is None and not plan.tools_enabled and plan.stop_after is None


def test_parallel_tool_calls_false_allows_one_call_and_stops_at_its_end() -> None:
    plan = plan_tools(request(tools=[WEATHER], parallel_tool_calls=False), "hermes", None)
    assert plan.max_calls == 1 and plan.stop_after == "</tool_call>"
    tokenizer = tiny_tokenizer()
    assert stop_token_ids(tokenizer, plan) == [tokenizer.tokenizer.token_to_id("</tool_call>")]
    assert plan_tools(request(tools=[WEATHER], parallel_tool_calls=True), "hermes", None).max_calls is None


def test_a_stop_text_that_is_not_one_token_does_not_stop_the_engine() -> None:
    plan = plan_tools(request(tools=[WEATHER], parallel_tool_calls=False), "hermes", None)
    # The post-processor still ends the answer after the call; the engine just runs on.
    assert stop_token_ids(tiny_tokenizer(), replace(plan, stop_after="</not_one_token>")) == []


# --- reasoning effort -------------------------------------------------------------------------------

QWEN3_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}"
)


def qwen3_style_tokenizer() -> TextTokenizer:
    base = tiny_tokenizer()
    return TextTokenizer(
        card=base.card.model_copy(update={"chat_template": QWEN3_STYLE}), tokenizer=base.tokenizer
    )


@pytest.mark.parametrize(
    ("effort", "switch"), [("none", False), ("minimal", True), ("high", True), ("max", True)]
)
def test_effort_flips_the_templates_thinking_switch(effort: str, switch: bool) -> None:
    tokenizer = qwen3_style_tokenizer()
    assert thinking_context(request(reasoning={"effort": effort}), tokenizer.card, "qwen3") == {
        THINKING_SWITCH: switch
    }
    plan = plan_generation(request(reasoning={"effort": effort}), tokenizer.card, None, "qwen3")
    prompt = tokenizer.decode(render_prompt(tokenizer, [{"role": "user", "content": "hi"}], plan))
    assert prompt.endswith("user\nhi\nassistant\n" if switch else "assistant\n<think>\n\n</think>\n\n"), (
        prompt
    )


def test_no_effort_leaves_the_template_alone() -> None:
    assert thinking_context(request(), qwen3_style_tokenizer().card, "qwen3") == {}


def test_effort_none_without_a_switch() -> None:
    card = tiny_tokenizer().card
    assert THINKING_SWITCH not in card.chat_template
    refused = refusal(lambda: thinking_context(request(reasoning={"effort": "none"}), card, "qwen3"))
    assert refused["param"] == "reasoning.effort"
    # A model that does not reason already honours "none"; other efforts just reason.
    assert thinking_context(request(reasoning={"effort": "none"}), card, None) == {}
    assert thinking_context(request(reasoning={"effort": "low"}), card, "qwen3") == {}


# --- logprobs and echoes ----------------------------------------------------------------------------


def test_logprobs_need_an_engine_that_computes_them() -> None:
    card = tiny_tokenizer().card
    asked = request(include=["message.output_text.logprobs"], top_logprobs=0)
    assert wants_logprobs(asked, card.model_copy(update={"logprobs": True}))
    refused = refusal(lambda: wants_logprobs(asked, card.model_copy(update={"logprobs": False})))
    assert refused["param"] == "include"
    assert not wants_logprobs(request(include=[]), card)


def test_the_response_echoes_what_was_asked() -> None:
    asked = request(
        tools=[{**WEATHER, "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        top_logprobs=3,
        reasoning={"effort": "low", "summary": "auto"},
    )
    created = initial_response(asked, "resp_" + "0" * 32, "tiny", background=False, store=True)
    assert created["tools"] == [{**WEATHER, "strict": True}]
    assert created["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert created["parallel_tool_calls"] is False
    assert created["reasoning"]["effort"] == "low" and created["reasoning"]["summary"] == "auto"
    assert created["top_logprobs"] == 3


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"include": ["reasoning.everything"]}, "include", "invalid_value"),
        ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
        ({"frequency_penalty": "1"}, "frequency_penalty", "invalid_type"),
        ({"service_tier": "gold"}, "service_tier", "invalid_value"),
        ({"tools": [{"type": "teleport"}]}, "tools[0].type", "invalid_value"),
        (
            {"tool_choice": {"type": "allowed_tools", "mode": "sometimes", "tools": []}},
            "tool_choice.mode",
            "invalid_value",
        ),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice.type", "unsupported_parameter"),
        ({"top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"truncation": "sometimes"}, "truncation", "invalid_value"),
        ({"context_management": [{"type": "summary"}]}, "context_management[0].type", "invalid_value"),
        ({"reasoning": {"mode": "pro"}}, "reasoning.mode", "unsupported_parameter"),
        ({"reasoning": {"context": "all_turns"}}, "reasoning.context", "unsupported_parameter"),
        ({"tools": [{**WEATHER, "async": True}]}, "tools[0].async", "unsupported_parameter"),
        ({"tools": [{**WEATHER, "output_schema": {}}]}, "tools[0].output_schema", "unsupported_parameter"),
        (
            {"tools": [{**WEATHER, "allowed_callers": ["programmatic"]}]},
            "tools[0].allowed_callers",
            "unsupported_parameter",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"input": [{"role": "user", "content": "x"}] * (MAX_INPUT_ITEMS + 1)}, "input", "invalid_value"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_text", "text": "a"}] * (MAX_CONTENT_PARTS + 1),
                    }
                ]
            },
            "input",
            "invalid_value",
        ),
        (
            {"tools": [{"type": "function", "name": f"f{index}"} for index in range(MAX_TOOLS + 1)]},
            "tools",
            "invalid_value",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "function", "name": "get_weather"}] * (MAX_ALLOWED_TOOLS + 1),
                },
            },
            "tool_choice.tools",
            "invalid_value",
        ),
    ],
)
def test_refused_fields_name_their_parameter(fields: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ValidationError) as caught:
        request(**fields)
    error = validation_error_to_openai(caught.value.errors()).body()["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_what_clients_commonly_send_is_accepted() -> None:
    accepted = request(
        tools=[
            {**WEATHER, "strict": True, "allowed_callers": ["direct"], "async": False, "defer_loading": False}
        ],
        reasoning={"effort": "medium", "summary": "auto", "context": "auto", "mode": "standard"},
        include=["message.output_text.logprobs"],
        truncation="disabled",
    )
    assert accepted.wants_logprobs


# --- settings ---------------------------------------------------------------------------------------


def test_unknown_parser_names_stop_start_up_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="use one of qwen3, deepseek_r1"):
        load_settings(reasoning_parser="qwen4")
    assert load_settings(tool_parser="").tool_parser is None
    monkeypatch.setenv("RESQ_TOOL_PARSER", "json")
    result = CliRunner().invoke(main, ["api"])
    assert result.exit_code == 1
    assert "RESQ_TOOL_PARSER: 'json' is not a parser resq knows; use one of hermes" in result.output


# --- what the fixture model was trained on ----------------------------------------------------------


def fixture_tokenizer() -> tuple[TextTokenizer, Any]:
    from transformers import AutoTokenizer

    directory = ensure_fixture_model()
    hf = AutoTokenizer.from_pretrained(directory)
    base = tiny_tokenizer()
    card = base.card.model_copy(update={"chat_template": hf.chat_template, "special_tokens": {}})
    return TextTokenizer(card=card, tokenizer=Tokenizer.from_file(str(directory / "tokenizer.json"))), hf


ECHOED_REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "I should look it up."}],
    "status": "completed",
}


@pytest.mark.parametrize("echo_reasoning", [False, True], ids=["items", "items_with_reasoning"])
def test_resent_items_render_exactly_the_trained_prompts(echo_reasoning: bool) -> None:
    tokenizer, hf = fixture_tokenizer()
    for name in ("after_tool_result", "multi_turn", "tool_call", "developer_role"):
        chosen = scenario(name)
        items = scenario_input(chosen)
        for item in items:
            if item.get("type") == "function_call":
                item.update(id="fc_1", status="completed")  # as the SDK echoes an output item
            elif item.get("role") == "assistant":
                item.update(
                    type="message",
                    content=[{"type": "output_text", "text": item["content"], "annotations": []}],
                )
        earlier_output = [
            index
            for index, item in enumerate(items)
            if item.get("role") == "assistant" or item.get("type") == "function_call"
        ]
        if echo_reasoning and earlier_output:
            # A reasoning model's earlier output starts with its reasoning; the template drops it.
            items.insert(earlier_output[0], ECHOED_REASONING)
        validated = request(input=items, tools=scenario_tools(chosen))
        plan = plan_generation(validated, tokenizer.card, "hermes", "qwen3")
        if chosen.tools:
            assert plan.template_tools == chosen.tools, "resq renders tools as the fixture was trained"
        messages = items_to_messages(
            input_to_items([item.model_dump(exclude_none=True) for item in validated.input])
        )  # type: ignore[union-attr]
        ours = render_prompt(tokenizer, messages, plan)
        trained = hf.apply_chat_template(
            chosen.messages, tools=chosen.tools, add_generation_prompt=True, tokenize=False
        )
        assert ours == list(hf(trained, add_special_tokens=False)["input_ids"]), name
