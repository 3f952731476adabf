"""The stream checker itself: it must fail on the streams it exists to catch."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.invariants import check_stream
from tests.unit.test_events import base_response

BASE: dict[str, Any] = base_response()


def _event(kind: str, number: int, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "sequence_number": number, **fields}


def _stream(
    terminal: str, with_in_progress: bool, with_output: bool, background: bool = True
) -> list[dict[str, Any]]:
    opening = "queued" if background else "in_progress"
    events = [_event("response.created", 0, response={**BASE, "status": opening})]
    if background:
        events.append(_event("response.queued", 1, response={**BASE, "status": "queued"}))
    if with_in_progress:
        events.append(_event("response.in_progress", len(events), response={**BASE, "status": "in_progress"}))
    output: list[dict[str, Any]] = []
    if with_output:
        item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "incomplete", "content": []}
        events.append(_event("response.output_item.added", len(events), output_index=0, item=item))
        events.append(_event("response.output_item.done", len(events), output_index=0, item=item))
        output = [item]
    status = "failed" if terminal == "response.failed" else "incomplete"
    events.append(_event(terminal, len(events), response={**BASE, "status": status, "output": output}))
    return events


@pytest.mark.parametrize("terminal", ["response.failed", "response.incomplete"])
def test_a_background_stream_that_never_started_needs_no_in_progress(terminal: str) -> None:
    check_stream(_stream(terminal, with_in_progress=False, with_output=False), background=True)


@pytest.mark.parametrize("terminal", ["response.failed", "response.incomplete"])
def test_a_failed_or_incomplete_stream_with_output_must_have_in_progress(terminal: str) -> None:
    check_stream(_stream(terminal, with_in_progress=True, with_output=True), background=True)
    with pytest.raises(AssertionError):
        check_stream(_stream(terminal, with_in_progress=False, with_output=True), background=True)


@pytest.mark.parametrize("terminal", ["response.failed", "response.incomplete"])
def test_a_foreground_stream_opens_with_in_progress_even_when_it_never_started(terminal: str) -> None:
    """The API logs a foreground response's ``response.in_progress`` with its creation."""
    check_stream(_stream(terminal, with_in_progress=True, with_output=False, background=False))
    with pytest.raises(AssertionError):
        check_stream(_stream(terminal, with_in_progress=False, with_output=False, background=False))
