"""The recovery protocol against a real Redis: claims and fencing, leases, the reaper's verdicts.

A Redis server of these tests' own (not the suite's database): the end-to-end stack
of the session runs reapers that would otherwise act on these tests' records.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from resq import keys
from resq.celery_app import make_celery
from resq.recovery import generations
from resq.recovery.dispatch import queued_generations, send_generation
from resq.recovery.generations import (
    ALREADY_APPENDED,
    APPENDED,
    FENCED_OFF,
    GONE,
    Fence,
    Generations,
    Progress,
    cancel_checked,
    plan_resume,
)
from resq.recovery.leases import PostprocessLeases, ReleaseAlong
from resq.recovery.reaper import Reaper
from resq.settings import Settings
from resq.wire import FinishEntry, GenerationJob, StartEntry, TokensEntry, decode_entry
from tests.support.redis_server import PrivateRedis

RESPONSE = "resp_" + "a" * 32
OTHER = "resp_" + "b" * 32
TTL_S = 3600


def job(response_id: str = RESPONSE, prompt: list[int] | None = None, budget: int = 10) -> GenerationJob:
    return GenerationJob(
        response_id=response_id,
        model="m",
        prompt_token_ids=prompt or [1, 2, 3],
        max_output_tokens=budget,
        temperature=0,
        top_p=1,
    )


def stage(r: redis.Redis, staged: GenerationJob, at: float | None = None) -> None:
    at = time.time() if at is None else at
    pipe = r.pipeline(transaction=True)
    generations.track(pipe, staged.response_id, at)
    generations.stage(pipe, staged, TTL_S, int(at * 1000))
    pipe.execute()


PUBLISHING = {"path": "one"}
"""How :func:`publish` appends: ``one`` (:meth:`Generations.publish`) or ``round`` (a
:class:`~resq.recovery.generations.PublishRound` of that append), set by :func:`publishing`."""


@pytest.fixture(params=["one", "round"])
def publishing(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test twice: each append on its own, and as a round (the publisher's path), whose
    replies and effects must be the same."""
    PUBLISHING["path"] = request.param
    yield request.param
    PUBLISHING["path"] = "one"


def publish(
    gens: Generations, r: redis.Redis, fence: Fence, entry: object, at: int, check_cancel: bool = False
) -> Any:
    """One append's reply (``[reply, cancel flag]`` with ``check_cancel``)."""
    pipe = r.pipeline(transaction=False)
    if PUBLISHING["path"] == "round":
        publish_round = gens.round()
        publish_round.add(RESPONSE, fence, entry, at, check_cancel)  # type: ignore[arg-type]
        publish_round.queue(pipe)
        (reply,) = pipe.execute()[0]
    else:
        gens.publish(pipe, RESPONSE, fence, entry, at, check_cancel)  # type: ignore[arg-type]
        reply = pipe.execute()[0]
    return reply if check_cancel else int(reply)


def stream_entries(r: redis.Redis, response_id: str = RESPONSE) -> list[object]:
    return [decode_entry(fields) for _, fields in r.xrange(keys.tokens(response_id))]


def field(r: redis.Redis, name: str, response_id: str = RESPONSE) -> str | None:
    value = r.hget(keys.generation(response_id), name)
    return value.decode() if value is not None else None


# --- claims and fenced appends ---------------------------------------------------------------------


def test_one_claim_at_a_time_and_appends_are_fenced_and_exactly_once(r: redis.Redis, publishing: str) -> None:
    gens = Generations(r, TTL_S)
    stage(r, job())
    first = gens.claim(RESPONSE, "gpu-1")
    assert first.outcome == "claimed" and first.fence == Fence("gpu-1", 1)
    assert first.job == job()
    assert not first.published and not first.cancelled
    assert gens.progress_after(RESPONSE, first) == Progress(started=False, token_ids=[], finished=False)
    assert gens.claim(RESPONSE, "gpu-2").outcome == "owned"

    fence = first.fence
    assert publish(gens, r, fence, StartEntry(3), 0) == APPENDED
    assert publish(gens, r, fence, StartEntry(3), 0) == ALREADY_APPENDED
    assert publish(gens, r, fence, TokensEntry([7, 8]), 0) == APPENDED
    assert publish(gens, r, fence, TokensEntry([7, 8]), 0) == ALREADY_APPENDED  # a retried append
    assert publish(gens, r, fence, TokensEntry([9]), 5) == -1  # a gap is refused
    assert field(r, "generated") == "2"

    # The reaper takes the job from its (dead) owner: the old claim can append nothing more.
    assert gens.release_lost(RESPONSE, fence, int(time.time() * 1000)) == 1
    assert gens.release_lost(RESPONSE, fence, int(time.time() * 1000)) is None
    assert publish(gens, r, fence, TokensEntry([9]), 2) == FENCED_OFF
    assert publish(gens, r, fence, FinishEntry("length", 3, 2), 2) == FENCED_OFF
    assert r.zscore(keys.GENERATIONS, RESPONSE) is not None  # a fenced-off finish leaves it listed
    second = gens.claim(RESPONSE, "gpu-2")
    assert second.outcome == "claimed" and second.fence == Fence("gpu-2", 2)
    assert second.published
    assert gens.progress_after(RESPONSE, second) == Progress(started=True, token_ids=[7, 8], finished=False)
    assert second.fence is not None
    # A finish that counts tokens the stream does not hold (their append was refused) is refused too.
    assert publish(gens, r, second.fence, FinishEntry("length", 3, 3), 3) == -1
    assert r.zscore(keys.GENERATIONS, RESPONSE) is not None
    assert publish(gens, r, second.fence, TokensEntry([9]), 2) == APPENDED
    assert publish(gens, r, second.fence, FinishEntry("length", 3, 3), 3) == APPENDED
    # The finish took the job off the reaper's list (and the admission count) in the same step.
    assert r.zscore(keys.GENERATIONS, RESPONSE) is None
    assert publish(gens, r, second.fence, FinishEntry("length", 3, 3), 3) == ALREADY_APPENDED
    assert publish(gens, r, fence, TokensEntry([9]), 3) == FENCED_OFF

    assert stream_entries(r) == [
        StartEntry(3),
        TokensEntry([7, 8]),
        TokensEntry([9]),
        FinishEntry("length", 3, 3),
    ]
    assert field(r, "state") == "finished"
    assert gens.claim(RESPONSE, "gpu-3").outcome == "finished"
    assert gens.claim(OTHER, "gpu-3").outcome == "missing"


def test_a_publish_that_finds_no_job_says_it_is_gone_and_a_finish_unlists_it(
    r: redis.Redis, publishing: str
) -> None:
    """A response deleted while it generates (or an unstored stream dropped) loses its job hash: no
    one else will end it, so its publisher must free its admission slot (it once waited 60 s for
    the reaper's grace), where a job taken over keeps its hash and its listing."""
    gens = Generations(r, TTL_S)
    stage(r, job())
    fence = gens.claim(RESPONSE, "gpu-1").fence
    assert fence is not None
    assert publish(gens, r, fence, TokensEntry([7]), 0) == APPENDED
    r.delete(keys.generation(RESPONSE))
    assert publish(gens, r, fence, TokensEntry([8]), 1) == GONE
    assert cancel_checked(publish(gens, r, fence, TokensEntry([8]), 1, check_cancel=True)) == (GONE, False)
    assert r.zscore(keys.GENERATIONS, RESPONSE) is not None  # a tokens append cannot unlist it
    assert publish(gens, r, fence, FinishEntry("stop", 3, 1), 1) == GONE
    assert r.zscore(keys.GENERATIONS, RESPONSE) is None


def test_a_round_of_appends_of_several_responses_replies_for_each_in_order(r: redis.Redis) -> None:
    """A round mixes appends of 2 and 3 keys and of every kind; each gets its own reply and effect."""
    gens = Generations(r, TTL_S)
    stage(r, job())
    stage(r, job(OTHER))
    mine, other = gens.claim(RESPONSE, "gpu-1").fence, gens.claim(OTHER, "gpu-1").fence
    assert mine is not None and other is not None
    r.set(keys.cancel(RESPONSE), "1")
    publish_round = gens.round()
    publish_round.add(RESPONSE, mine, StartEntry(3), 0)
    publish_round.add(RESPONSE, mine, TokensEntry([7, 8]), 0, check_cancel=True)
    publish_round.add(OTHER, other, TokensEntry([5]), 0)
    publish_round.add(OTHER, other, FinishEntry("stop", 3, 1), 1)
    publish_round.add(RESPONSE, mine, TokensEntry([9]), 5)  # a gap: refused, the rest unaffected
    publish_round.add(RESPONSE, Fence("gpu-2", 1), TokensEntry([9]), 2)  # not the claim: fenced off
    assert len(publish_round) == 6
    pipe = r.pipeline(transaction=True)
    publish_round.queue(pipe)
    (replies,) = pipe.execute()
    assert replies == [APPENDED, [APPENDED, 1], APPENDED, APPENDED, -1, FENCED_OFF]
    assert stream_entries(r) == [StartEntry(3), TokensEntry([7, 8])]
    assert stream_entries(r, OTHER) == [TokensEntry([5]), FinishEntry("stop", 3, 1)]
    assert field(r, "generated") == "2" and field(r, "state", OTHER) == "finished"
    assert r.zscore(keys.GENERATIONS, OTHER) is None and r.zscore(keys.GENERATIONS, RESPONSE) is not None
    empty = r.pipeline(transaction=True)
    gens.round().queue(empty)
    assert len(empty) == 0  # an empty round queues nothing


def test_a_claim_says_whether_an_earlier_claim_published_and_whether_the_response_is_cancelled(
    r: redis.Redis,
) -> None:
    gens = Generations(r, TTL_S)
    stage(r, job())
    first = gens.claim(RESPONSE, "gpu-1")
    assert first.fence is not None and not first.published
    # Only the start entry went out before the claim was lost: the next claim must still read it.
    assert publish(gens, r, first.fence, StartEntry(3), 0) == APPENDED
    assert gens.release_lost(RESPONSE, first.fence, int(time.time() * 1000)) == 1
    r.set(keys.cancel(RESPONSE), "1")
    second = gens.claim(RESPONSE, "gpu-2")
    assert second.published and second.cancelled
    assert gens.progress_after(RESPONSE, second) == Progress(started=True, token_ids=[], finished=False)


def test_a_claim_with_room_in_the_engine_publishes_the_start_entry_once_and_never_for_a_cancelled_job(
    r: redis.Redis,
) -> None:
    gens = Generations(r, TTL_S)
    stage(r, job(prompt=[4, 5, 6, 7]))
    first = gens.claim(RESPONSE, "gpu-1", publish_start=True)
    assert first.fence is not None and first.started and not first.published
    assert stream_entries(r) == [StartEntry(4)]  # the prompt's length, as the publisher's start entry
    assert r.ttl(keys.tokens(RESPONSE)) > 0
    # The publisher's own start entry for this claim is then a duplicate, and tokens follow it.
    assert publish(gens, r, first.fence, StartEntry(4), 0) == ALREADY_APPENDED
    assert publish(gens, r, first.fence, TokensEntry([9]), 0) == APPENDED
    # A later claim of a started job appends no second start, and must read what was published.
    assert gens.release_lost(RESPONSE, first.fence, int(time.time() * 1000)) == 1
    second = gens.claim(RESPONSE, "gpu-2", publish_start=True)
    assert second.fence is not None and not second.started and second.published
    assert stream_entries(r) == [StartEntry(4), TokensEntry([9])]

    # Without room in the engine (the default) nothing is appended; a cancelled job gets no start.
    stage(r, job(OTHER))
    waiting = gens.claim(OTHER, "gpu-1")
    assert waiting.fence is not None and not waiting.started
    assert stream_entries(r, OTHER) == []
    assert gens.hand_back(OTHER, waiting.fence, int(time.time() * 1000))
    r.set(keys.cancel(OTHER), "1")
    cancelled = gens.claim(OTHER, "gpu-1", publish_start=True)
    assert cancelled.cancelled and not cancelled.started
    assert stream_entries(r, OTHER) == [] and field(r, "started", OTHER) == "0"


def test_a_handed_back_job_is_claimable_and_counts_no_loss(r: redis.Redis) -> None:
    gens = Generations(r, TTL_S)
    stage(r, job())
    claim = gens.claim(RESPONSE, "gpu-1")
    assert claim.fence is not None
    assert gens.hand_back(RESPONSE, claim.fence, int(time.time() * 1000))
    assert not gens.hand_back(RESPONSE, claim.fence, int(time.time() * 1000))
    assert field(r, "losses") == "0" and field(r, "owner") == ""
    assert gens.claim(RESPONSE, "gpu-2").outcome == "claimed"


def test_only_an_unowned_job_at_the_same_epoch_can_be_ended_by_the_reaper(r: redis.Redis) -> None:
    gens = Generations(r, TTL_S)
    stage(r, job())
    claim = gens.claim(RESPONSE, "gpu-1")
    assert claim.fence is not None
    assert not gens.end_unowned(RESPONSE, 1, FinishEntry("error", 3, 0, "x"))  # owned
    gens.release_lost(RESPONSE, claim.fence, int(time.time() * 1000))
    assert not gens.end_unowned(RESPONSE, 0, FinishEntry("error", 3, 0, "x"))  # stale epoch
    assert gens.end_unowned(RESPONSE, 1, FinishEntry("error", 3, 0, "x"))
    assert field(r, "state") == "failed"
    assert stream_entries(r) == [FinishEntry("error", 3, 0, "x")]
    assert gens.claim(RESPONSE, "gpu-2").outcome == "failed"


@pytest.mark.parametrize(
    ("progress", "expected"),
    [
        (Progress(False, [], False), ("resume", [1, 2, 3], 10, 0, True)),
        (Progress(True, [], False), ("resume", [1, 2, 3], 10, 0, False)),
        (Progress(True, [5, 6], False), ("resume", [1, 2, 3, 5, 6], 8, 2, False)),
        (Progress(True, [5, 6, 99], False), ("finish", "stop", 3)),
        (Progress(True, list(range(10, 20)), False), ("finish", "length", 10)),
    ],
)
def test_resumption_continues_from_the_published_tokens(
    progress: Progress, expected: tuple[object, ...]
) -> None:
    plan = plan_resume(job(), progress, frozenset({99}))
    if expected[0] == "finish":
        assert plan == FinishEntry(expected[1], 3, expected[2])  # type: ignore[arg-type]
        return
    assert not isinstance(plan, FinishEntry)
    assert (plan.job.prompt_token_ids, plan.job.max_output_tokens) == (expected[1], expected[2])
    assert (plan.already_generated, plan.publish_start, plan.prompt_tokens) == (expected[3], expected[4], 3)


# --- post-process leases ---------------------------------------------------------------------------


def test_a_lease_is_exclusive_until_it_lapses(r: redis.Redis) -> None:
    first = PostprocessLeases(r, "pp-1", lease_s=0.3)
    second = PostprocessLeases(r, "pp-2", lease_s=0.3)
    assert first.take(RESPONSE)
    assert not second.take(RESPONSE)
    assert not first.take(RESPONSE)  # nor the holder twice (a duplicate message)
    first.renew_now()
    assert not second.take(RESPONSE)
    time.sleep(0.45)  # the holder stops renewing: the lease lapses
    assert first.lapsed(10) == [RESPONSE]
    assert second.take(RESPONSE)
    first.renew_now()  # the old holder learns it lost the response
    assert not first.holds(RESPONSE) and second.holds(RESPONSE)
    first.release(RESPONSE)  # a release by the old holder changes nothing
    assert r.hget(keys.POSTPROCESS_LEASE_HOLDERS, RESPONSE) == b"pp-2"
    second.release(RESPONSE)
    assert r.zcard(keys.POSTPROCESS_LEASES) == 0 and r.hlen(keys.POSTPROCESS_LEASE_HOLDERS) == 0


def test_a_release_sent_along_the_last_writes_drops_the_lease_only_once_the_log_has_ended(
    r: redis.Redis,
) -> None:
    """:meth:`PostprocessLeases.release_along`: queued with the terminal event's round trip; it
    releases only when the event log ends with a terminal event and the lease is the caller's."""
    events = keys.events(RESPONSE)
    first = PostprocessLeases(r, "pp-1", lease_s=30)
    second = PostprocessLeases(r, "pp-2", lease_s=30)
    assert first.take(RESPONSE)

    def send(along: ReleaseAlong) -> bool:
        pipe = r.pipeline(transaction=False)
        along.queue(pipe)
        along.settle(pipe.execute(raise_on_error=False)[0])
        return along.released

    along = first.release_along(RESPONSE)
    assert not send(along) and along.script_missing  # a fresh Redis: the script is not loaded
    first.release(RESPONSE, along)  # released the usual way, and the script loaded for next time
    assert r.zcard(keys.POSTPROCESS_LEASES) == 0
    assert first.take(RESPONSE)
    r.xadd(events, {"type": "response.output_text.done", "data": "{}"}, id="0-1")
    along = first.release_along(RESPONSE)
    assert not send(along) and not along.script_missing  # the log has not ended: the lease stays
    r.xadd(events, {"type": "response.completed", "data": "{}"}, id="0-2")
    assert not send(second.release_along(RESPONSE))  # not its lease
    assert r.hget(keys.POSTPROCESS_LEASE_HOLDERS, RESPONSE) == b"pp-1"
    along = first.release_along(RESPONSE)
    assert send(along)
    assert r.zcard(keys.POSTPROCESS_LEASES) == 0 and r.hlen(keys.POSTPROCESS_LEASE_HOLDERS) == 0
    # The usual release then sends nothing (a release of a lease since taken by another would
    # change nothing either, but costs a round trip).
    assert second.take(RESPONSE)
    first.release(RESPONSE, along)
    assert not first.holds(RESPONSE)
    assert r.hget(keys.POSTPROCESS_LEASE_HOLDERS, RESPONSE) == b"pp-2"
    r.script_flush()  # Redis restarted without its scripts: not released along, released after
    r.delete(keys.POSTPROCESS_LEASES, keys.POSTPROCESS_LEASE_HOLDERS)
    assert first.take(RESPONSE)
    along = first.release_along(RESPONSE)
    assert not send(along) and along.script_missing
    first.release(RESPONSE, along)
    assert r.zcard(keys.POSTPROCESS_LEASES) == 0
    assert first.take(RESPONSE)
    assert send(first.release_along(RESPONSE))  # loaded again


def test_started_leases_release_along_the_first_response_on_a_redis_without_scripts(r: redis.Redis) -> None:
    """Started, the leases load the release-along script: the first response's release goes with
    its terminal event, not in a round trip after it (a fresh Redis answered ``NOSCRIPT``)."""
    r.script_flush()
    leases = PostprocessLeases(r, "pp-1", lease_s=30)
    leases.start()
    try:
        assert leases.take(RESPONSE)
        r.xadd(keys.events(RESPONSE), {"type": "response.completed", "data": "{}"}, id="0-1")
        along = leases.release_along(RESPONSE)
        pipe = r.pipeline(transaction=False)
        along.queue(pipe)
        along.settle(pipe.execute(raise_on_error=False)[0])
        assert along.released and not along.script_missing
        assert r.zscore(keys.POSTPROCESS_LEASES, RESPONSE) is None
    finally:
        leases.stop()


def test_a_lease_taken_along_with_reads_is_as_exclusive_and_returns_their_replies(r: redis.Redis) -> None:
    """The post-processor's first reads ride on the round trip that takes the lease."""
    r.set("resq:test:value", "7")

    def reads(pipe: redis.client.Pipeline) -> None:
        pipe.get("resq:test:value")
        pipe.exists("resq:test:missing")

    first = PostprocessLeases(r, "pp-1", lease_s=30)
    second = PostprocessLeases(r, "pp-2", lease_s=30)
    assert first.take_along(RESPONSE, reads) == (True, [b"7", 0])
    assert first.holds(RESPONSE)
    assert second.take_along(RESPONSE, reads) == (False, None)
    assert first.take_along(RESPONSE, reads) == (False, None)  # nor the holder twice
    first.release(RESPONSE)
    r.script_flush()  # Redis restarted without its scripts: taken the ordinary way, reads left out
    assert second.take_along(RESPONSE, reads) == (True, None)
    assert r.hget(keys.POSTPROCESS_LEASE_HOLDERS, RESPONSE) == b"pp-2"
    second.release(RESPONSE)


def test_a_registered_lease_nobody_took_lapses(r: redis.Redis, private_redis: PrivateRedis) -> None:
    import asyncio

    from resq.recovery.leases import register_lease
    from resq.redis_client import async_redis

    async def register() -> None:
        client = async_redis(private_redis.url)
        pipe = client.pipeline(transaction=False)
        register_lease(pipe, RESPONSE, 0.2)
        await pipe.execute()
        await client.aclose()

    asyncio.run(register())
    leases = PostprocessLeases(r, "pp-1", lease_s=5)
    assert leases.lapsed(10) == []
    time.sleep(0.3)
    assert leases.lapsed(10) == [RESPONSE]
    assert leases.take(RESPONSE)
    assert leases.lapsed(10) == []


# --- the reaper -------------------------------------------------------------------------------------


class Dispatched(list[str]):
    """What the reaper sent to the generate queue."""

    def __call__(self, response_id: str, model: str) -> None:
        assert model == "m", "dispatched to another model's queue"
        self.append(response_id)


def reaper_for(r: redis.Redis, url: str, **overrides: object) -> tuple[Reaper, Dispatched]:
    settings = Settings(
        redis_url=url,
        worker_ttl_s=5,
        dispatch_timeout_s=10,
        gpu_lost_timeout_s=30,
        gpu_max_losses=2,
        **overrides,  # type: ignore[arg-type]
    )
    sent = Dispatched()
    return Reaper(r, settings, "test-reaper", send_generation=sent), sent


def beat(r: redis.Redis, worker: str, at: float) -> None:
    r.zadd(keys.GPU_WORKERS, {worker: at})


def test_a_dead_owner_loses_its_job_which_is_dispatched_again(
    r: redis.Redis, private_redis: PrivateRedis
) -> None:
    now = time.time()
    stage(r, job(), at=now)
    gens = Generations(r, TTL_S)
    assert gens.claim(RESPONSE, "gpu-1").outcome == "claimed"
    reaper, sent = reaper_for(r, private_redis.url)
    beat(r, "gpu-1", now)

    reaper.reap_generations(now + 1)  # Redis contact too short to trust any verdict
    reaper._contact_since = now
    reaper.reap_generations(now + 4)  # the owner beat 4 s ago: alive
    assert sent == [] and field(r, "owner") == "gpu-1"

    reaper.reap_generations(now + 6)  # no beat for longer than the worker TTL: dead
    assert sent == [RESPONSE]
    assert field(r, "owner") == "" and field(r, "losses") == "1"
    reaper.reap_generations(now + 7)  # waiting in the queue for a GPU worker: nothing more to do
    assert sent == [RESPONSE]


def test_an_owned_job_without_progress_is_released_though_its_owner_beats(
    r: redis.Redis, private_redis: PrivateRedis
) -> None:
    now = time.time()
    stage(r, job(), at=now)
    gens = Generations(r, TTL_S)
    claim = gens.claim(RESPONSE, "gpu-1")
    assert claim.fence is not None
    pipe = r.pipeline(transaction=False)
    gens.publish(pipe, RESPONSE, claim.fence, StartEntry(3), 0)
    gens.publish(pipe, RESPONSE, claim.fence, TokensEntry([11]), 0)
    pipe.execute()
    progressed_at = int(field(r, "progressed_at") or 0) / 1000
    assert abs(progressed_at - now) < 5  # every claim and append stamps it (Redis' clock)
    reaper, sent = reaper_for(r, private_redis.url, gpu_stall_timeout_s=20)
    reaper._contact_since = now - 60

    beat(r, "gpu-1", progressed_at + 15)
    reaper.reap_generations(progressed_at + 15)  # alive, and its last token 15 s ago: fine
    assert sent == [] and field(r, "owner") == "gpu-1"
    beat(r, "gpu-1", progressed_at + 25)
    reaper.reap_generations(progressed_at + 25)  # alive, but nothing for 25 s: released
    assert sent == [RESPONSE]
    assert field(r, "owner") == "" and field(r, "losses") == "1"
    # The stalled owner's copy is fenced off; the next claim resumes from the stream's token.
    again = gens.claim(RESPONSE, "gpu-1")
    assert again.fence is not None and again.fence.epoch == claim.fence.epoch + 1
    assert gens.progress(RESPONSE).token_ids == [11]


def test_a_job_without_message_is_dispatched_again_but_not_one_waiting_in_the_queue(
    r: redis.Redis, private_redis: PrivateRedis
) -> None:
    now = time.time()
    stage(r, job(RESPONSE), at=now)
    stage(r, job(OTHER), at=now)
    celery = make_celery(Settings(redis_url=private_redis.url))
    r.hset(keys.MODELS, "m", "{}")  # the model has a card: its queue is read
    send_generation(celery, OTHER, "m")  # a real Celery message, as the reaper sends it
    assert queued_generations(r) == {OTHER}
    assert r.llen(keys.generate_queue("m")) == 1

    reaper, sent = reaper_for(r, private_redis.url)
    reaper._contact_since = now - 100
    beat(r, "gpu-1", now + 11)
    reaper.reap_generations(now + 5)
    assert sent == []
    reaper.reap_generations(now + 11)
    assert sent == [RESPONSE]
    reaper.reap_generations(now + 12)  # just dispatched again: not yet
    assert sent == [RESPONSE]


def test_with_no_gpu_worker_for_the_timeout_the_job_fails(
    r: redis.Redis, private_redis: PrivateRedis
) -> None:
    now = time.time()
    stage(r, job(), at=now)
    gens = Generations(r, TTL_S)
    claim = gens.claim(RESPONSE, "gpu-1")
    assert claim.fence is not None
    pipe = r.pipeline(transaction=False)
    gens.publish(pipe, RESPONSE, claim.fence, TokensEntry([4, 5, 6, 7]), 0)
    pipe.execute()
    beat(r, "gpu-1", now)
    reaper, _ = reaper_for(r, private_redis.url)
    reaper._contact_since = now - 100

    reaper.reap_generations(now + 6)  # released
    reaper.reap_generations(now + 30)  # no GPU worker, but not for 30 s yet
    assert field(r, "state") == "pending"
    reaper.reap_generations(now + 37)
    assert field(r, "state") == "failed"
    *_, last = stream_entries(r)
    assert isinstance(last, FinishEntry)
    assert (last.finish_reason, last.prompt_tokens, last.output_tokens) == ("error", 3, 4)
    assert last.error is not None and "lost" in last.error
    assert r.zscore(keys.GENERATIONS, RESPONSE) is None


def test_a_live_gpu_worker_keeps_a_queued_job_from_failing(
    r: redis.Redis, private_redis: PrivateRedis
) -> None:
    now = time.time()
    stage(r, job(), at=now)
    r.hset(keys.MODELS, "m", "{}")
    send_generation(make_celery(Settings(redis_url=private_redis.url)), RESPONSE, "m")
    reaper, sent = reaper_for(r, private_redis.url)
    reaper._contact_since = now - 100
    beat(r, "gpu-busy", now + 500)
    reaper.reap_generations(now + 500)  # waiting behind others for minutes: legitimate
    assert field(r, "state") == "pending" and sent == []


def test_a_job_lost_too_often_fails(r: redis.Redis, private_redis: PrivateRedis) -> None:
    now = time.time()
    stage(r, job(), at=now)
    gens = Generations(r, TTL_S)
    reaper, sent = reaper_for(r, private_redis.url)
    reaper._contact_since = now - 100
    for attempt in (1, 2):
        assert gens.claim(RESPONSE, f"gpu-{attempt}").outcome == "claimed"
        reaper.reap_generations(now + 10 * attempt)
    assert sent == [RESPONSE]  # dispatched again after the first loss only
    assert field(r, "state") == "failed"
    *_, last = stream_entries(r)
    assert isinstance(last, FinishEntry) and last.error is not None and "2 times" in last.error


def test_a_cancelled_job_nobody_owns_ends_at_once(r: redis.Redis, private_redis: PrivateRedis) -> None:
    now = time.time()
    stage(r, job(), at=now)
    r.set(keys.cancel(RESPONSE), "1")
    reaper, _ = reaper_for(r, private_redis.url)
    reaper.reap_generations(now)
    assert stream_entries(r) == [FinishEntry("cancelled", 3, 0)]


def test_listed_generations_that_vanished_or_ended_are_dropped(
    r: redis.Redis, private_redis: PrivateRedis
) -> None:
    now = time.time()
    r.zadd(keys.GENERATIONS, {RESPONSE: now - 120, OTHER: now})  # no hash: deleted, or being created
    reaper, _ = reaper_for(r, private_redis.url)
    reaper.reap_generations(now)
    assert r.zrange(keys.GENERATIONS, 0, -1) == [OTHER.encode()]


# --- backpressure: admission into the generations set ---------------------------------------------


def admit(
    r: redis.Redis, response_id: str, limit: int, at: float = 0.0, owner: str = "", share: int = 0
) -> int:
    pipe = r.pipeline(transaction=False)
    generations.admit(pipe, response_id, at or time.time(), limit, owner, share)
    return int(pipe.execute()[0])


def test_a_keys_share_bounds_its_own_generations_only_and_frees_as_they_end(r: redis.Redis) -> None:
    """One key filled every slot with long jobs, and another key's requests waited behind them or
    got 429s: with a share, the first key is refused at its share, the others are still admitted."""
    alice = [f"resp_a{index:031x}" for index in range(3)]
    bob = [f"resp_b{index:031x}" for index in range(2)]
    assert [admit(r, rid, 10, owner="alice", share=2) for rid in alice] == [1, 1, 0]
    assert [admit(r, rid, 10, owner="bob", share=2) for rid in bob] == [1, 1]
    assert r.zscore(keys.GENERATIONS, alice[2]) is None  # refused: listed nowhere
    assert r.zcard(keys.pending_of("alice")) == 2 and r.ttl(keys.pending_of("alice")) > 0
    # Without a key (or without a share) only the cluster's bound counts.
    assert admit(r, "resp_" + "c" * 32, 10) == 1
    # One of alice's ends (its entry leaves the generations set): her next admission prunes it.
    Generations(r, TTL_S).forget(alice[0])
    assert admit(r, alice[2], 10, owner="alice", share=2) == 1
    assert set(r.zrange(keys.pending_of("alice"), 0, -1)) == {alice[1].encode(), alice[2].encode()}
    # The cluster's bound still holds for everyone.
    assert r.zcard(keys.GENERATIONS) == 5
    assert admit(r, "resp_" + "d" * 32, 5, owner="carol", share=2) == 0


def test_admission_is_bounded_and_frees_as_generations_end(r: redis.Redis) -> None:
    ids = [f"resp_{index:032x}" for index in range(4)]
    assert [admit(r, response_id, 3) for response_id in ids] == [1, 1, 1, 0]
    assert r.zcard(keys.GENERATIONS) == 3
    assert r.zscore(keys.GENERATIONS, ids[3]) is None  # a refused response is not listed
    Generations(r, TTL_S).forget(ids[0])  # what the GPU worker does when a job ends
    assert admit(r, ids[3], 3) == 1
    assert set(r.zrange(keys.GENERATIONS, 0, -1)) == {rid.encode() for rid in ids[1:]}


def test_reaper_frees_the_slots_of_vanished_and_ended_generations(r: redis.Redis) -> None:
    """A slot cannot leak: a deleted response (no hash) and an ended job both leave the set."""
    now = time.time()
    ended = job(OTHER)
    stage(r, ended, now)
    r.hset(keys.generation(OTHER), "state", generations.FINISHED)  # its GPU worker died before the ZREM
    assert admit(r, RESPONSE, 2, now - 120) == 1  # listed long ago, its keys since deleted
    assert admit(r, "resp_" + "c" * 32, 2) == 0
    reaper = Reaper(r, Settings(), "api-test", send_generation=lambda _: None)
    reaper.reap_generations(now)
    assert r.zcard(keys.GENERATIONS) == 0
    assert admit(r, "resp_" + "c" * 32, 2) == 1


def test_a_staged_job_leaves_defaults_out_so_an_older_gpu_worker_reads_it() -> None:
    """A rolling upgrade: a GPU worker whose GenerationJob lacks a newer field (``seed`` here)
    still reads every job that does not use it, and refuses one that does."""
    from pydantic import ConfigDict

    class OlderJob(GenerationJob):
        model_config = ConfigDict(extra="forbid", frozen=True)

    OlderJob.model_fields.pop("seed")
    OlderJob.model_rebuild(force=True)

    class Recorder:
        def __init__(self) -> None:
            self.mapping: dict[str, str] = {}

        def hset(self, _key: str, mapping: dict[str, str]) -> None:
            self.mapping = mapping

        def expire(self, *_args: object) -> None:
            pass

        def zadd(self, *_args: object, **_kwargs: object) -> None:
            pass

    plain, seeded = Recorder(), Recorder()
    generations.stage(plain, job(), 60, 0)  # type: ignore[arg-type]
    generations.stage(seeded, job().model_copy(update={"seed": 3}), 60, 0)  # type: ignore[arg-type]
    assert OlderJob.model_validate_json(plain.mapping["job"]) == OlderJob.model_validate(
        job().model_dump(exclude={"seed"})
    )
    with pytest.raises(ValueError, match="seed"):
        OlderJob.model_validate_json(seeded.mapping["job"])
    assert GenerationJob.model_validate_json(plain.mapping["job"]) == job()


def test_a_job_this_worker_cannot_read_is_claimed_as_unreadable_and_can_be_ended(r: redis.Redis) -> None:
    """A job of a newer release using a field this worker lacks: held (so the worker ends it at
    once with an error) instead of raising and leaving it to the 300 s watchdog."""
    import json

    gens = Generations(r, TTL_S)
    stage(r, job())
    staged = json.loads(r.hget(keys.generation(RESPONSE), "job") or b"{}")
    r.hset(keys.generation(RESPONSE), "job", json.dumps({**staged, "a_future_field": 1}))
    claim = gens.claim(RESPONSE, "gpu-1")
    assert claim.outcome == "unreadable" and claim.fence == Fence("gpu-1", 1) and claim.job is None
    assert claim.error is not None and "GenerationJob" in claim.error
    assert publish(gens, r, claim.fence, FinishEntry("error", 0, 0, "unreadable"), 0) == APPENDED
    assert field(r, "state") == "finished"
