"""From Responses input items to the chat messages a model's chat template renders.

Pure functions over JSON-shaped dicts, so stored conversations (Redis) and new
requests go through the same code. The mapping follows what Hugging Face chat
templates expect:

- ``instructions`` and ``system``/``developer`` messages become ``system``
  messages (few templates know ``developer``);
- content parts are joined into one string (text-only models);
- consecutive ``function_call`` items (and the assistant text right before
  them) become one assistant message with ``tool_calls`` whose ``arguments`` is
  a dict, as Qwen/Hermes templates render it;
- ``function_call_output`` becomes a ``tool`` message;
- ``custom_tool_call`` / ``custom_tool_call_output`` render the same way, the call's
  ``input`` as its one argument (``{"input": ...}``, how the custom tool was offered);
- a call with a ``namespace`` names its tool ``namespace:name``, as the tool was offered;
- a ``reasoning`` item is attached as ``reasoning_content`` to the assistant
  message that follows it;
- a ``compaction`` item (opened: its ``summary``) stands for everything before it
  (:func:`since_last_compaction`) and becomes part of the leading system message, so
  templates that allow a system message only first still render it.
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]
Item = dict[str, Any]

COMPACTION_HEADER = "Summary of the conversation so far:\n"
"""What precedes a compaction's summary in the system message the model sees."""
CUSTOM_INPUT = "input"
"""The one parameter a custom tool is offered with: its call's text."""
NAMESPACE_SEPARATOR = ":"
"""Between a namespace and a tool's name in the flattened name the model sees (never in a name)."""


def flat_tool_name(namespace: str | None, name: str) -> str:
    """The name the model knows a tool by: ``namespace:name``, or ``name`` outside a namespace."""
    return name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def split_tool_name(flat_name: str) -> tuple[str | None, str]:
    """``(namespace, name)`` of a flattened tool name (no namespace: ``None``)."""
    namespace, separator, name = flat_name.partition(NAMESPACE_SEPARATOR)
    return (namespace, name) if separator and namespace and name else (None, flat_name)


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """The text of a message's content (string or list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces: list[str] = []
    for part in content:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            pieces.append(str(part.get("text", "")))
        elif kind == "refusal":
            pieces.append(str(part.get("refusal", "")))
    return "".join(pieces)


def _arguments_value(arguments: str) -> Any:
    # Templates render `arguments | tojson` for dicts; keep text that is not JSON as text, and
    # so JSON nested past Python's recursion limit (`[[[...]]]`, a RecursionError) and JSON that
    # escapes a lone surrogate (`"\ud800"`, which no UTF-8 prompt can hold): the text as sent
    # renders, where the value took the request (or a conversation that stored it) to a 500.
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    if "\\u" in arguments and not _encodable(value):
        return arguments
    return value


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def items_to_messages(items: list[Item], instructions: str | None = None) -> list[Message]:
    """Chat messages for ``items`` (input items or echoed output items), in order."""
    messages: list[Message] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    pending_reasoning: str | None = None
    for item in items:
        kind = item.get("type") or "message"
        if kind == "message":
            role = item["role"]
            if role == "developer":
                role = "system"
            message: Message = {"role": role, "content": content_text(item.get("content"))}
            if role == "assistant" and pending_reasoning is not None:
                message["reasoning_content"] = pending_reasoning
                pending_reasoning = None
            messages.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            arguments = (
                _arguments_value(item.get("arguments", ""))
                if kind == "function_call"
                else {CUSTOM_INPUT: item.get("input", "")}
            )
            call = {
                "type": "function",
                "id": item["call_id"],
                "function": {
                    "name": flat_tool_name(item.get("namespace"), item["name"]),
                    "arguments": arguments,
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                assistant: Message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if pending_reasoning is not None:
                    assistant["reasoning_content"] = pending_reasoning
                    pending_reasoning = None
                messages.append(assistant)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output)
            messages.append({"role": "tool", "content": text, "tool_call_id": item["call_id"]})
        elif kind == "reasoning":
            pending_reasoning = content_text(item.get("content")) or content_text(item.get("summary"))
        elif kind == "compaction":
            summary = COMPACTION_HEADER + str(item.get("summary", ""))
            if messages and messages[-1]["role"] == "system":
                messages[-1]["content"] = f"{messages[-1]['content']}\n\n{summary}"
            else:
                messages.append({"role": "system", "content": summary})
        else:
            raise ValueError(f"input item of type {kind!r} cannot be rendered")
    return messages


def continue_conversation(
    previous_conversation: list[Item], previous_output: list[Item], new_items: list[Item]
) -> list[Item]:
    """The items of a conversation continued from an earlier response (``previous_response_id``).

    The earlier response's own conversation (its input after everything before
    it), then its output items, then the new input: exactly what a client would
    send to replay the whole history by hand. Instructions are not items: the new
    request's ``instructions`` replace the earlier ones, as OpenAI documents.
    """
    return [*previous_conversation, *previous_output, *new_items]


_OUTPUT_OF = {"function_call_output": "function_call", "custom_tool_call_output": "custom_tool_call"}


def unanswerable_output(items: list[Item], first: int = 0) -> int | None:
    """The index (from ``first`` on) of the first tool output whose call is not before it, if any.

    A compaction item stands for everything before it, calls included: an output after one is
    not checked against what it replaced.
    """
    calls: set[str] = set()
    compacted = False
    for index, item in enumerate(items):
        kind = item.get("type")
        if kind == "compaction":
            compacted = True
        elif kind in _OUTPUT_OF.values():
            calls.add(str(item.get("call_id")))
        elif (
            kind in _OUTPUT_OF and index >= first and not compacted and str(item.get("call_id")) not in calls
        ):
            return index
    return None


def since_last_compaction(items: list[Item]) -> list[Item]:
    """``items`` from the last ``compaction`` item on: the compaction stands for everything before it."""
    for index in range(len(items) - 1, -1, -1):
        if items[index].get("type") == "compaction":
            return items[index:]
    return items


def input_to_items(value: str | list[Item] | None) -> list[Item]:
    """The request's ``input`` as a list of items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value
