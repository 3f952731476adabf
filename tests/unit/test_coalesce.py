"""Merging the deltas a slow client fell behind on (api/coalesce.py) and when the relay does it."""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import (
    ResponseCustomToolCallInputDeltaEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseReasoningSummaryTextDeltaEvent,
    ResponseReasoningTextDeltaEvent,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
)
from prometheus_client import REGISTRY
from pydantic import BaseModel, TypeAdapter

from api import coalesce, foreground
from api.caller import ANONYMOUS
from api.relay import DONE_FRAME, chat_sse_chunks, coalesced_when_behind, sse_frame
from api.routes import socket as socket_route
from api.routes import stored
from resq import jsonutil
from resq.events import builders as build
from resq.events import types
from resq.events.emitter import EventEmitter
from resq.settings import Settings

Batch = list[tuple[bytes, bytes]]
EVENT = TypeAdapter(ResponseStreamEvent)
DELTA_TYPE = types.OUTPUT_TEXT_DELTA
ITEM = "msg_" + "a" * 32
OTHER_ITEM = "msg_" + "b" * 32


def logprob(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -0.5, "top_logprobs": [], "bytes": list(token.encode())}


def encode(events: list[dict[str, Any]], first_number: int = 0) -> Batch:
    """The events as the log holds them: numbered by the emitter, encoded once."""
    emitter = EventEmitter(first_number)
    encoded = [emitter.emit(event) for event in events]
    return [(event.type.encode(), event.data) for event in encoded]


def text_deltas(pieces: str, item_id: str = ITEM, output_index: int = 0, content_index: int = 0) -> list[Any]:
    return [
        build.output_text_delta(item_id, output_index, content_index, piece, [logprob(piece)])
        for piece in pieces
    ]


def decoded(batch: Batch) -> list[dict[str, Any]]:
    return [jsonutil.loads(data) for _, data in batch]


def test_consecutive_text_deltas_of_one_part_become_one_event_numbered_as_the_last() -> None:
    batch = encode(text_deltas("hello"), first_number=10)

    merged = coalesce.coalesce(batch)

    assert len(merged) == 1
    event_type, data = merged[0]
    assert event_type == types.OUTPUT_TEXT_DELTA.encode()
    event = jsonutil.loads(data)
    assert event["delta"] == "hello"
    assert event["sequence_number"] == 14
    assert [entry["token"] for entry in event["logprobs"]] == list("hello")
    # The shape of the originals, field for field and in their order.
    assert list(event) == list(jsonutil.loads(batch[0][1]))
    ResponseTextDeltaEvent.model_validate(event, strict=True)
    EVENT.validate_python(event, strict=False)


@pytest.mark.parametrize(
    ("model", "events", "text"),
    [
        (
            ResponseReasoningTextDeltaEvent,
            [build.reasoning_text_delta(ITEM, 0, 0, piece) for piece in ("th", "ink", "ing")],
            "thinking",
        ),
        (
            ResponseReasoningSummaryTextDeltaEvent,
            [build.reasoning_summary_text_delta(ITEM, 1, 2, piece) for piece in ("sum", "mary")],
            "summary",
        ),
        (
            ResponseFunctionCallArgumentsDeltaEvent,
            [build.function_call_arguments_delta("fc_1", 2, piece) for piece in ('{"a"', ": ", "1}")],
            '{"a": 1}',
        ),
        (
            ResponseCustomToolCallInputDeltaEvent,
            [build.custom_tool_call_input_delta("ctc_1", 3, piece) for piece in ("SEL", "ECT ", "1")],
            "SELECT 1",
        ),
    ],
    ids=["reasoning_text", "reasoning_summary_text", "function_call_arguments", "custom_tool_call_input"],
)
def test_every_kind_of_delta_merges_into_a_valid_event(
    model: type[BaseModel], events: list[dict[str, Any]], text: str
) -> None:
    batch = encode(events, first_number=3)

    merged = coalesce.coalesce(batch)

    assert len(merged) == 1
    event = jsonutil.loads(merged[0][1])
    assert event["delta"] == text
    assert event["sequence_number"] == 3 + len(events) - 1
    assert list(event) == list(jsonutil.loads(batch[0][1]))
    model.model_validate(event, strict=True)
    EVENT.validate_python(event, strict=False)


@pytest.mark.parametrize(
    "other",
    [
        {"item_id": OTHER_ITEM},
        {"output_index": 1},
        {"content_index": 1},
    ],
    ids=["item_id", "output_index", "content_index"],
)
def test_deltas_of_different_targets_are_not_merged(other: dict[str, Any]) -> None:
    batch = encode([*text_deltas("ab"), *text_deltas("cd", **other)])

    merged = coalesce.coalesce(batch)

    assert [event["delta"] for event in decoded(merged)] == ["ab", "cd"]
    assert [event["sequence_number"] for event in decoded(merged)] == [1, 3]
    assert [event[next(iter(other))] for event in decoded(merged)] == [
        jsonutil.loads(batch[0][1])[next(iter(other))],
        next(iter(other.values())),
    ]


def test_summary_deltas_of_different_summary_parts_are_not_merged() -> None:
    events = [build.reasoning_summary_text_delta(ITEM, 0, index, "x") for index in (0, 0, 1, 1)]

    merged = decoded(coalesce.coalesce(encode(events)))

    assert [(event["summary_index"], event["delta"]) for event in merged] == [(0, "xx"), (1, "xx")]


def test_deltas_of_different_types_are_not_merged() -> None:
    batch = encode(
        [
            build.reasoning_text_delta(ITEM, 0, 0, "a"),
            build.reasoning_text_delta(ITEM, 0, 0, "b"),
            *text_deltas("cd"),
        ]
    )

    merged = coalesce.coalesce(batch)

    assert [event_type for event_type, _ in merged] == [
        types.REASONING_TEXT_DELTA.encode(),
        types.OUTPUT_TEXT_DELTA.encode(),
    ]
    assert [event["delta"] for event in decoded(merged)] == ["ab", "cd"]


def test_deltas_that_are_not_consecutive_are_not_merged_and_other_events_keep_their_bytes() -> None:
    part = build.output_text_part("")
    batch = encode(
        [
            build.content_part_added(ITEM, 0, 0, part),
            *text_deltas("ab"),
            build.content_part_done(ITEM, 0, 0, part),  # between two runs of the same target
            *text_deltas("c"),
            build.function_call_arguments_delta("fc_1", 1, "{"),  # a run of one
        ]
    )

    merged = coalesce.coalesce(batch)

    assert [event["sequence_number"] for event in decoded(merged)] == [0, 2, 3, 4, 5]
    assert [event.get("delta") for event in decoded(merged)] == [None, "ab", None, "c", "{"]
    # Everything that was not merged is the very object the log gave: never decoded and re-encoded.
    for kept, original in [(0, 0), (2, 3), (3, 4), (4, 5)]:
        assert merged[kept] is batch[original]


def test_a_batch_without_runs_is_returned_event_for_event_unchanged() -> None:
    created = build.response_event(types.CREATED, {"id": "resp_1"})
    completed = build.response_event(types.COMPLETED, {"id": "resp_1"})
    batch = encode([created, *text_deltas("a"), build.reasoning_text_delta(ITEM, 0, 0, "b"), completed])

    merged = coalesce.coalesce(batch)

    assert merged == batch
    assert all(kept is original for kept, original in zip(merged, batch, strict=True))
    assert coalesce.coalesce([]) == []


def test_the_terminal_and_created_events_pass_through_around_a_merged_run() -> None:
    created = build.response_event(types.CREATED, {"id": "resp_1"})
    completed = build.response_event(types.COMPLETED, {"id": "resp_1"})
    batch = encode([created, *text_deltas("abc"), completed])

    merged = coalesce.coalesce(batch)

    assert merged[0] is batch[0] and merged[-1] is batch[-1]
    assert len(merged) == 3


TARGETS = [(ITEM, 0, 0), (ITEM, 0, 1), (OTHER_ITEM, 1, 0)]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a loaded machine is slow
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("delta"), st.sampled_from(range(len(TARGETS))), st.text(max_size=3)),
            st.tuples(st.just("reasoning"), st.just(0), st.text(max_size=3)),
            st.tuples(st.just("other"), st.just(0), st.just("")),
        ),
        max_size=40,
    )
)
def test_merging_keeps_every_targets_text_and_numbers_increasing(
    plan: list[tuple[str, int, str]],
) -> None:
    events = []
    for kind, target, text in plan:
        if kind == "delta":
            events.append(build.output_text_delta(*TARGETS[target], text, [logprob(text)]))
        elif kind == "reasoning":
            events.append(build.reasoning_text_delta(ITEM, 0, 0, text))
        else:
            events.append(build.output_item_added(0, build.message_item(ITEM, "in_progress")))
    batch = encode(events)

    merged = coalesce.coalesce(batch)

    def texts(events: list[dict[str, Any]]) -> dict[tuple[Any, ...], str]:
        found: dict[tuple[Any, ...], str] = defaultdict(str)
        for event in events:
            if "delta" in event:
                found[event["type"], event["item_id"], event["content_index"]] += event["delta"]
        return dict(found)

    before, after = decoded(batch), decoded(merged)
    assert texts(after) == texts(before)
    numbers = [event["sequence_number"] for event in after]
    assert numbers == sorted(set(numbers))
    if batch:
        assert numbers[-1] == len(batch) - 1  # the last event's number is never lost
    # Nothing mergeable is left: no two neighbours of one type and one target.
    for earlier, later in itertools.pairwise(after):
        same = earlier["type"] == later["type"] and earlier.get("item_id") == later.get("item_id")
        assert not (same and "delta" in earlier and earlier["content_index"] == later["content_index"])
    # Events that were not deltas are the same objects as before, in the same order.
    assert [event for event in merged if b"delta" not in event[0]] == [
        event for event in batch if b"delta" not in event[0]
    ]


# --- when the relay merges -----------------------------------------------------------------------


def test_lagging_is_never_the_first_batch_and_only_above_the_threshold() -> None:
    assert not coalesce.lagging(first_batch=True, size=1000, coalesce_after=16)
    assert not coalesce.lagging(first_batch=False, size=16, coalesce_after=16)
    assert coalesce.lagging(first_batch=False, size=17, coalesce_after=16)
    assert not coalesce.lagging(first_batch=False, size=1000, coalesce_after=0)  # 0: off


def _saved() -> float:
    return REGISTRY.get_sample_value("resq_sse_deltas_coalesced_total") or 0.0


async def _relayed(batches: list[Batch], coalesce_after: int) -> list[Batch]:
    async def source() -> AsyncIterator[Batch]:
        for batch in batches:
            yield batch

    return [batch async for batch in coalesced_when_behind(source(), coalesce_after)]


def test_the_relay_merges_only_later_batches_above_the_threshold_and_counts_what_it_saved() -> None:
    replay = encode(text_deltas("x" * 20))
    keeping_up = encode(text_deltas("abc"), first_number=20)
    behind = encode(text_deltas("y" * 20), first_number=23)
    saved_before = _saved()

    relayed = asyncio.run(_relayed([replay, [], keeping_up, behind], coalesce_after=16))

    assert relayed[0] == replay  # the catch-up, however long, as logged
    assert relayed[1] == []
    assert relayed[2] == keeping_up  # a client that keeps up gets every event
    assert [event["delta"] for event in decoded(relayed[3])] == ["y" * 20]
    assert decoded(relayed[3])[0]["sequence_number"] == 42
    assert _saved() - saved_before == 19

    assert asyncio.run(_relayed([replay, behind], coalesce_after=0)) == [replay, behind]


# --- the relays that merge: a new stream, a resumed one, the WebSocket; not Chat Completions ------


def _following(batches: list[Batch]) -> Any:
    """A stand-in for ``follow_event_batches``: the given batches, whatever it is asked to follow."""

    async def follow(*_: Any, **__: Any) -> AsyncIterator[Batch]:
        for batch in batches:
            yield batch

    return follow


def _state(coalesce_after: int) -> Any:
    return SimpleNamespace(redis=None, settings=Settings(sse_coalesce_after=coalesce_after))


CREATED = encode([build.response_event(types.CREATED, {"id": "resp_1"})])
LIVE = encode([*text_deltas("abcdef"), build.response_event(types.COMPLETED, {"id": "resp_1"})], 1)
"""Seven events after the first batch: past a threshold of 4, a lagging client's."""


async def _chunks(body: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in body]


def test_a_new_stream_merges_its_lag_and_chat_completions_never(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(foreground, "follow_event_batches", _following([CREATED, LIVE]))
    accepted: Any = SimpleNamespace(response_id="resp_1", background=False, store=True, opened=None)
    state = _state(4)

    merged = asyncio.run(_chunks(foreground.stream_new_response(state, accepted, coalesce_after=4)))

    assert merged[0] == sse_frame(*CREATED[0])
    assert merged[1] == sse_frame(*coalesce.coalesce(LIVE)[0]) + sse_frame(*LIVE[-1]) + DONE_FRAME
    # The chat route passes no threshold: its chunks are relayed as logged.
    chat = asyncio.run(_chunks(foreground.stream_new_response(state, accepted, chat_sse_chunks)))
    assert chat[1] == b"".join(b"data: " + data + b"\n\n" for _, data in LIVE)


def test_a_resumed_stream_replays_exactly_and_merges_only_its_live_lag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stored, "follow_event_batches", _following([CREATED + LIVE[:-1], LIVE[-1:]]))

    replayed = asyncio.run(_chunks(stored._replay(_state(4), "resp_1", None)))

    assert replayed[0] == b"".join(sse_frame(*event) for event in CREATED + LIVE[:-1])
    monkeypatch.setattr(stored, "follow_event_batches", _following([CREATED, LIVE]))
    live = asyncio.run(_chunks(stored._replay(_state(4), "resp_1", 0)))
    assert live[1].count(b"event: response.output_text.delta") == 1


class _RecordingSocket:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def send_text(self, text: str) -> None:
        self.sent.append(text)


def test_the_websocket_sends_a_merged_delta_with_its_stream_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket_route, "follow_event_batches", _following([CREATED, LIVE]))
    websocket = _RecordingSocket()
    relay = socket_route.Socket(websocket, _state(4), ANONYMOUS)  # type: ignore[arg-type]

    final = asyncio.run(relay._relay(SimpleNamespace(response_id="resp_1", opened=None), "lane-1"))  # type: ignore[arg-type]

    assert final == {"id": "resp_1"}
    messages = [jsonutil.loads(text) for text in websocket.sent]
    assert [message["type"] for message in messages] == [types.CREATED, DELTA_TYPE, types.COMPLETED]
    assert messages[1]["delta"] == "abcdef" and messages[1]["sequence_number"] == 6
    assert {message["stream_id"] for message in messages} == {"lane-1"}
