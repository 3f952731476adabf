"""The GPU worker's publisher against a real Redis: one round trip per step, start entries in it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
from prometheus_client import REGISTRY
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from gpu_worker import pipelines
from gpu_worker.engine import Engine, engine_request_id
from gpu_worker.publisher import TokenPublisher
from resq import keys
from resq.recovery import generations
from resq.recovery.generations import Fence, Generations, plan_resume
from resq.recovery.generations import Resumption as Plan
from resq.redis_types import range_entries
from resq.wire import FinishEntry, GenerationJob, StartEntry, TokensEntry, TokenStreamEntry, decode_entry
from tests.support.redis_server import PrivateRedis

TTL_S = 600
EOS = 2


class FakeEngine:
    """The part of :class:`Engine` the publisher uses; outputs are fed by the test."""

    eos_token_ids = frozenset({EOS})

    def __init__(self) -> None:
        self.outputs: list[GenerationOutput] = []
        self.released = 0
        self.cancelled: list[str] = []
        self.waits: list[float] = []
        """The longest wait for output the publisher asked for, per step."""
        self.quiet_until: list[float] = []
        """Until when, per step, only first tokens and ends were to cut that wait short."""

    def forget(self, response_id: str) -> None:
        """Nothing kept per request (no grammars)."""

    def next_outputs(self, timeout_s: float, quiet_until: float = 0.0) -> list[GenerationOutput]:
        self.waits.append(timeout_s)
        self.quiet_until.append(quiet_until)
        if not self.outputs:
            time.sleep(min(timeout_s, 0.01))
        outputs, self.outputs = self.outputs, []
        return outputs

    def is_running(self) -> bool:
        return True

    def release_slot(self) -> None:
        self.released += 1

    def cancel(self, response_id: str) -> None:
        self.cancelled.append(response_id)

    def cached_tokens(self, request_id: str) -> int:
        return 0


class CountingPipeline(redis.client.Pipeline):
    """A pipeline that fails a test if it sends anything outside the pipelined batch."""

    def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        raise AssertionError(f"an extra round trip: {args[0]}")


@pytest.fixture
def r(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    yield redis_client


def new_pipeline(client: redis.Redis) -> redis.client.Pipeline:
    return CountingPipeline(
        client.connection_pool, client.response_callbacks, transaction=False, shard_hint=None
    )


def staged_job(r: redis.Redis, max_output_tokens: int = 8) -> GenerationJob:
    job = GenerationJob(
        response_id="resp_" + uuid.uuid4().hex,
        model="m",
        prompt_token_ids=[5, 6, 7],
        max_output_tokens=max_output_tokens,
        temperature=0.0,
        top_p=1.0,
    )
    pipe = r.pipeline(transaction=False)
    generations.stage(pipe, job, TTL_S, int(time.time() * 1000))
    pipe.execute()
    return job


def new_publisher(r: redis.Redis, engine: FakeEngine) -> tuple[Generations, TokenPublisher]:
    """A publisher over ``engine`` (not started: tests drive ``step`` themselves or call ``start``)."""
    gens = Generations(r, TTL_S)
    return gens, TokenPublisher(r, cast(Engine, engine), gens, dispatch=lambda _: None)


def claim_and_plan(gens: Generations, job: GenerationJob) -> tuple[Fence, Plan]:
    """Claim ``job`` as worker ``gpu-test`` and plan its (re)start: the fence and the plan."""
    claim = gens.claim(job.response_id, "gpu-test")
    assert claim.fence is not None
    plan = plan_resume(job, gens.progress(job.response_id), frozenset({EOS}))
    assert isinstance(plan, Plan)
    return claim.fence, plan


def stream(r: redis.Redis, response_id: str) -> list[TokenStreamEntry]:
    return [decode_entry(fields) for _, fields in range_entries(r.xrange(keys.tokens(response_id)))]


@pytest.mark.parametrize("transaction", [False, True], ids=["pipeline", "transaction"])
def test_a_pipeline_of_lua_calls_is_one_round_trip_and_survives_noscript(
    r: redis.Redis, transaction: bool
) -> None:
    # A script text Redis has never seen: the first send meets NOSCRIPT, loads it, resends (in a
    # transaction the commands around the refused EVALSHAs ran: they are safe to repeat).
    script = r.register_script(f"-- {uuid.uuid4().hex}\nreturn redis.call('INCRBY', KEYS[1], ARGV[1])")
    key = "resq-test:" + uuid.uuid4().hex
    for expected in ([2, 5, b"5"], [7, 10, b"10"]):
        pipe = r.pipeline(transaction=transaction)
        script(keys=[key], args=[2], client=pipe)
        script(keys=[key], args=[3], client=pipe)
        pipe.get(key)
        # redis-py would send SCRIPT EXISTS first (Pipeline.load_scripts): an extra round trip.
        pipe.load_scripts = lambda: pytest.fail("SCRIPT EXISTS sent")  # type: ignore[method-assign]
        assert pipelines.execute(r, pipe) == expected
    r.delete(key)


def test_the_start_entry_goes_out_with_the_first_tokens_in_one_round_trip(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = FakeEngine()
    gens, publisher = new_publisher(r, engine)
    job = staged_job(r)
    fence, plan = claim_and_plan(gens, job)
    assert plan.publish_start
    publisher.start_request(job.response_id, fence, plan)
    # Admission itself writes nothing: nothing stands between the Celery message and the engine.
    assert stream(r, job.response_id) == []

    monkeypatch.setattr(r, "pipeline", lambda transaction=False: new_pipeline(r))
    engine.outputs.append(
        GenerationOutput(job.response_id, generated_tokens=[11, 12], status=RequestStatus.DECODING)
    )
    publisher.step(0)
    engine.outputs.append(
        GenerationOutput(job.response_id, generated_tokens=[11, 12, 13, EOS], status=RequestStatus.FINISHED)
    )
    publisher.step(0)
    assert stream(r, job.response_id) == [
        StartEntry(3),
        TokensEntry([11, 12], start=0),
        TokensEntry([13, EOS], start=2),
        FinishEntry("stop", 3, 4),
    ]
    assert engine.released == 1 and publisher.active_count == 0


def test_a_prefill_only_request_publishes_its_start_and_a_stop_with_no_tokens(r: redis.Redis) -> None:
    """A prewarm's one engine token is never output: its stream is a start and a ``stop`` finish
    with 0 output tokens, and its slot is released."""
    engine = FakeEngine()
    gens, publisher = new_publisher(r, engine)
    job = staged_job(r, max_output_tokens=2)
    fence, plan = claim_and_plan(gens, job)
    publisher.start_request(job.response_id, fence, plan, prefill_only=True)
    engine.outputs.append(decoding(job, [11]))  # a first token, which would go out at once
    publisher.step(0)
    engine.outputs.append(finished(job, [11, 12]))  # at the job's limit: not EOS
    publisher.step(0)
    assert stream(r, job.response_id) == [StartEntry(3), FinishEntry("stop", 3, 0)]
    assert engine.released == 1 and publisher.active_count == 0


def test_a_start_entry_goes_out_while_the_engine_is_still_busy(r: redis.Redis) -> None:
    engine = FakeEngine()
    gens, publisher = new_publisher(r, engine)
    job = staged_job(r)
    fence, plan = claim_and_plan(gens, job)
    publisher.start()
    try:
        publisher.start_request(job.response_id, fence, plan)
        deadline = time.monotonic() + 5
        while not stream(r, job.response_id) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream(r, job.response_id) == [StartEntry(3)]
    finally:
        publisher.stop()


def test_a_resumed_request_does_not_repeat_its_start_entry(r: redis.Redis) -> None:
    engine = FakeEngine()
    gens, publisher = new_publisher(r, engine)
    job = staged_job(r)
    first = gens.claim(job.response_id, "gpu-lost")
    assert first.fence is not None
    pipe = r.pipeline(transaction=False)
    gens.publish(pipe, job.response_id, first.fence, StartEntry(3), 0)
    gens.publish(pipe, job.response_id, first.fence, TokensEntry([11]), 0)
    pipe.execute()
    assert gens.release_lost(job.response_id, first.fence, int(time.time() * 1000)) is not None
    fence, plan = claim_and_plan(gens, job)
    assert not plan.publish_start
    publisher.start_request(job.response_id, fence, plan)
    engine.outputs.append(
        GenerationOutput(job.response_id, generated_tokens=[12], status=RequestStatus.DECODING)
    )
    publisher.step(0)
    # Its tokens carry their position in the whole output, counting the lost worker's.
    assert stream(r, job.response_id) == [StartEntry(3), TokensEntry([11]), TokensEntry([12], start=1)]


def admitted(r: redis.Redis) -> tuple[FakeEngine, Generations, TokenPublisher, GenerationJob, Fence, str]:
    """A staged job claimed and admitted under its claim's engine request id: what the test needs."""
    engine = FakeEngine()
    gens, publisher = new_publisher(r, engine)
    job = staged_job(r)
    fence, plan = claim_and_plan(gens, job)
    request_id = engine_request_id(job.response_id, fence.epoch)
    publisher.start_request(job.response_id, fence, plan, request_id=request_id)
    return engine, gens, publisher, job, fence, request_id


def test_a_worker_that_claims_its_own_job_again_drops_the_old_copys_output(r: redis.Redis) -> None:
    """The zombie: this worker froze past its TTL, its claim was released, and on waking it claimed
    the job again while the old copy was still in its engine. Only the new claim's tokens go out."""
    engine, gens, publisher, job, old_fence, old_id = admitted(r)
    engine.outputs.append(GenerationOutput(old_id, generated_tokens=[11, 12], status=RequestStatus.DECODING))
    publisher.step(0)

    assert gens.release_lost(job.response_id, old_fence, int(time.time() * 1000)) is not None
    fence, plan = claim_and_plan(gens, job)
    new_id = engine_request_id(job.response_id, fence.epoch)
    assert new_id != old_id and plan.already_generated == 2
    publisher.start_request(job.response_id, fence, plan, request_id=new_id)
    # The old copy is stopped in the engine and its slot given back, once.
    assert engine.cancelled == [old_id] and engine.released == 1

    # Its outputs still queued are dropped; the new copy goes on from the stream's 2 tokens.
    engine.outputs += [
        GenerationOutput(old_id, generated_tokens=[11, 12, 13, 14], status=RequestStatus.DECODING),
        GenerationOutput(new_id, generated_tokens=[13], status=RequestStatus.DECODING),
    ]
    publisher.step(0)
    engine.outputs += [
        GenerationOutput(old_id, generated_tokens=[11, 12, 13, 14, EOS], status=RequestStatus.FINISHED),
        GenerationOutput(new_id, generated_tokens=[13, EOS], status=RequestStatus.FINISHED),
    ]
    publisher.step(0)
    assert stream(r, job.response_id) == [
        StartEntry(3),
        TokensEntry([11, 12], start=0),
        TokensEntry([13], start=2),
        TokensEntry([EOS], start=3),
        FinishEntry("stop", 3, 4),
    ]
    assert engine.released == 2 and publisher.active_count == 0


def test_a_claim_released_while_its_copy_is_silent_is_stopped_at_the_next_step(r: redis.Redis) -> None:
    """The watchdog released the job (no progress) while this worker's copy appended nothing: the
    publisher sees the claim is gone in its usual round trip and stops the copy."""
    engine, gens, publisher, job, fence, request_id = admitted(r)
    publisher.step(0)
    assert publisher.active_count == 1 and engine.cancelled == []
    assert gens.release_lost(job.response_id, fence, int(time.time() * 1000)) is not None
    publisher.step(0)
    assert engine.cancelled == [request_id] and engine.released == 1 and publisher.active_count == 0


class RecordingPipeline(redis.client.Pipeline):
    """A pipeline that notes the name of every command queued on it (in ``commands``)."""

    commands: list[str]

    def pipeline_execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands.append(str(args[0]).upper())
        return super().pipeline_execute_command(*args, **options)


def test_a_rounds_cancel_check_rides_on_the_append_of_a_request_with_new_tokens(r: redis.Redis) -> None:
    """No EXISTS nor HMGET for a request that appends tokens in the round: the append's fence is
    the claim check, and its script reports the cancel flag."""
    commands: list[str] = []

    def recording_pipeline(transaction: bool = True, shard_hint: Any = None) -> redis.client.Pipeline:
        pipe = RecordingPipeline(r.connection_pool, r.response_callbacks, transaction, shard_hint)
        pipe.commands = commands
        return pipe

    spied = redis.Redis(connection_pool=r.connection_pool)
    spied.pipeline = recording_pipeline  # type: ignore[method-assign]
    engine, _, publisher, job, _, request_id = admitted(spied)
    engine.outputs.append(decoding_request(request_id, [11]))
    publisher.step(0)
    assert engine.cancelled == []
    r.set(keys.cancel(job.response_id), "1", ex=60)
    commands.clear()
    engine.outputs.append(decoding_request(request_id, [11, 12]))
    publisher.step(0)
    assert engine.cancelled == [request_id]
    assert "EXISTS" not in commands and "HMGET" not in commands
    entries = stream(r, job.response_id)
    assert entries[-2:] == [TokensEntry([12], start=1), FinishEntry("cancelled", 3, 2)]
    r.delete(keys.cancel(job.response_id))


def test_a_checked_publish_reports_the_cancel_flag_with_every_outcome(r: redis.Redis) -> None:
    gens = Generations(r, TTL_S)
    job = staged_job(r)
    fence, _ = claim_and_plan(gens, job)

    def publish(entry: TokenStreamEntry, at: int) -> tuple[int, bool]:
        pipe = r.pipeline(transaction=False)
        gens.publish(pipe, job.response_id, fence, entry, at, check_cancel=True)
        return generations.cancel_checked(pipelines.execute(r, pipe)[0])

    assert publish(TokensEntry([11], start=0), 0) == (generations.APPENDED, False)
    r.set(keys.cancel(job.response_id), "1", ex=60)
    assert publish(TokensEntry([11], start=0), 0) == (generations.ALREADY_APPENDED, True)
    assert publish(TokensEntry([13], start=2), 2) == (generations.OUT_OF_ORDER, True)
    assert gens.release_lost(job.response_id, fence, int(time.time() * 1000)) is not None
    assert publish(TokensEntry([12], start=1), 1) == (generations.FENCED_OFF, True)
    r.delete(keys.cancel(job.response_id))


def interval_publisher(r: redis.Redis, interval_s: float) -> tuple[FakeEngine, TokenPublisher, GenerationJob]:
    """A publisher with a stream interval, its one request admitted (and its start entry out)."""
    engine = FakeEngine()
    gens = Generations(r, TTL_S)
    publisher = TokenPublisher(
        r, cast(Engine, engine), gens, dispatch=lambda _: None, stream_interval_s=interval_s
    )
    job = staged_job(r, max_output_tokens=16)
    fence, plan = claim_and_plan(gens, job)
    publisher.start_request(job.response_id, fence, plan)
    return engine, publisher, job


def decoding(job: GenerationJob, tokens: list[int]) -> GenerationOutput:
    return GenerationOutput(job.response_id, generated_tokens=tokens, status=RequestStatus.DECODING)


def decoding_request(request_id: str, tokens: list[int]) -> GenerationOutput:
    return GenerationOutput(request_id, generated_tokens=tokens, status=RequestStatus.DECODING)


def finished(job: GenerationJob, tokens: list[int]) -> GenerationOutput:
    return GenerationOutput(job.response_id, generated_tokens=tokens, status=RequestStatus.FINISHED)


def test_a_stream_interval_sends_the_first_token_at_once_then_one_chunk_per_interval(r: redis.Redis) -> None:
    engine, publisher, job = interval_publisher(r, interval_s=0.3)
    engine.outputs.append(decoding(job, [11]))
    publisher.step(0)
    # The first token is never held: time to first token is the engine's.
    assert stream(r, job.response_id) == [StartEntry(3), TokensEntry([11], start=0)]
    for step in range(2, 5):  # three more engine steps well within the interval: nothing goes out
        engine.outputs.append(decoding(job, list(range(11, 11 + step))))
        publisher.step(0)
    assert stream(r, job.response_id) == [StartEntry(3), TokensEntry([11], start=0)]
    # Once the interval has passed, the held tokens go out as one chunk, without a new engine step.
    deadline = time.monotonic() + 5
    while len(stream(r, job.response_id)) < 3 and time.monotonic() < deadline:
        publisher.step(0.05)
    assert stream(r, job.response_id)[2:] == [TokensEntry([12, 13, 14], start=1)]


def test_a_stream_interval_never_holds_the_end(r: redis.Redis) -> None:
    engine, publisher, job = interval_publisher(r, interval_s=30)
    engine.outputs.append(decoding(job, [11]))
    publisher.step(0)
    engine.outputs.append(decoding(job, [11, 12]))
    publisher.step(0)
    engine.outputs.append(finished(job, [11, 12, 13, EOS]))
    publisher.step(0)
    assert stream(r, job.response_id) == [
        StartEntry(3),
        TokensEntry([11], start=0),
        TokensEntry([12, 13, EOS], start=1),
        FinishEntry("stop", 3, 4),
    ]
    assert engine.released == 1 and publisher.active_count == 0


def test_a_stream_interval_checks_cancellations_once_per_interval_and_drops_held_tokens(
    r: redis.Redis,
) -> None:
    engine, publisher, job = interval_publisher(r, interval_s=0.3)
    engine.outputs.append(decoding(job, [11]))
    publisher.step(0)
    r.set(keys.cancel(job.response_id), "1", ex=60)
    engine.outputs.append(decoding(job, [11, 12]))
    publisher.step(0)  # within the interval: neither the token nor the flag is looked at yet
    assert engine.cancelled == []
    deadline = time.monotonic() + 5
    while not engine.cancelled and time.monotonic() < deadline:
        publisher.step(0.05)
    assert engine.cancelled == [job.response_id]
    entries = stream(r, job.response_id)
    # The held token went out with the round that saw the flag, or not at all: either way the
    # finish entry counts exactly the tokens in the stream.
    tokens = sum(len(entry.token_ids) for entry in entries if isinstance(entry, TokensEntry))
    assert isinstance(entries[-1], FinishEntry) and entries[-1].finish_reason == "cancelled"
    assert entries[-1].output_tokens == tokens
    r.delete(keys.cancel(job.response_id))


def test_with_requests_in_the_engine_the_wait_for_output_ends_when_the_round_is_due(r: redis.Redis) -> None:
    """The engine wakes the publisher only for first tokens and ends (gpu_worker.output_mailbox):
    the other tokens wait there unseen, so the publisher's own wait must end at the round."""
    engine, publisher, job = interval_publisher(r, interval_s=0.3)
    engine.outputs.append(decoding(job, [11]))
    sent_at = time.monotonic()
    publisher.step(0)  # the first token goes out at once, and starts the round clock
    publisher.step(10)
    assert 0 < engine.waits[-1] <= 0.3
    # Until that round, only first tokens and ends may cut the engine's wait short.
    assert sent_at < engine.quiet_until[-1] <= time.monotonic() + 0.3
    engine.outputs.append(finished(job, [11, 12, EOS]))
    publisher.step(0)
    assert publisher.active_count == 0
    publisher.step(10)  # nothing in the engine: the caller's wait stands
    assert engine.waits[-1] == 10
    engine, publisher, job = interval_publisher(r, interval_s=0)
    engine.outputs.append(decoding(job, [11]))
    publisher.step(0)
    publisher.step(10)  # no interval: every output goes out with its step, and wakes the publisher
    assert engine.waits[-1] == 10 and engine.quiet_until[-1] == 0


def test_the_held_tokens_of_every_request_go_out_in_the_same_round(r: redis.Redis) -> None:
    """One round clock for all requests: a request whose first token came later than another's
    does not get a round of its own, so downstream hops read and write the round's chunks together."""
    engine, publisher, first = interval_publisher(r, interval_s=0.3)
    engine.outputs.append(decoding(first, [11]))
    publisher.step(0)
    time.sleep(0.1)
    gens = Generations(r, TTL_S)
    second = staged_job(r, max_output_tokens=16)
    fence, plan = claim_and_plan(gens, second)
    publisher.start_request(second.response_id, fence, plan)
    engine.outputs.append(decoding(second, [21]))
    publisher.step(0)  # its first token goes out at once
    assert stream(r, second.response_id)[-1] == TokensEntry([21], start=0)
    engine.outputs += [decoding(first, [11, 12, 13]), decoding(second, [21, 22])]
    publisher.step(0)  # within the interval: both held
    deadline = time.monotonic() + 5
    while len(stream(r, first.response_id)) < 3 and time.monotonic() < deadline:
        publisher.step(0.01)
    # The step that sent the first request's chunk sent the second's (whose own interval since its
    # first token had not passed yet).
    assert stream(r, first.response_id)[2:] == [TokensEntry([12, 13], start=1)]
    assert stream(r, second.response_id)[2:] == [TokensEntry([22], start=1)]


def test_the_affinity_record_rides_on_the_requests_first_round_behind_the_other_requests_checks(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing stands between the claim and the engine: the worker becomes the affinity of the
    job's keys in the round that publishes its first tokens, and the replies of the round's
    cancel checks (another request's, silent and cancelled) are still read in their places."""
    engine, gens, publisher, silent, _, silent_id = admitted(r)
    engine.outputs.append(decoding_request(silent_id, [11]))
    publisher.step(0)
    job = staged_job(r)
    fence, plan = claim_and_plan(gens, job)
    affinity_keys = [f"resq-test:affinity:{uuid.uuid4().hex}" for _ in range(2)]
    publisher.start_request(job.response_id, fence, plan, affinity_keys=affinity_keys)
    assert r.exists(*affinity_keys) == 0
    r.set(keys.cancel(silent.response_id), "1", ex=60)
    monkeypatch.setattr(r, "pipeline", lambda transaction=False: new_pipeline(r))
    engine.outputs.append(decoding(job, [21]))
    publisher.step(0)
    assert [r.get(key) for key in affinity_keys] == [b"gpu-test", b"gpu-test"]
    assert r.ttl(affinity_keys[0]) > 0
    assert stream(r, job.response_id) == [StartEntry(3), TokensEntry([21], start=0)]
    assert engine.cancelled == [silent_id]
    # Recorded once: the next round does not set it again.
    r.delete(*affinity_keys)
    engine.outputs.append(decoding(job, [21, 22]))
    publisher.step(0)
    assert r.exists(*affinity_keys) == 0
    r.delete(keys.cancel(silent.response_id))


def test_a_round_of_several_requests_goes_out_as_one_transaction(private_redis: PrivateRedis) -> None:
    """Redis wakes a blocked reader once per execution unit: a round sent as one ``MULTI``/``EXEC``
    wakes the post-process hub waiting on all its streams once (and from Redis 7.2 on, the hub's
    ``XREAD``, run again then, returns every stream of the round), where a plain pipeline woke it
    at its first append and left the rest to more reads (docs/benchmarks.md). The round's appends
    of every request are one script call in it (PUBLISH_ROUND_LUA), not an EVALSHA per append."""
    r = private_redis.client()
    engine, publisher, first = interval_publisher(r, interval_s=0.0)
    engine.outputs.append(decoding(first, [11]))
    publisher.step(0)  # a round of its own, which also loads the scripts on this fresh Redis
    gens = Generations(r, TTL_S)
    second = staged_job(r, max_output_tokens=16)
    fence, plan = claim_and_plan(gens, second)
    publisher.start_request(second.response_id, fence, plan)
    engine.outputs += [decoding(first, [11, 12]), decoding(second, [21])]
    r.config_resetstat()
    publisher.step(0)  # the first's next token, the second's start entry and first token
    calls = {name: stats["calls"] for name, stats in r.info("commandstats").items()}
    assert stream(r, first.response_id)[-1] == TokensEntry([12], start=1)
    assert stream(r, second.response_id)[-2:] == [StartEntry(3), TokensEntry([21], start=0)]
    assert calls.get("cmdstat_multi") == 1
    assert calls.get("cmdstat_exec") == 1
    assert calls.get("cmdstat_evalsha") == 1  # three appends, one call
    r.close()


def test_the_prompt_tokens_the_engine_reused_are_counted_as_requests_end(r: redis.Redis) -> None:
    """``resq_cached_prompt_tokens_total`` adds each ending request's ``cached_tokens``: with
    ``resq_prompt_tokens_total``, the prefix cache's hit rate."""

    class Reusing(FakeEngine):
        def cached_tokens(self, request_id: str) -> int:
            return 2

    engine = Reusing()
    gens, publisher = new_publisher(r, engine)
    job = staged_job(r)
    fence, plan = claim_and_plan(gens, job)
    publisher.start_request(job.response_id, fence, plan)
    before = REGISTRY.get_sample_value("resq_cached_prompt_tokens_total") or 0.0
    engine.outputs.append(decoding(job, [11]))
    publisher.step(0)
    assert (REGISTRY.get_sample_value("resq_cached_prompt_tokens_total") or 0.0) == before  # not ended
    engine.outputs.append(finished(job, [11, EOS]))
    publisher.step(0)
    assert stream(r, job.response_id)[-1] == FinishEntry("stop", 3, 2, cached_tokens=2)
    assert REGISTRY.get_sample_value("resq_cached_prompt_tokens_total") == before + 2


def test_a_worker_stopping_while_redis_is_down_leaves_the_rest_to_the_reaper_at_once(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each hand-back to an unreachable Redis spends the client's retries (seconds): a worker that
    held many requests outlasted its supervisor's patience. The first refusal ends the hand-backs."""
    engine = FakeEngine()
    gens, publisher = new_publisher(r, engine)
    jobs = [staged_job(r) for _ in range(4)]
    for job in jobs:
        fence, plan = claim_and_plan(gens, job)
        publisher.start_request(job.response_id, fence, plan)
    handed_back = gens.hand_back
    tried: list[str] = []

    def hand_back_until_redis_goes(response_id: str, fence: Fence, now_ms: int) -> bool:
        tried.append(response_id)
        if len(tried) > 1:
            raise redis.exceptions.ConnectionError(
                "Error 111 connecting to 127.0.0.1:6379. Connection refused."
            )
        return handed_back(response_id, fence, now_ms)

    monkeypatch.setattr(gens, "hand_back", hand_back_until_redis_goes)
    dispatched: list[str] = []
    publisher.hand_back_remaining(dispatched.append)
    assert len(tried) == 2, "kept trying a Redis that had refused"
    assert dispatched == tried[:1]
    assert publisher.active_count == 0
