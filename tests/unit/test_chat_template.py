"""resq's Jinja rendering equals transformers' apply_chat_template for the templates resq ships."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from resq.chat_template import ChatTemplateError, render_chat
from resq.conversation import items_to_messages
from tests.support.tokenizer import TEMPLATE_PATH, tiny_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Say hello."}], None),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi <b>&amp;</b> 😀"}], None),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "22C"},
            {"role": "tool", "content": "sunny"},
        ],
        [WEATHER],
    ),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], [WEATHER]),
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer().tokenizer, eos_token="<|im_end|>")
    tokenizer.chat_template = TEMPLATE_PATH.read_text()
    return tokenizer


@pytest.mark.parametrize(("messages", "tools"), CONVERSATIONS)
def test_rendering_matches_transformers(
    hf_tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    expected = hf_tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    ours = render_chat(
        TEMPLATE_PATH.read_text(), messages, tools=tools, special_tokens={"eos_token": "<|im_end|>"}
    )
    assert ours == expected


def test_items_render_like_the_equivalent_chat(hf_tokenizer: PreTrainedTokenizerFast) -> None:
    items = [
        {"role": "developer", "content": "Be terse."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather "},
                {"type": "input_text", "text": "in Paris?"},
            ],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
    ]
    chat = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "22C"},
    ]
    assert tiny_tokenizer().render(items_to_messages(items), [WEATHER]) == hf_tokenizer.apply_chat_template(
        chat, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )


def test_template_errors_become_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="no system"):
        render_chat("{{ raise_exception('no system') }}", [{"role": "user", "content": "x"}])


def test_sandbox_refuses_python_internals() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat("{{ ''.__class__.__mro__ }}", [])
