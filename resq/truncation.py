"""``truncation: "auto"``: which items of a conversation may be dropped, oldest first.

Pure functions over JSON-shaped items. A conversation is cut into *turns*, each
starting at a user message and running to the next one; the items before the
first user message form a turn of their own. Truncation drops whole turns from
the start, so:

- the last user message (and its turn) is never dropped;
- ``system`` and ``developer`` messages and ``compaction`` items are never dropped
  (they are instructions, or stand for instructions and history alike);
- a function call is never kept without its output, nor an output without its
  call: both sit in one turn, and an output whose call was dropped (a call answered
  after the next user message) goes with it.

``instructions`` are not items, so nothing here can drop them.
"""

from __future__ import annotations

from typing import Any

Item = dict[str, Any]

_PINNED_ROLES = frozenset({"system", "developer"})
_OUTPUT_TYPES = frozenset({"function_call_output", "custom_tool_call_output"})
_CALL_TYPES = frozenset({"function_call", "custom_tool_call"})


def _pinned(item: Item) -> bool:
    kind = item.get("type") or "message"
    return kind == "compaction" or (kind == "message" and item.get("role") in _PINNED_ROLES)


def _starts_turn(item: Item) -> bool:
    return (item.get("type") or "message") == "message" and item.get("role") == "user"


def turn_starts(items: list[Item]) -> list[int]:
    """The index where each turn begins (0 first, whether or not it is a user message)."""
    starts = [index for index, item in enumerate(items) if _starts_turn(item)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return starts


def droppable_turns(items: list[Item]) -> int:
    """How many turns may be dropped: all but the last."""
    return len(turn_starts(items)) - 1


def drop_oldest_turns(items: list[Item], turns: int) -> list[Item]:
    """``items`` without their ``turns`` oldest turns (pinned items stay, in place)."""
    if turns <= 0:
        return items
    starts = turn_starts(items)
    if turns >= len(starts):
        raise ValueError(f"only {len(starts) - 1} turns may be dropped, not {turns}")
    cut = starts[turns]
    kept = [item for item in items[:cut] if _pinned(item)] + items[cut:]
    calls = {item.get("call_id") for item in kept if item.get("type") in _CALL_TYPES}
    return [item for item in kept if item.get("type") not in _OUTPUT_TYPES or item.get("call_id") in calls]
