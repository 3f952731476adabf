"""Joining the segments one token-stream entry yields."""

from __future__ import annotations

from resq.postprocess.segments import ReasoningSegment, TextSegment, ToolCallSegment, joined


def test_runs_of_one_kind_are_joined_in_order_and_calls_never() -> None:
    call = ToolCallSegment("f", "{}")
    segments = [
        ReasoningSegment("a"),
        ReasoningSegment("b"),
        TextSegment("x", [{"logprob": -1.0}], start=3),
        TextSegment("y", [{"logprob": -2.0}], start=4),
        call,
        ToolCallSegment("f", "{}"),  # equal to the one before, still a call of its own
        TextSegment("z", start=9),
    ]
    assert joined(segments) == [
        ReasoningSegment("ab"),
        TextSegment("xy", [{"logprob": -1.0}, {"logprob": -2.0}]),
        call,
        ToolCallSegment("f", "{}"),
        TextSegment("z"),
    ]
    text = joined(segments)[1]
    assert isinstance(text, TextSegment) and text.start == 3
    assert joined([]) == []
