"""Redis losing its last second mid-stream: ``appendfsync everysec``, kill -9, restart.

A kill -9 of redis-server alone loses nothing with ``everysec``: what it acknowledged is in
the kernel's page cache, and the kernel writes it out. What ``everysec`` can lose is what a
crash of the whole machine loses, the last second not yet fsynced. The test makes that
happen for real: it copies Redis' AOF directory mid-stream (what the disk would hold), lets
the stream go on past it (tokens and events the clients already have), kills Redis with -9,
puts the copy back and starts Redis again. The GPU worker finds its stream shorter and
regenerates the lost tokens, the post-processor meets tokens it already read and an event
log missing events it already logged: the client must see one continuous stream, text
neither repeated nor skipped, equal to an undisturbed run.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from resq import keys
from tests.e2e import test_faults as faults
from tests.e2e.test_faults import (
    LONG,
    LONG_TOKENS,
    RECOVERY_BOUND_S,
    References,
    StackFactory,
    comparable,
    generation_field,
    stored_response,
    stream_with_fault,
)
from tests.support.invariants import check_stream
from tests.support.processes import wait_until

pytestmark = pytest.mark.e2e

make_stack = faults.make_stack
references = faults.references

LOST_TOKENS = 8
"""Tokens generated (and their events logged) after the copy of the AOF: the lost second."""


def test_redis_killed_after_losing_its_last_second_neither_repeats_nor_skips_text(
    make_stack: StackFactory, references: References
) -> None:
    stack = make_stack(postprocess_workers=1, append_only=True)
    server = stack.redis_server
    r = stack.redis
    r.config_set("appendfsync", "everysec")
    seen: dict[str, Any] = {}

    def lose_the_last_second(response_id: str) -> None:
        aof = server.directory / "appendonlydir"
        disk = server.directory / "as-on-disk"
        generated = int(generation_field(r, response_id, "generated") or 0)
        logged = int(r.xlen(keys.events(response_id)))
        shutil.copytree(aof, disk)
        wait_until(
            lambda: (
                int(generation_field(r, response_id, "generated") or 0) >= generated + LOST_TOKENS
                and int(r.xlen(keys.events(response_id))) >= logged + LOST_TOKENS
            ),
            RECOVERY_BOUND_S,
            "tokens and events past the copy",
            stack.group.processes,
        )
        seen.update(
            generated_on_disk=generated,
            generated_at_kill=int(generation_field(r, response_id, "generated") or 0),
        )
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        shutil.rmtree(aof)
        shutil.copytree(disk, aof)
        server.start()
        back = server.client()
        back.config_set("appendfsync", "everysec")
        seen["generated_after_restart"] = int(generation_field(back, response_id, "generated") or 0)
        back.close()

    events, longest_wait = stream_with_fault(stack.client(), lose_the_last_second, **LONG)
    final = check_stream(events)
    response_id = final["id"]
    # The loss was real: Redis came back with fewer tokens than it had acknowledged...
    assert seen["generated_after_restart"] < seen["generated_at_kill"] < LONG_TOKENS, seen
    r = server.client()
    assert comparable(final) == references(**LONG), stack.logs()
    assert comparable(stored_response(r, response_id)) == references(**LONG)
    # Every event logged once (numbered 0..n-1); a client behind a burst may get merged deltas.
    logged = r.xlen(keys.events(response_id))
    assert events[-1]["sequence_number"] == logged - 1 and len(events) <= logged
    assert longest_wait < RECOVERY_BOUND_S, f"the stream stalled {longest_wait:.1f}s"
    # ...the GPU worker regenerated what was lost, and the post-processor logged again the
    # events Redis lost (the same bytes the client had) rather than new ones.
    assert "lost appends; resuming them from Redis" in stack.gpu_workers[0].log_tail(400), stack.logs()
    assert "(Redis came back older); logging them again" in stack.postprocess_workers[0].log_tail(400)
