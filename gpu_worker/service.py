"""Admission of generation jobs into the engine: claim, resume, wait for room, add."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis import Redis

from gpu_worker import metrics
from gpu_worker.engine import Engine, EngineStoppedError, engine_request_id
from gpu_worker.publisher import TokenPublisher
from resq import faults, keys
from resq.recovery.generations import Fence, Generations, Resumption, plan_resume
from resq.wire import FinishEntry

log = logging.getLogger(__name__)

SLOT_POLL_S = 0.25
"""While the engine is full, how often a waiting job re-checks whether it was cancelled."""


class GenerationService:
    """Takes a job from the queue into the engine once the engine has room for it."""

    def __init__(
        self,
        redis: Redis,
        engine: Engine,
        publisher: TokenPublisher,
        generations: Generations,
        worker_id: str,
        dispatch: Callable[[str], None],
        model: str | None = None,
    ) -> None:
        """``model``: the served name of this worker's model; a job that names another fails."""
        self._redis = redis
        self._model = model
        self._engine = engine
        self._publisher = publisher
        self._generations = generations
        self._worker_id = worker_id
        self._dispatch = dispatch
        self.stopping = threading.Event()
        """Set when the worker begins to shut down: a job waiting for room is handed back."""

    def submit(self, response_id: str) -> None:
        """Claim the job of ``response_id`` and admit it, blocking while the engine is full.

        A job that already produced tokens (its previous GPU worker was lost) resumes:
        the prompt plus the tokens already published become the new prompt, and the
        engine generates what remains of the budget. Blocking keeps the next message
        in the broker's hands rather than this worker's, so an idle GPU worker
        elsewhere takes it.
        """
        if self.stopping.is_set():
            # Taken from the queue after shutdown began (Celery's consumer stops a poll late):
            # passed on unclaimed, so the job's next claim is another worker's.
            log.info("shutting down: passing %s on unclaimed", response_id)
            self._dispatch(response_id)
            return
        # Room in the engine now: the slot is taken before the claim, and the claim appends the
        # start entry in its own round trip, so the post-processor opens the response while the
        # engine computes the first token. A job that must wait for room gets its start entry
        # from the publisher once the engine takes it: "started" means what the engine did.
        holding = self._engine.acquire_slot(0)
        try:
            holding = self._claim_and_admit(response_id, holding)
        finally:
            if holding:
                self._engine.release_slot()

    def _claim_and_admit(self, response_id: str, holding: bool) -> bool:
        """Claim, plan and admit ``response_id``; whether a slot is still held that no request took."""
        claim = self._generations.claim(response_id, self._worker_id, publish_start=holding)
        if claim.outcome == "unreadable" and claim.fence is not None:
            message = f"This GPU worker cannot read the job ({claim.error}): is it of an older release?"
            log.error("not generating %s: %s", response_id, message)
            generated = len(self._generations.progress_after(response_id, claim).token_ids)
            self._publisher.finish_unstarted(
                response_id, claim.fence, FinishEntry("error", 0, generated, message)
            )
            return holding
        if claim.fence is None or claim.job is None:
            log.info("not generating %s: %s", response_id, claim.outcome)
            if claim.outcome != "owned":
                self._generations.forget(response_id)
            return holding
        fence = claim.fence
        faults.reached("gpu.after_claim")
        end_tokens = frozenset(self._engine.end_tokens(claim.job))
        plan = plan_resume(claim.job, self._generations.progress_after(response_id, claim), end_tokens)
        if isinstance(plan, FinishEntry):
            # The lost worker had generated everything; only its finish entry was missing.
            self._publisher.finish_unstarted(response_id, fence, plan)
            return holding
        if self._model is not None and claim.job.model != self._model:
            # The API rendered the prompt with another model's tokenizer and template: generating
            # it here would serve the wrong model. (resq serves one model per deployment; a
            # restart with another model under one Redis is the way this happens.)
            message = f"The job is for model {claim.job.model!r}; this GPU worker serves {self._model!r}."
            log.error("not generating %s: %s", response_id, message)
            entry = FinishEntry("error", plan.prompt_tokens, plan.already_generated, message)
            self._publisher.finish_unstarted(response_id, fence, entry)
            return holding
        if plan.already_generated:
            log.info(
                "resuming %s after %d tokens (claim %d)", response_id, plan.already_generated, fence.epoch
            )
        if claim.cancelled:
            self._finish_cancelled(response_id, fence, plan)
            return holding
        # A slot taken before the claim leaves the claim's look at the cancel flag current (a
        # cancel from here on reaches the publisher's check of its first round); after a wait,
        # look again.
        waited = False
        while not holding:
            holding = self._engine.acquire_slot(SLOT_POLL_S)
            if holding:
                break
            waited = True
            if self._cancelled(response_id):
                self._finish_cancelled(response_id, fence, plan)
                return holding
            if self.stopping.is_set():
                # Shutting down with a full engine: another GPU worker (or this one, restarted) takes it.
                if self._generations.hand_back(response_id, fence, int(time.time() * 1000)):
                    self._dispatch(response_id)
                return holding
        if waited and self._cancelled(response_id):
            self._finish_cancelled(response_id, fence, plan)
            return holding
        if self.stopping.is_set():
            # Shutdown began while this job waited for its slot: not admitted here either.
            if self._generations.hand_back(response_id, fence, int(time.time() * 1000)):
                self._dispatch(response_id)
            return holding
        self._admit(response_id, fence, plan)
        return False

    def _cancelled(self, response_id: str) -> bool:
        return bool(self._redis.exists(keys.cancel(response_id)))

    def _finish_cancelled(self, response_id: str, fence: Fence, plan: Resumption) -> None:
        entry = FinishEntry("cancelled", plan.prompt_tokens, plan.already_generated)
        self._publisher.finish_unstarted(response_id, fence, entry)

    def _admit(self, response_id: str, fence: Fence, plan: Resumption) -> None:
        job = plan.job
        request_id = engine_request_id(response_id, fence.epoch)
        self._publisher.start_request(
            response_id,
            fence,
            plan,
            job.stop_token_ids,
            job.logprobs and self._engine.logprobs,
            request_id,
            # The next turn of this prefix comes here while this worker's cache holds it.
            affinity_keys=job.affinity_keys,
            prefill_only=job.prefill_only,
            top_logprobs=job.logprobs and job.top_logprobs > 0,
        )
        metrics.PROMPT_TOKENS.inc(len(job.prompt_token_ids) if not plan.already_generated else 0)
        log.info(
            "generation started: %d prompt tokens, at most %d new",
            len(job.prompt_token_ids),
            job.max_output_tokens,
        )
        try:
            self._engine.add(plan.job, plan.job.prompt_token_ids[plan.prompt_tokens :], request_id)
        except EngineStoppedError:
            # The engine died (this worker is about to stop): the job is not at fault, another GPU
            # worker takes it, from the tokens already published.
            log.warning("engine stopped; handing %s back", response_id)
            self._publisher.forget(response_id)
            self._engine.release_slot()
            if self._generations.hand_back(response_id, fence, int(time.time() * 1000)):
                self._dispatch(response_id)
        except (ValueError, TypeError) as exc:
            log.error("engine refused %s: %s", response_id, exc)
            self._publisher.forget(response_id)
            self._engine.release_slot()
            entry = FinishEntry("error", plan.prompt_tokens, plan.already_generated, str(exc))
            self._publisher.finish_unstarted(response_id, fence, entry)
