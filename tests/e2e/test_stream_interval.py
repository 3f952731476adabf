"""The stream interval at its default (``RESQ_STREAM_INTERVAL_MS``), with real processes.

The rest of the e2e suite runs with the interval off (its faults and cancels count engine
steps); here the GPU worker packs what a request generates in one interval into one chunk, as
it does by default, and the answer, the stream invariants, a kill -9 mid-stream and a cancel
hold as they do without it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from resq import keys
from resq.settings import Settings
from tests.e2e.conftest import MODEL
from tests.e2e.test_faults import (  # noqa: F401  (fixtures)
    DELTAS_BEFORE_FAULT,
    RECOVERY_BOUND_S,
    STOPPING_LONG,
    References,
    StackFactory,
    comparable,
    count_deltas,
    generation_field,
    make_stack,
    references,
    stream_with_fault,
)
from tests.fixture_model import scenario
from tests.support.invariants import as_dict, check_stream

pytestmark = pytest.mark.e2e

DEFAULT_INTERVAL_MS = str(Settings.model_fields["stream_interval_ms"].default)


def test_the_default_interval_streams_chunks_of_tokens_and_the_same_answer(
    make_stack: StackFactory,  # noqa: F811  (the fixtures imported above)
    references: References,  # noqa: F811
) -> None:
    assert int(DEFAULT_INTERVAL_MS) > 0
    stack = make_stack(RESQ_STREAM_INTERVAL_MS=DEFAULT_INTERVAL_MS)
    with stack.client().responses.create(model=MODEL, stream=True, **STOPPING_LONG) as stream:
        events: list[dict[str, Any]] = [as_dict(event) for event in stream]
    final = check_stream(events)
    assert comparable(final) == references(**STOPPING_LONG), stack.logs()
    deltas = count_deltas(events)
    output_tokens = final["usage"]["output_tokens"]
    print(f"{deltas} delta events for {output_tokens} tokens")
    # The fixture model makes a token in a few ms: an interval holds many. (The first delta is
    # the first token alone; a chunk of one token only comes from a step slower than the interval.)
    assert 1 < deltas <= output_tokens // 2, (deltas, output_tokens)


@pytest.mark.parametrize("role", ["gpu", "postprocess"])
def test_a_worker_killed_mid_stream_loses_and_repeats_nothing_with_the_interval(
    make_stack: StackFactory,  # noqa: F811  (the fixtures imported above)
    references: References,  # noqa: F811
    role: str,
) -> None:
    stack = make_stack(gpu_workers=2, postprocess_workers=2, RESQ_STREAM_INTERVAL_MS=DEFAULT_INTERVAL_MS)
    r = stack.redis
    seen: dict[str, int] = {}

    def kill_holder(response_id: str) -> None:
        if role == "gpu":
            holder = generation_field(r, response_id, "owner")
        else:
            raw = r.hget(keys.POSTPROCESS_LEASE_HOLDERS, response_id)
            holder = raw.decode() if raw else None
        assert holder, f"no {role} worker holds the response"
        stack.role_of(holder).kill()
        seen["generated"] = int(generation_field(r, response_id, "generated") or 0)

    events, longest_wait = stream_with_fault(stack.client(), kill_holder, **STOPPING_LONG)
    final = check_stream(events)
    assert count_deltas(events) >= DELTAS_BEFORE_FAULT
    assert 0 < seen["generated"] < STOPPING_LONG["max_output_tokens"], seen
    assert comparable(final) == references(**STOPPING_LONG), stack.logs()
    assert longest_wait < RECOVERY_BOUND_S, f"the stream stalled {longest_wait:.1f}s"


def test_a_cancel_stops_the_generation_within_the_interval(
    make_stack: StackFactory,  # noqa: F811  (the fixture imported above)
) -> None:
    stack = make_stack(RESQ_STREAM_INTERVAL_MS=DEFAULT_INTERVAL_MS)
    client = stack.client()
    r = stack.redis
    created = client.responses.create(
        model=MODEL, input="Repeat forever.", temperature=0, max_output_tokens=900, background=True
    )
    deadline = time.monotonic() + RECOVERY_BOUND_S
    while int(generation_field(r, created.id, "generated") or 0) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    cancelled_at = time.monotonic()
    client.responses.cancel(created.id)
    while generation_field(r, created.id, "state") != "finished" and time.monotonic() < deadline:
        time.sleep(0.01)
    stopped_after = time.monotonic() - cancelled_at
    final = client.responses.retrieve(created.id)
    assert final.status == "cancelled"
    assert final.usage is not None and 20 <= final.usage.output_tokens < 900
    # The flag is read with the next publication, at most an interval after the last one.
    print(f"stopped {stopped_after * 1000:.0f} ms after the cancel")
    assert stopped_after < 2.0, stopped_after


def test_a_reasoning_answer_gets_one_delta_per_chunk_and_item(
    make_stack: StackFactory,  # noqa: F811  (the fixture imported above)
) -> None:
    """With a reasoning parser the processor walks a chunk token by token, then joins what it found."""
    stack = make_stack(
        RESQ_STREAM_INTERVAL_MS=DEFAULT_INTERVAL_MS, RESQ_REASONING_PARSER="qwen3", RESQ_TOOL_PARSER="hermes"
    )
    expected = scenario("reasoning")
    with stack.client().responses.create(
        model=MODEL, stream=True, input=expected.messages[-1]["content"], temperature=0
    ) as stream:
        events: list[dict[str, Any]] = [as_dict(event) for event in stream]
    final = check_stream(events)
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and message["type"] == "message"
    assert reasoning["content"][0]["text"] == "Two plus two equals four."
    assert message["content"][0]["text"] == "The answer is 4."
    deltas = [event for event in events if event["type"].endswith("_text.delta")]
    assert "".join(e["delta"] for e in deltas if e["type"] == "response.reasoning_text.delta") == (
        "Two plus two equals four."
    )
    output_tokens = final["usage"]["output_tokens"]
    print(f"{len(deltas)} deltas for {output_tokens} tokens")
    assert len(deltas) <= output_tokens // 2, (len(deltas), output_tokens)
