"""Event type names, as the OpenAI SDK's ``ResponseStreamEvent`` union spells them."""

from __future__ import annotations

from typing import Final

CREATED: Final = "response.created"
QUEUED: Final = "response.queued"
IN_PROGRESS: Final = "response.in_progress"
COMPLETED: Final = "response.completed"
INCOMPLETE: Final = "response.incomplete"
FAILED: Final = "response.failed"

OUTPUT_ITEM_ADDED: Final = "response.output_item.added"
OUTPUT_ITEM_DONE: Final = "response.output_item.done"
CONTENT_PART_ADDED: Final = "response.content_part.added"
CONTENT_PART_DONE: Final = "response.content_part.done"
OUTPUT_TEXT_DELTA: Final = "response.output_text.delta"
OUTPUT_TEXT_DONE: Final = "response.output_text.done"
REASONING_TEXT_DELTA: Final = "response.reasoning_text.delta"
REASONING_TEXT_DONE: Final = "response.reasoning_text.done"
REASONING_SUMMARY_PART_ADDED: Final = "response.reasoning_summary_part.added"
REASONING_SUMMARY_PART_DONE: Final = "response.reasoning_summary_part.done"
REASONING_SUMMARY_TEXT_DELTA: Final = "response.reasoning_summary_text.delta"
REASONING_SUMMARY_TEXT_DONE: Final = "response.reasoning_summary_text.done"
FUNCTION_CALL_ARGUMENTS_DELTA: Final = "response.function_call_arguments.delta"
FUNCTION_CALL_ARGUMENTS_DONE: Final = "response.function_call_arguments.done"
CUSTOM_TOOL_CALL_INPUT_DELTA: Final = "response.custom_tool_call_input.delta"
CUSTOM_TOOL_CALL_INPUT_DONE: Final = "response.custom_tool_call_input.done"

TERMINAL_BY_STATUS: Final = {
    "completed": COMPLETED,
    "incomplete": INCOMPLETE,
    "failed": FAILED,
    # The SDK's event union has no `response.cancelled`: a cancelled response ends its
    # stream with `response.incomplete` whose `response.status` is "cancelled".
    "cancelled": INCOMPLETE,
}
# Chat Completions (resq.protocols.chat): the log's types; only chunks' JSON is ever sent.
CHAT_CREATED: Final = "chat.completion.created"
"""The first entry of a chat completion's log, made by the API (the log exists from the start); never sent."""
CHAT_CHUNK: Final = "chat.completion.chunk"
CHAT_DONE: Final = "chat.completion.done"
CHAT_FAILED: Final = "chat.completion.failed"

TERMINAL_TYPES: Final = frozenset({COMPLETED, INCOMPLETE, FAILED, CHAT_DONE, CHAT_FAILED})
TERMINAL_TYPES_BYTES: Final = frozenset(t.encode() for t in TERMINAL_TYPES)
TERMINAL_TYPES_LISTED: Final = tuple(sorted(TERMINAL_TYPES))
"""The terminal types in a fixed order: the arguments of the scripts that use
:data:`resq.records.LOG_ENDED_LUA`."""
