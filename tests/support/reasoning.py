"""The fixture model's reasoning scenario, as the agent-client and WebSocket tests both ask for it."""

from __future__ import annotations

from typing import Any

from openai import OpenAI

REASONING_PROMPT = "What is 2+2? Think first."
"""The prompt the fixture model answers with reasoning, then :data:`REASONING_TEXT`."""
REASONING_TEXT = "Two plus two equals four."


def reasoning_items(response: Any) -> list[Any]:
    """The reasoning items of a Response."""
    return [item for item in response.output if item.type == "reasoning"]


def unstored_with_sealed_reasoning(client: OpenAI, model: str) -> Any:
    """An unstored response whose reasoning item carries its sealed blob, as Codex asks for it."""
    return client.responses.create(
        model=model,
        input=REASONING_PROMPT,
        temperature=0,
        store=False,
        include=["reasoning.encrypted_content"],
    )
