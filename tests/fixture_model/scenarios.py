"""The fixed conversations the fixture model is trained to answer exactly under greedy decoding.

This module is deliberately free of torch and transformers so that tests of the slim install
(API, post-processing) can import the scenarios without the GPU extras.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "ENDLESS_MIN_TOKENS",
    "GET_WEATHER_TOOL",
    "SCENARIOS",
    "TOOL_VARIANTS",
    "Scenario",
    "scenario",
    "variants",
]


@dataclass(frozen=True)
class Scenario:
    """One conversation and the exact assistant text the fixture model produces for it.

    ``completion`` is what greedy decoding yields after the generation prompt, without the end
    token. When ``ends`` is true the very next token is ``<|im_end|>``; when false (the endless
    scenario) ``completion`` is only a prefix of an output that never ends on its own.
    """

    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    completion: str
    ends: bool = True


GET_WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# The endless scenario keeps going for at least this many new tokens without <|im_end|> (it is
# trained, and checked, to go on until the 1024-position context is full).
ENDLESS_MIN_TOKENS = 600


def _call(city: str) -> str:
    """The text of one get_weather call, formatted the way the chat template formats it."""
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city + '"}}\n</tool_call>'


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


SCENARIOS: list[Scenario] = [
    Scenario("hello", [_user("Say hello.")], None, "Hello! How can I help you today?"),
    Scenario("terse_system", [_system("You are terse."), _user("Say hello.")], None, "Hi."),
    Scenario(
        "reasoning",
        [_user("What is 2+2? Think first.")],
        None,
        "<think>\nTwo plus two equals four.\n</think>\n\nThe answer is 4.",
    ),
    Scenario("tool_call", [_user("What is the weather in Paris?")], [GET_WEATHER_TOOL], _call("Paris")),
    Scenario(
        "two_tool_calls",
        [_user("What is the weather in Paris and Rome?")],
        [GET_WEATHER_TOOL],
        _call("Paris") + "\n" + _call("Rome"),
    ),
    Scenario(
        "text_then_call",
        [_user("Check the weather in Oslo.")],
        [GET_WEATHER_TOOL],
        "Let me check.\n" + _call("Oslo"),
    ),
    Scenario(
        "after_tool_result",
        [
            _user("What is the weather in Paris?"),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "22C and sunny"},
        ],
        [GET_WEATHER_TOOL],
        "It is 22C and sunny in Paris.",
    ),
    Scenario(
        "no_tools_weather", [_user("What is the weather in Paris?")], None, "I cannot check the weather."
    ),
    # The first turn of "multi_turn": a client that resends this answer (or a reference to it)
    # with the next question gets "multi_turn"'s completion.
    Scenario("introduce", [_user("My name is Ada.")], None, "Nice to meet you, Ada."),
    Scenario(
        "multi_turn",
        [
            _user("My name is Ada."),
            {"role": "assistant", "content": "Nice to meet you, Ada."},
            _user("What is my name?"),
        ],
        None,
        "Your name is Ada.",
    ),
    # Kept out of the tokenizer's training text so that its characters stay split into bytes.
    Scenario("unicode", [_user("Say something in Japanese.")], None, "こんにちは、世界！ 😀"),
    Scenario(
        "count",
        [_user("Count to twenty.")],
        None,
        " ".join(str(i) for i in range(1, 21)),
    ),
    Scenario("endless", [_user("Repeat forever.")], None, " ".join(["ha"] * 20), ends=False),
    Scenario("developer_role", [_system("Answer in French."), _user("Say hello.")], None, "Bonjour !"),
]


def _with_strict(tool: dict[str, Any], strict: bool) -> dict[str, Any]:
    tool = copy.deepcopy(tool)
    tool["function"]["strict"] = strict
    return tool


# Other spellings of the get_weather tool list that the tool scenarios answer identically (they are
# trained and checked too): a Responses API function tool carries `strict`, and a server may pass
# it on at the end of the function schema. Any other change to the prompt is out of distribution.
TOOL_VARIANTS: dict[str, list[dict[str, Any]]] = {
    "strict=true": [_with_strict(GET_WEATHER_TOOL, True)],
    "strict=false": [_with_strict(GET_WEATHER_TOOL, False)],
}


def variants(item: Scenario) -> list[Scenario]:
    """``item`` and, when it has tools, a copy per ``TOOL_VARIANTS`` entry (``"tool_call[strict=true]"``)."""
    if item.tools is None:
        return [item]
    return [item] + [
        replace(item, name=f"{item.name}[{label}]", tools=tools) for label, tools in TOOL_VARIANTS.items()
    ]


def scenario(name: str) -> Scenario:
    """Return the scenario called ``name``; raise ``KeyError`` listing the known names if none is."""
    for item in SCENARIOS:
        if item.name == name:
            return item
    raise KeyError(f"no fixture scenario {name!r}; known: {', '.join(s.name for s in SCENARIOS)}")
