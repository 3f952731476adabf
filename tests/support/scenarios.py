"""Fixture-model scenarios as Responses API input."""

from __future__ import annotations

import json
from typing import Any

from tests.fixture_model import Scenario


def scenario_input(scenario: Scenario) -> list[dict[str, Any]]:
    """The scenario's chat messages as Responses input items (same rendered prompt)."""
    items: list[dict[str, Any]] = []
    call_ids: list[str] = []
    for message in scenario.messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            if message.get("content"):
                items.append({"role": "assistant", "content": message["content"]})
            for call in message["tool_calls"]:
                function = call.get("function", call)
                call_id = f"call_{len(call_ids)}"
                call_ids.append(call_id)
                arguments = function["arguments"]
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call_id,
                        "name": function["name"],
                        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                    }
                )
        elif role == "tool":
            items.append(
                {"type": "function_call_output", "call_id": call_ids.pop(0), "output": message["content"]}
            )
        else:
            items.append({"role": role, "content": message["content"]})
    return items


def scenario_tools(scenario: Scenario) -> list[dict[str, Any]] | None:
    """The scenario's tools as Responses function tools."""
    if not scenario.tools:
        return None
    tools = []
    for tool in scenario.tools:
        function = tool["function"]
        tools.append(
            {
                "type": "function",
                "name": function["name"],
                "description": function.get("description"),
                "parameters": function.get("parameters"),
            }
        )
    return tools
