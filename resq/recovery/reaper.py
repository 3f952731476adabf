"""The reaper: a background thread in every resq process that finds lost work.

Each pass does two things:

- **generations** (one process per pass, by a short Redis lock): a job whose GPU
  worker stopped beating is released (which fences the dead worker off) and
  dispatched again, so another GPU worker resumes it; a job that nobody owns and
  whose Celery message is not in the ``generate`` queue after
  ``RESQ_DISPATCH_TIMEOUT_S`` is dispatched again; a job that no live GPU worker
  could take for ``RESQ_GPU_LOST_TIMEOUT_S`` ends with a ``finish`` entry
  ``error``, which its post-processor turns into ``response.failed``.
- **post-processing** (every process able to post-process): responses whose
  post-process lease lapsed are taken over (see :mod:`resq.recovery.leases`).

Liveness verdicts need a Redis that has answered for a while: right after a
Redis outage every heartbeat looks old, so the reaper waits ``RESQ_WORKER_TTL_S``
of uninterrupted contact before it declares any GPU worker dead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Final, Literal

from redis import Redis

from resq import keys
from resq.heartbeat import alive_workers
from resq.recovery.dispatch import queued_generations
from resq.recovery.generations import (
    PENDING,
    SNAPSHOT_FIELDS,
    Fence,
    Generations,
    Snapshot,
    parse_snapshot,
)
from resq.redis_types import scored_members
from resq.settings import Settings
from resq.wire import FinishEntry, GenerationJob

log = logging.getLogger(__name__)

GENERATIONS_PER_PASS: Final = 2000
"""Most generations one pass inspects (the oldest first); the rest wait for the next pass."""

ORPHAN_GRACE_S: Final = 60.0
"""How long a listed generation may lack its hash (it is being created) before the entry is dropped."""


class Reaper:
    """Runs reaper passes every ``RESQ_REAPER_INTERVAL_S`` on a daemon thread."""

    def __init__(
        self,
        redis: Redis,
        settings: Settings,
        holder_id: str,
        send_generation: Callable[[str, str], None],
        take_over_postprocessing: Callable[[], None] | None = None,
    ) -> None:
        self._redis = redis
        self._settings = settings
        self._holder_id = holder_id
        self._send_generation = send_generation
        self._take_over_postprocessing = take_over_postprocessing
        self._generations = Generations(redis, settings.transient_ttl_s)
        self._contact_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reaper", daemon=True)

    def start(self) -> None:
        """Start passing."""
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current pass."""
        self._stop.set()

    def run_pass(self, now: float | None = None) -> None:
        """One pass (the thread calls this; tests may too)."""
        now = time.time() if now is None else now
        if self._contact_since is None:
            self._contact_since = now
        if self._my_turn():
            self.reap_generations(now)
        if self._take_over_postprocessing is not None:
            self._take_over_postprocessing()

    def _run(self) -> None:
        while not self._stop.wait(self._settings.reaper_interval_s):
            try:
                self.run_pass()
            except Exception:  # Redis may be restarting: try again next time
                self._contact_since = None
                log.warning("reaper pass failed; retrying", exc_info=True)

    def _my_turn(self) -> bool:
        lock_ms = max(1, int(self._settings.reaper_interval_s * 900))
        return bool(self._redis.set(keys.REAPER_LOCK, self._holder_id, nx=True, px=lock_ms))

    def _liveness_trusted(self, now: float) -> bool:
        return self._contact_since is not None and now - self._contact_since >= self._settings.worker_ttl_s

    # --- generations ---------------------------------------------------------------------------

    def reap_generations(self, now: float) -> None:
        """Release, dispatch again or fail the generations that lost their GPU worker or message."""
        settings = self._settings
        beats = scored_members(self._redis.zrange(keys.GPU_WORKERS, 0, -1, withscores=True))
        alive = set(alive_workers(beats, now, settings.worker_ttl_s))
        last_beat = max((score for _, score in beats), default=0.0)
        trusted = self._liveness_trusted(now)
        listed = scored_members(
            self._redis.zrange(keys.GENERATIONS, 0, GENERATIONS_PER_PASS - 1, withscores=True)
        )
        if not listed:
            return
        pipe = self._redis.pipeline(transaction=False)
        for member, _ in listed:
            response_id = member.decode()
            pipe.hmget(keys.generation(response_id), list(SNAPSHOT_FIELDS))
            pipe.exists(keys.cancel(response_id))
        replies = pipe.execute()
        queued: set[str] | None = None
        for index, (member, accepted_at) in enumerate(listed):
            response_id = member.decode()
            snapshot = parse_snapshot(replies[2 * index])
            cancelled = bool(replies[2 * index + 1])
            if snapshot.state is None:
                if now - accepted_at > ORPHAN_GRACE_S:
                    self._generations.forget(response_id)
                continue
            if snapshot.state != PENDING:
                self._generations.forget(response_id)
                continue
            if snapshot.owner:
                if trusted and snapshot.owner not in alive:
                    self._release(response_id, snapshot, now)
                elif self._stalled(snapshot, now):
                    stalled_s = now - (snapshot.progressed_at_ms or 0) / 1000
                    log.error(
                        "GPU worker %s made no progress on %s for %.0fs though it is alive; releasing it",
                        snapshot.owner,
                        response_id,
                        stalled_s,
                    )
                    self._release(response_id, snapshot, now)
                continue
            if cancelled:
                self._end(response_id, snapshot, "cancelled", None)
                continue
            unowned_since = (snapshot.unowned_since_ms or 0) / 1000
            if trusted and not alive and now - max(unowned_since, last_beat) > settings.gpu_lost_timeout_s:
                self._end(response_id, snapshot, "error", self._no_gpu_message(snapshot))
                continue
            if now - snapshot.dispatched_at_ms / 1000 > settings.dispatch_timeout_s:
                if queued is None:
                    queued = queued_generations(self._redis)
                if response_id not in queued:
                    self._dispatch_again(response_id, snapshot, now)

    def _stalled(self, snapshot: Snapshot, now: float) -> bool:
        """The watchdog: an owned job with no claim or append for ``RESQ_GPU_STALL_TIMEOUT_S``.

        Its owner beats but has lost track of it (an engine that dropped the request, a copy
        nobody publishes): released like a lost worker's, its owner is fenced off (its next
        append is refused, so it stops its copy) and another claim resumes it.
        """
        if snapshot.progressed_at_ms is None:
            return False
        return now - snapshot.progressed_at_ms / 1000 > self._settings.gpu_stall_timeout_s

    def _release(self, response_id: str, snapshot: Snapshot, now: float) -> None:
        losses = self._generations.release_lost(
            response_id, Fence(snapshot.owner, snapshot.epoch), int(now * 1000)
        )
        if losses is None:
            return
        if losses >= self._settings.gpu_max_losses:
            log.error("GPU worker %s lost %s; lost %d times, giving up", snapshot.owner, response_id, losses)
            message = f"The GPU workers generating this response were lost {losses} times; giving up."
            self._end(response_id, snapshot, "error", message)
            return
        log.warning("GPU worker %s is gone; dispatching %s again to resume it", snapshot.owner, response_id)
        self._send_generation(response_id, self._model_of(response_id, snapshot))

    def _dispatch_again(self, response_id: str, snapshot: Snapshot, now: float) -> None:
        if self._generations.mark_redispatched(response_id, snapshot.epoch, int(now * 1000)):
            log.warning(
                "generation job of %s is neither claimed nor queued; dispatching it again", response_id
            )
            self._send_generation(response_id, self._model_of(response_id, snapshot))

    def _model_of(self, response_id: str, snapshot: Snapshot) -> str:
        """The job's model (jobs staged before the field existed: read from the job itself)."""
        if snapshot.model:
            return snapshot.model
        job_json = self._redis.hget(keys.generation(response_id), "job")
        return GenerationJob.model_validate_json(job_json).model if job_json else ""

    def _no_gpu_message(self, snapshot: Snapshot) -> str:
        timeout = f"{self._settings.gpu_lost_timeout_s:g}s"
        if snapshot.epoch:
            return f"The GPU worker generating this response was lost and none resumed it within {timeout}."
        return f"No GPU worker was available to generate this response within {timeout}."

    def _end(
        self, response_id: str, snapshot: Snapshot, reason: Literal["error", "cancelled"], message: str | None
    ) -> None:
        entry = FinishEntry(reason, snapshot.prompt_tokens, snapshot.generated, message)
        if self._generations.end_unowned(response_id, snapshot.epoch, entry):
            self._generations.forget(response_id)
            if message:
                log.error("%s failed: %s", response_id, message)
            else:
                log.info("%s was cancelled while no GPU worker owned it", response_id)
