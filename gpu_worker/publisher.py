"""Publishing engine output to Redis, one pipelined round trip per engine step.

A thread of its own empties the engine's output mailbox: the new tokens of every
active request go out as fenced appends (:mod:`resq.recovery.generations`) in
one pipeline, and the same round trip asks whether any active request was
cancelled (client gone, ``POST .../cancel``), so cancellation costs no extra
trip and the GPU stops spending steps within one round of the flag appearing.

A stream interval (``RESQ_STREAM_INTERVAL_MS``, like vLLM's and TensorRT-LLM's
``stream_interval``, but in time) holds new tokens for one interval, then sends
each request's as one chunk: everything downstream (the post-processor's read and
its event, the API's read and its SSE frame, Redis for each) costs per chunk, not
per token, so under load their CPU per token falls by the tokens per chunk. The
interval is one clock for every request of the worker, not one per request: a
round's chunks of all requests go out in one pipeline, so the post-process hub
reads them with one ``XREAD`` and logs their events with one pipeline, and the
API's hub relays them with one read, instead of a round per request whose own
interval happened to end. A request's first tokens and its end go out at once
(time to first token is unchanged), and the cancellation checks ride on the
same rounds. Between rounds the engine does not wake this thread for tokens that
would only be held (:mod:`gpu_worker.output_mailbox`): in one process with the
engine thread, a wake-up per step took the GIL from it twice per step.
The start entry of a request admitted after waiting for room goes out in the same
pipeline, ahead of its first tokens (within :data:`IDLE_WAIT_S` when the engine is
slower), so admission adds nothing between the Celery message and the engine; a
request claimed while the engine had room got its start entry from the claim
(:meth:`resq.recovery.generations.Generations.claim`). Pipelines are
sent with :func:`gpu_worker.pipelines.execute`: one round trip, Lua included.

An append is refused when this worker no longer holds the job's claim (the
reaper took it away while this worker looked dead): the request is cancelled in
the engine, and the worker that claimed it since carries on. When Redis does not
answer, the engine's latest outputs wait here and go out once it does: outputs
are cumulative, and appends are exactly-once, so nothing is lost or doubled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from gpu_worker import metrics, pipelines
from gpu_worker.engine import Engine, failure_code, response_of
from resq import affinity, faults, keys
from resq.logs import about
from resq.recovery.generations import (
    ALREADY_APPENDED,
    APPENDED,
    GONE,
    OUT_OF_ORDER,
    Fence,
    Generations,
    Resumption,
    cancel_checked,
)
from resq.wire import FinishEntry, FinishReason, StartEntry, TokensEntry

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
"""How long the publisher waits for engine output before re-checking cancellations (and publishing starts)."""

_START = -2
_FINISH = -1


@dataclass(eq=False)
class _Tracked:
    request_id: str
    """The engine's id of this claim's copy (:func:`gpu_worker.engine.engine_request_id`)."""
    fence: Fence
    prompt_tokens: int
    offset: int
    """Tokens a lost worker generated before this claim (a resumed request)."""
    end_tokens: frozenset[int]
    """Tokens whose appearance last means the request stopped (rather than hit its limit)."""
    logprobs: bool = False
    published: int = 0
    """Tokens of this worker's engine output already appended."""
    top_logprobs: bool = False
    """Its tokens go out with the most likely tokens at their positions (the engine's record)."""
    start_pending: bool = False
    """The start entry is still to be appended (ahead of any token)."""
    ended: bool = False
    """Its engine copy was ended here (slot released): ending it again does nothing."""
    affinity_pending: tuple[str, ...] = ()
    """Affinity keys this worker is still to be recorded for (:mod:`resq.affinity`): the record
    rides on the request's first round, instead of a round trip before the engine takes it."""
    prefill_only: bool = False
    """A prewarm (:attr:`resq.wire.GenerationJob.prefill_only`): its tokens are never published,
    and it ends ``stop`` with none."""

    @property
    def total(self) -> int:
        return self.offset + self.published


def _holds(fence: Fence, owner: bytes | None, epoch: bytes | None) -> bool:
    """Whether the generation hash still names ``fence`` as its claim (a vanished hash: it does not)."""
    return (
        owner is not None
        and owner.decode() == fence.owner
        and epoch is not None
        and int(epoch) == fence.epoch
    )


class TokenPublisher:
    """Moves tokens from the engine to the responses' token streams."""

    def __init__(
        self,
        redis: Redis,
        engine: Engine,
        generations: Generations,
        dispatch: Callable[[str], None],
        max_losses: int = 3,
        stream_interval_s: float = 0.0,
    ) -> None:
        """``max_losses`` (``RESQ_GPU_MAX_LOSSES``): a request whose engine failed, or whose GPU
        worker was lost, this many times in all ends with an error instead of resuming again.
        ``stream_interval_s`` (``RESQ_STREAM_INTERVAL_MS``): the time between two rounds of held
        tokens (0: every step's tokens go out with that step)."""
        self._redis = redis
        self._engine = engine
        self._generations = generations
        self._dispatch = dispatch
        self._max_losses = max_losses
        self._stream_interval_s = stream_interval_s
        self._round_at = 0.0
        """``time.monotonic()`` when the next round is due: every held token goes out and the
        cancellation checks are made (one clock for all requests, so their chunks travel together)."""
        self._held_until: float | None = None
        """When held tokens go out (the next round; None: nothing is held)."""
        self._tracked: dict[str, _Tracked] = {}
        self._pending: dict[str, GenerationOutput] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="token-publisher", daemon=True)
        self.fatal_error: BaseException | None = None

    # --- called from the Celery task thread ----------------------------------------------------

    def start_request(
        self,
        response_id: str,
        fence: Fence,
        plan: Resumption,
        stop_token_ids: Iterable[int] = (),
        logprobs: bool = False,
        request_id: str | None = None,
        affinity_keys: Iterable[str] = (),
        prefill_only: bool = False,
        top_logprobs: bool = False,
    ) -> None:
        """Track a request the engine is about to take as ``request_id`` (default: the response id);
        its start entry, if missing, goes out with the next step, and this worker becomes the
        affinity of ``affinity_keys`` in the same round. ``prefill_only``: publish none of its
        tokens, only its end (a prewarm). ``top_logprobs``: publish the most likely tokens at each
        position with its logprobs.

        A copy of an earlier claim of the same response still tracked here (this worker froze,
        lost the claim, and claimed the job again on waking) is stopped in the engine: its
        outputs, still queued, no longer match and are dropped.
        """
        end_tokens = self._engine.eos_token_ids | frozenset(stop_token_ids)
        tracked = _Tracked(
            request_id or response_id,
            fence,
            plan.prompt_tokens,
            plan.already_generated,
            end_tokens,
            logprobs,
            start_pending=plan.publish_start,
            affinity_pending=tuple(affinity_keys),
            prefill_only=prefill_only,
            top_logprobs=top_logprobs,
        )
        with self._lock:
            superseded = self._tracked.get(response_id)
            self._tracked[response_id] = tracked
        if superseded is not None:
            log.warning(
                "%s claimed again (epoch %d) while its copy of epoch %d was in the engine; stopping that copy",
                response_id,
                fence.epoch,
                superseded.fence.epoch,
                extra=about(response_id),
            )
            self._engine.cancel(superseded.request_id)
            self._end(response_id, superseded)

    def finish_unstarted(self, response_id: str, fence: Fence, entry: FinishEntry) -> None:
        """Publish the end of a request that never reached the engine (which also takes it off the
        reaper's list)."""
        pipe = self._redis.pipeline(transaction=False)
        self._generations.publish(pipe, response_id, fence, entry, entry.output_tokens)
        pipelines.execute(self._redis, pipe)

    def forget(self, response_id: str) -> None:
        """Stop tracking a request the engine refused (its slot is the caller's to release)."""
        with self._lock:
            tracked = self._tracked.pop(response_id, None)
        if tracked is not None:
            tracked.ended = True

    @property
    def active_count(self) -> int:
        """Requests in the engine now."""
        return len(self._tracked)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the publishing thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop publishing (the engine may stop afterwards without it counting as a failure)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def hand_back_remaining(self, dispatch: Callable[[str], None]) -> None:
        """Give every request still tracked back for another GPU worker to resume (shutting down).

        Whatever this misses the reaper re-dispatches once this worker's heartbeat has lapsed. So
        when Redis does not answer, the rest are left to it at once: each hand-back would spend
        the client's retries (seconds) on a Redis that is down, and a worker asked to stop would
        outlast its supervisor's patience by that times the requests it held.
        """
        with self._lock:
            tracked = dict(self._tracked)
            self._tracked.clear()
        now_ms = int(time.time() * 1000)
        for index, (response_id, state) in enumerate(tracked.items()):
            try:
                if self._generations.hand_back(response_id, state.fence, now_ms):
                    dispatch(response_id)
                    log.info("handed %s back after %d tokens", response_id, state.total)
            except (RedisConnectionError, RedisTimeoutError) as unreachable:
                log.warning(
                    "Redis does not answer (%s): %d requests left for the reaper to resume",
                    unreachable,
                    len(tracked) - index,
                )
                return
            except Exception:  # the reaper re-dispatches whatever this misses
                log.warning("could not hand %s back", response_id, exc_info=True)

    # --- the publishing loop -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(IDLE_WAIT_S)
                if not self._engine.is_running() and not self._stop.is_set():
                    self._release_after_engine_failure()
                    self.fatal_error = RuntimeError("engine thread died")
                    return
            except Exception as exc:  # keep publishing through Redis hiccups
                log.exception("publishing tokens failed; retrying")
                self._stop.wait(0.2)
                if self._stop.is_set():
                    self.fatal_error = exc

    def step(self, wait_s: float) -> None:
        """Publish what the engine produced (waiting up to ``wait_s`` for it) and check cancellations."""
        # Tokens that would only be held do not wake this thread before the round is due.
        quiet_until = self._round_at if self._stream_interval_s > 0 else 0.0
        outputs = self._engine.next_outputs(self._wait_for_held(wait_s), quiet_until)
        for output in outputs:  # outputs are cumulative: the last one per request says it all
            self._pending[output.request_id] = output  # by engine request id: one per claim
        self._publish()

    def _wait_for_held(self, wait_s: float) -> float:
        """``wait_s``, shortened so that held tokens go out when their interval ends.

        The engine wakes this thread only for a request's first tokens and its end
        (:mod:`gpu_worker.output_mailbox`): the other tokens of active requests wait there,
        unseen, so with requests active the wait also ends when the next round is due.
        """
        until = self._held_until
        if until is None and self._stream_interval_s > 0 and self._tracked:
            until = self._round_at
        if until is None:
            return wait_s
        return max(0.0, min(wait_s, until - time.monotonic()))

    def _due(self, tracked: _Tracked, output: GenerationOutput, round_due: bool) -> bool:
        """Whether ``tracked``'s tokens go out now (else they wait for the next round)."""
        return (
            round_due
            or output.is_finished()
            or tracked.published == 0  # the first tokens: time to first token stays the engine's
        )

    def _publish(self) -> None:
        with self._lock:
            active = dict(self._tracked)
        if not self._pending and not active:
            return
        now = time.monotonic()
        round_due = now >= self._round_at
        held: dict[str, GenerationOutput] = {}
        held_until: float | None = None
        # One transaction, not a plain pipeline: Redis wakes a blocked reader once per execution
        # unit, so a post-process hub waiting on every stream of the round wakes once for all of
        # them, and from Redis 7.2 on its XREAD, run again at that wake-up, returns the whole
        # round in one reply (docs/benchmarks.md, "a round as one transaction"). Nothing here needs its
        # atomicity: every command is safe to repeat (gpu_worker.pipelines).
        pipe = self._redis.pipeline(transaction=True)
        # Every request's append is in one script call, the pipeline's first command: one command
        # and one reply for the round, not an EVALSHA and a queued reply per request.
        publish_round = self._generations.round()
        # (response id, tokens it adds; _FINISH for a finish entry, _START for a start entry)
        appends: list[tuple[str, int]] = []
        finishing: dict[str, FinishEntry] = {}
        # A round's check of a request that appends tokens in it rides on that append (its fence
        # is the claim check, and the script reports the cancel flag): no commands of its own.
        checked_by_append: set[str] = set()
        recorded: list[_Tracked] = []  # whose affinity record goes out in this round
        for response_id, state in active.items():
            if state.affinity_pending:
                recorded.append(state)
            if state.start_pending:  # queued first: it must precede the request's tokens
                start = StartEntry(state.prompt_tokens)
                publish_round.add(response_id, state.fence, start, 0)
                appends.append((response_id, _START))
        for request_id, output in self._pending.items():
            response_id = response_of(request_id)
            tracked = active.get(response_id)
            if tracked is None or tracked.request_id != request_id:
                # Cancelled or fenced off meanwhile (its end is handled), or the output of an
                # earlier claim's copy, stopped when this claim began: never this claim's tokens.
                continue
            if not self._due(tracked, output, round_due):
                held[request_id] = output
                held_until = self._round_at
                continue
            new_tokens = [] if tracked.prefill_only else list(output.generated_tokens[tracked.published :])
            if new_tokens:
                logprobs = None
                alternatives = None
                if tracked.logprobs and len(output.logprobs) == len(output.generated_tokens):
                    logprobs = list(output.logprobs[tracked.published :])
                    if tracked.top_logprobs:
                        alternatives = self._engine.alternatives(
                            request_id, tracked.published, tracked.published + len(new_tokens)
                        )
                chunk = TokensEntry(new_tokens, logprobs, start=tracked.total, top_logprobs=alternatives)
                check = round_due and not output.is_finished()
                publish_round.add(response_id, tracked.fence, chunk, tracked.total, check_cancel=check)
                appends.append((response_id, len(new_tokens)))
                if check:
                    checked_by_append.add(response_id)
            if output.is_finished():
                finish = self._finish_entry(output, tracked)
                publish_round.add(response_id, tracked.fence, finish, finish.output_tokens)
                appends.append((response_id, _FINISH))
                finishing[response_id] = finish
        checked = (
            [rid for rid in active if rid not in finishing and rid not in checked_by_append]
            if round_due
            else []
        )
        if not appends and not checked:
            self._pending, self._held_until = held, held_until
            return
        publish_round.queue(pipe)
        for response_id in checked:
            pipe.exists(keys.cancel(response_id))
            # Still this claim's? The watchdog (or a reaper that took this worker for dead) may have
            # released it while its copy appended nothing: then the copy stops here too.
            pipe.hmget(keys.generation(response_id), ["owner", "epoch"])
        # Last, so the replies above keep their places: the next turn of these prefixes comes
        # here while this worker's cache holds them (best effort: a lost record costs a cache hit).
        for state in recorded:
            affinity.record(pipe, state.fence.owner, state.affinity_pending)
            state.affinity_pending = ()
        results = pipelines.execute(self._redis, pipe)
        if round_due:
            self._round_at = now + self._stream_interval_s
        if appends:
            faults.reached("gpu.after_publish")
        # Everything else in it is published, or belongs to no tracked request.
        self._pending, self._held_until = held, held_until
        ended: list[str] = []
        lost: set[str] = set()
        gone: set[str] = set()
        diverged: set[str] = set()
        flagged: list[str] = []
        published = 0
        replies = results[0] if appends else []
        for (response_id, count), reply in zip(appends, replies, strict=True):
            result = reply
            if count >= 0 and response_id in checked_by_append:
                result, flag = cancel_checked(reply)
                if flag:
                    flagged.append(response_id)
            if result == OUT_OF_ORDER:
                diverged.add(response_id)
            elif result == GONE:
                gone.add(response_id)
            elif result not in (APPENDED, ALREADY_APPENDED):
                lost.add(response_id)
            elif count >= 0:
                active[response_id].published += count
                published += count
            elif count == _START:
                active[response_id].start_pending = False
            else:
                ended.append(response_id)
                finish = finishing[response_id]
                metrics.CACHED_PROMPT_TOKENS.inc(finish.cached_tokens)
                log.info(
                    "generation ended: %s, %d tokens",
                    finish.finish_reason,
                    finish.output_tokens,
                    extra=about(response_id),
                )
        metrics.note_published(published)
        # Their finish entries took them off the reaper's list (Generations.publish).
        for response_id in ended:
            self._end(response_id, active[response_id])
        lost -= diverged
        if lost:
            log.warning("no longer own %s (taken over); cancelling here", ", ".join(sorted(lost)))
            self._abandon({response_id: active[response_id] for response_id in sorted(lost)})
        if diverged:
            self._restart_from_stream(sorted(diverged), active)
        checks_at = 1 if appends else 0
        checks = results[checks_at : checks_at + 2 * len(checked)]
        flags, claims = checks[::2], checks[1::2]
        unclaimed = [
            rid
            for rid, (owner, epoch) in zip(checked, claims, strict=True)
            if owner is None and epoch is None and rid not in lost and rid not in ended
        ]
        if unclaimed:
            # Rare (a response deleted in a round it appended nothing): a vanished hash, or one
            # whose claim fields are gone?
            exists = self._redis.pipeline(transaction=False)
            for response_id in unclaimed:
                exists.exists(keys.generation(response_id))
            gone |= {rid for rid, found in zip(unclaimed, exists.execute(), strict=True) if not found}
        if gone:
            # Deleted while generating (or an unstored stream dropped): nobody else will end the
            # job, so it leaves the reaper's list, and frees its admission slot, now.
            log.info("no longer own %s (deleted while generating); stopping it here", ", ".join(sorted(gone)))
            self._abandon({response_id: active[response_id] for response_id in sorted(gone)})
            for response_id in gone:
                self._generations.forget(response_id)
        lost |= gone
        released = {
            rid
            for rid, (owner, epoch) in zip(checked, claims, strict=True)
            if rid not in lost and rid not in ended and not _holds(active[rid].fence, owner, epoch)
        }
        if released:
            log.warning(
                "no longer own %s (released, or taken over); stopping it here", ", ".join(sorted(released))
            )
            self._abandon({response_id: active[response_id] for response_id in sorted(released)})
        cancelled = [
            rid
            for rid in [*flagged, *(rid for rid, flag in zip(checked, flags, strict=True) if flag)]
            if rid not in lost and rid not in ended and rid not in released
        ]
        if cancelled:
            self._cancel(cancelled)

    def _cached(self, tracked: _Tracked) -> int:
        # The engine's own figure, never more than the prompt (a resumed copy's prompt also holds
        # the tokens generated before it).
        return min(self._engine.cached_tokens(tracked.request_id), tracked.prompt_tokens)

    def _finish_entry(self, output: GenerationOutput, tracked: _Tracked) -> FinishEntry:
        generated = tracked.offset + len(output.generated_tokens)
        cached = self._cached(tracked)
        if output.status == RequestStatus.FAILED or output.error is not None:
            message = output.error or "generation failed"
            return FinishEntry(
                "error",
                tracked.prompt_tokens,
                generated,
                message,
                cached_tokens=cached,
                error_code=failure_code(output.error),
            )
        if tracked.prefill_only:  # its one token was the engine's step, not output
            return FinishEntry("stop", tracked.prompt_tokens, tracked.offset, cached_tokens=cached)
        last = output.generated_tokens[-1] if output.generated_tokens else None
        reason: FinishReason = "stop" if last in tracked.end_tokens else "length"
        return FinishEntry(reason, tracked.prompt_tokens, generated, cached_tokens=cached)

    def _end(self, response_id: str, tracked: _Tracked) -> None:
        """End ``tracked``'s engine copy here: its slot and engine state go, once. It stops being
        tracked only if it is still the response's current claim (a newer one stays)."""
        with self._lock:
            if self._tracked.get(response_id) is tracked:
                del self._tracked[response_id]
            if tracked.ended:
                return
            tracked.ended = True
        self._engine.forget(tracked.request_id)
        self._engine.release_slot()

    def _restart_from_stream(self, response_ids: list[str], active: dict[str, _Tracked]) -> None:
        # The stream holds fewer tokens than this worker appended: Redis lost its latest
        # writes (restarted without them). Resume from what the stream really holds.
        log.warning("token streams of %s lost appends; resuming them from Redis", ", ".join(response_ids))
        self._abandon({response_id: active[response_id] for response_id in response_ids})
        now_ms = int(time.time() * 1000)
        for response_id in response_ids:
            if self._generations.hand_back(response_id, active[response_id].fence, now_ms):
                self._dispatch(response_id)

    def _abandon(self, states: dict[str, _Tracked]) -> None:
        for response_id, state in states.items():
            self._engine.cancel(state.request_id)
            self._end(response_id, state)

    def _cancel(self, response_ids: list[str]) -> None:
        with self._lock:
            tracked = {rid: self._tracked[rid] for rid in response_ids if rid in self._tracked}
        pipe = self._redis.pipeline(transaction=False)
        for response_id, state in tracked.items():
            self._engine.cancel(state.request_id)
            entry = FinishEntry(
                "cancelled", state.prompt_tokens, state.total, cached_tokens=self._cached(state)
            )
            self._generations.publish(pipe, response_id, state.fence, entry, state.total)
            log.info("cancelled %s after %d tokens", response_id, state.total, extra=about(response_id))
        pipelines.execute(self._redis, pipe)  # the finish entries take them off the reaper's list
        for response_id, state in tracked.items():
            self._end(response_id, state)

    def _release_after_engine_failure(self) -> None:
        # The engine died of an exception: nothing says its requests caused it, so each resumes
        # on another GPU worker, as from a lost worker, and like that it counts as a loss (a
        # request that brings down every engine it reaches fails in the end, the others resume).
        with self._lock:
            tracked = dict(self._tracked)
        now_ms = int(time.time() * 1000)
        for response_id, state in tracked.items():
            try:
                losses = self._generations.release_lost(response_id, state.fence, now_ms)
                if losses is None:  # no longer this worker's
                    continue
                if losses < self._max_losses:
                    self._dispatch(response_id)
                    log.warning(
                        "engine failed: handed %s back after %d tokens",
                        response_id,
                        state.total,
                        extra=about(response_id),
                    )
                    continue
                message = (
                    f"The generation engine failed or was lost {losses} times on this response; giving up."
                )
                entry = FinishEntry("error", state.prompt_tokens, state.total, message)
                if self._generations.end_unowned(response_id, state.fence.epoch, entry):
                    self._generations.forget(response_id)
                log.error("engine failed: %s", message, extra=about(response_id))
            except Exception:  # still owned by this worker: the reaper releases it once the worker is gone
                log.warning("could not hand %s back", response_id, exc_info=True)
        for response_id, state in tracked.items():
            self._end(response_id, state)
