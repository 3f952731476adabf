"""Where a prompt is rendered: small ones on the event loop, large ones on the prompt threads."""

from __future__ import annotations

from typing import Any

from api.generation_plan import GenerationPlan
from api.prompting import INLINE_PROMPT_CHARS, PromptRequest, renders_inline


def prompt(items: list[dict[str, Any]], instructions: str | None = None, tools: Any = None) -> PromptRequest:
    return PromptRequest(
        items=items,
        instructions=instructions,
        plan=GenerationPlan(template_tools=tools),
        owner="owner",
        output_budget=16,
    )


def message(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def test_a_chat_turn_renders_inline_and_a_large_prompt_goes_to_the_threads() -> None:
    assert renders_inline(prompt([message("Say hello.")]))
    assert not renders_inline(prompt([message("x" * INLINE_PROMPT_CHARS)]))
    # Many small items add up, and the walk stops once past the bound.
    many = [message("y" * 100) for _ in range(INLINE_PROMPT_CHARS // 100)]
    assert not renders_inline(prompt(many))


def test_instructions_and_tools_count_toward_the_bound() -> None:
    half = "z" * (INLINE_PROMPT_CHARS // 2)
    assert renders_inline(prompt([message(half[:-200])]))
    assert not renders_inline(prompt([message(half)], instructions=half))
    tool = {"type": "function", "function": {"name": "f", "description": half, "parameters": {}}}
    assert not renders_inline(prompt([message(half)], tools=[tool]))
