"""``truncation: "auto"``: whole turns go, oldest first; pinned items and call pairs stay whole."""

from __future__ import annotations

from typing import Any

import pytest

from resq.truncation import drop_oldest_turns, droppable_turns, turn_starts

Item = dict[str, Any]


def user(text: str) -> Item:
    return {"type": "message", "role": "user", "content": text}


def assistant(text: str) -> Item:
    return {"type": "message", "role": "assistant", "content": text}


def call(call_id: str) -> Item:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def output(call_id: str) -> Item:
    return {"type": "function_call_output", "call_id": call_id, "output": "ok"}


SYSTEM: Item = {"type": "message", "role": "developer", "content": "be brief"}


def test_turns_start_at_user_messages() -> None:
    items = [SYSTEM, user("a"), assistant("A"), user("b"), call("1"), output("1"), assistant("B"), user("c")]
    assert turn_starts(items) == [0, 1, 3, 7]
    assert droppable_turns(items) == 3


def test_dropping_keeps_pinned_items_and_the_last_user_message() -> None:
    items = [SYSTEM, user("a"), assistant("A"), user("b"), call("1"), output("1"), assistant("B"), user("c")]
    assert drop_oldest_turns(items, 0) == items
    assert drop_oldest_turns(items, 2) == [
        SYSTEM,
        user("b"),
        call("1"),
        output("1"),
        assistant("B"),
        user("c"),
    ]
    assert drop_oldest_turns(items, 3) == [SYSTEM, user("c")]
    with pytest.raises(ValueError, match="only 3 turns"):
        drop_oldest_turns(items, 4)


def test_an_output_whose_call_was_dropped_goes_with_it() -> None:
    # The call's output arrives after the next user message: dropping the call's turn drops it too.
    items = [user("a"), call("1"), user("b"), output("1"), assistant("B"), user("c")]
    kept = drop_oldest_turns(items, 1)
    assert kept == [user("b"), assistant("B"), user("c")]
    assert all(item.get("call_id") != "1" for item in kept)


def test_a_compaction_item_is_pinned() -> None:
    compaction = {"type": "compaction", "encrypted_content": "rq1_x"}
    items = [compaction, user("a"), assistant("A"), user("b")]
    assert drop_oldest_turns(items, 2) == [compaction, user("b")]


def test_a_tool_output_must_follow_its_call_unless_a_compaction_stands_for_it() -> None:
    from resq.conversation import unanswerable_output

    assert unanswerable_output([user("a"), call("1"), output("1")]) is None
    assert unanswerable_output([user("a"), output("1"), call("1")]) == 1
    assert unanswerable_output([user("a"), call("1"), output("2")]) == 2
    # Only from `first` on (the history was checked when it was input).
    assert unanswerable_output([output("0"), user("a")], first=1) is None
    compaction = {"type": "compaction", "encrypted_content": "rq1_x"}
    assert unanswerable_output([compaction, output("0")]) is None
