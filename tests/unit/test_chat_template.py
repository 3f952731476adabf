"""resq's Jinja rendering equals transformers' apply_chat_template for the templates resq ships."""

from __future__ import annotations

from typing import Any

import pytest
from jinja2 import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerFast

from resq.chat_template import ChatTemplateError, _ChatTemplateEnvironment, render_chat
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


def test_the_sandbox_still_refuses_mutation_and_internals_after_its_answers_are_remembered() -> None:
    for _ in range(2):  # the second time from the remembered answers
        with pytest.raises(ChatTemplateError):
            render_chat("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])
        with pytest.raises(ChatTemplateError):
            render_chat("{{ messages[0].update({'role': 'system'}) }}", [{"role": "user", "content": "x"}])
        with pytest.raises(ChatTemplateError):
            render_chat("{% set ns = namespace(a=1) %}{{ ns.__class__.__mro__ }}", [])


class _Custom:
    name = "custom"

    def method(self) -> str:
        return "called"

    def append(self, value: str) -> str:  # safe here, where a list's is not
        return value


def test_the_remembered_lookups_answer_as_the_sandbox_does() -> None:
    """``_ChatTemplateEnvironment`` reads a dict's keys directly and remembers which names are safe on
    which type: every lookup gives what jinja's own sandbox gives, shadowed keys and unsafe names too."""
    ours = _ChatTemplateEnvironment()
    theirs = ImmutableSandboxedEnvironment()
    message = {"role": "user", "items": "shadowed", "content": "text", "__class__": "key"}
    loop = theirs.from_string("{% for x in [1] %}{{ loop }}{% endfor %}")
    objects: list[Any] = [message, ["a"], "text", 3, 2.5, None, True, _Custom(), _Custom, str.strip, loop]
    names = [
        "role", "items", "content", "missing", "__class__", "strip", "append", "pop", "update", "keys",
        "format", "mro", "__globals__", "__code__", "name", "method", "upper", "real", "index",
    ]  # fmt: skip
    for _ in range(2):  # the second time from the remembered answers
        for obj in objects:
            for name in names:
                got, expected = ours.getattr(obj, name), theirs.getattr(obj, name)
                assert type(got) is type(expected), (obj, name)
                if not isinstance(expected, Undefined) and not callable(expected):
                    assert got == expected, (obj, name)
                if callable(expected) and hasattr(expected, "__name__"):
                    assert got.__name__ == expected.__name__, (obj, name)
