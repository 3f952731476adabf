"""Admission of generation jobs into the engine."""

from __future__ import annotations

import logging

from redis import Redis

from gpu_worker import metrics
from gpu_worker.engine import Engine, EngineStoppedError
from gpu_worker.publisher import TokenPublisher
from resq import keys
from resq.wire import GenerationJob

log = logging.getLogger(__name__)

SLOT_POLL_S = 0.25
"""While the engine is full, how often a waiting job re-checks whether it was cancelled."""


class GenerationService:
    """Takes a job from the queue into the engine once the engine has room for it."""

    def __init__(self, redis: Redis, engine: Engine, publisher: TokenPublisher) -> None:
        self._redis = redis
        self._engine = engine
        self._publisher = publisher

    def submit(self, job: GenerationJob) -> None:
        """Admit ``job``, blocking while the engine is full.

        Blocking keeps the job's message in the broker's hands rather than this
        worker's, so an idle GPU worker elsewhere takes the next one.
        """
        prompt_tokens = len(job.prompt_token_ids)
        while not self._engine.acquire_slot(SLOT_POLL_S):
            if self._redis.exists(keys.cancel(job.response_id)):
                self._publisher.finish_unstarted(job.response_id, prompt_tokens, "cancelled", None)
                return
        if self._redis.exists(keys.cancel(job.response_id)):
            self._engine.release_slot()
            self._publisher.finish_unstarted(job.response_id, prompt_tokens, "cancelled", None)
            return
        self._publisher.start_request(
            job.response_id, prompt_tokens, job.stop_token_ids, job.logprobs and self._engine.logprobs
        )
        metrics.PROMPT_TOKENS.inc(prompt_tokens)
        log.info("generation started: %d prompt tokens, at most %d new", prompt_tokens, job.max_output_tokens)
        try:
            self._engine.add(job)
        except (EngineStoppedError, ValueError, TypeError) as exc:
            log.error("engine refused %s: %s", job.response_id, exc)
            self._publisher.forget(job.response_id)
            self._engine.release_slot()
            self._publisher.finish_unstarted(job.response_id, prompt_tokens, "error", str(exc))
