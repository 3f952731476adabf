"""Post-processing under leases: what a post-process worker and the inline API both run.

Every post-processor runs while it holds the response's lease
(:mod:`resq.recovery.leases`); the reaper of this process calls
:meth:`PostprocessService.take_over_lapsed` to adopt the responses of
post-processors that died, as long as this process has room for them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from redis.client import Pipeline

from resq import keys
from resq.catalog import WARM_UP_POLL_S, WARM_UP_WAIT_S, ModelCatalog
from resq.postprocess.observed import postprocess_response
from resq.postprocess.runner import HANDED_OVER, OPENING_READS, stage_opening_reads
from resq.postprocess.token_hub import TokenSource, TokenStreamHub
from resq.recovery.leases import PostprocessLeases
from resq.redis_client import sync_redis
from resq.settings import Settings

log = logging.getLogger(__name__)

OWNED_ELSEWHERE = "owned-elsewhere"
"""What :meth:`PostprocessService.run` returns when a live post-processor already holds the response."""


class PostprocessService:
    """Runs post-processors of responses, each under its lease."""

    def __init__(self, settings: Settings, holder_id: str) -> None:
        self._settings = settings
        self._redis = sync_redis(settings.redis_url)
        self._catalog = ModelCatalog(self._redis)
        self.leases = PostprocessLeases(self._redis, holder_id, settings.postprocess_lease_s)
        # One blocking read for the token streams of every response this process holds.
        self._tokens = TokenStreamHub(self._redis)
        self._capacity = settings.postprocess_concurrency
        self._pool = ThreadPoolExecutor(max_workers=self._capacity, thread_name_prefix="postprocess")

    def start(self) -> None:
        """Start renewing leases, and building the served models' tokenizers (:meth:`warm_up`)."""
        self.leases.start()
        threading.Thread(target=self.warm_up, name="postprocess-warm-up", daemon=True).start()

    def warm_up(self, wait_s: float = WARM_UP_WAIT_S, poll_s: float = WARM_UP_POLL_S) -> list[str]:
        """Build the tokenizers of the models GPU workers serve, once one does (polled for up to
        ``wait_s``), before this worker's first response of each needs them: that response's first
        delta waited for it (5 ms on the built-in model with its Redis reads, far more for a real
        vocabulary's megabytes of ``tokenizer.json``), once in every post-process worker started.
        Best effort: a response builds what is missing. Returns the models it built them for."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                names = self._catalog.served(self._settings.worker_ttl_s)
                built = [name for name in names if self._catalog.get(name) is not None]
            except Exception as error:  # Redis away: nothing lost, the first response builds it
                log.debug("the tokenizers were not built ahead of the first response: %s", error)
                return []
            if built or time.monotonic() >= deadline:
                return built
            time.sleep(poll_s)

    def run(self, response_id: str) -> str:
        """Post-process ``response_id`` here, unless a live post-processor already does (blocking)."""
        # The token stream joins the hub first, from its start (no catch-up read); the lease, the
        # post-processor's first reads and the hub's wake-up then go in one round trip.
        source = self._tokens.open_joined(keys.tokens(response_id))
        try:

            def stage(pipe: Pipeline) -> None:
                stage_opening_reads(pipe, response_id)
                source.stage_wake(pipe)

            taken, replies = self.leases.take_along(response_id, stage)
            source.sent()
            if not taken:
                log.info("%s is post-processed elsewhere; nothing to do", response_id)
                return OWNED_ELSEWHERE
            opening = replies[:OPENING_READS] if replies is not None else None
            return self._run_held(response_id, opening, source)
        finally:
            source.close()

    def submit(self, response_id: str) -> Future[str]:
        """Post-process ``response_id`` on this process's pool (the inline API)."""
        future = self._pool.submit(self.run, response_id)
        future.add_done_callback(_report)
        return future

    def take_over_lapsed(self) -> None:
        """Adopt responses whose post-processor died, while this process has room."""
        room = self._capacity - self.leases.held_count
        if room <= 0:
            return
        for response_id in self.leases.lapsed(room):
            if self.leases.take(response_id):
                log.warning("taking over post-processing of %s (its post-processor is gone)", response_id)
                self._pool.submit(self._run_held, response_id).add_done_callback(_report)

    def _run_held(
        self, response_id: str, opening: list[Any] | None = None, tokens: TokenSource | None = None
    ) -> str:
        # The release rides on the terminal event's round trip when the response ends in one.
        along = self.leases.release_along(response_id)
        try:
            status = postprocess_response(
                self._redis,
                self._catalog,
                self._settings,
                response_id,
                keep_going=lambda: self.leases.holds(response_id),
                tokens=tokens or self._tokens,
                opening=opening,
                along=along,
            )
        except BaseException:
            # Keep the lease unreleased: it lapses, and a post-processor retries later.
            self.leases.abandon(response_id)
            raise
        if status != HANDED_OVER:
            self.leases.release(response_id, along)
        return status

    def close(self) -> None:
        """Stop renewing and taking work; running post-processors finish (or lapse, if the process ends)."""
        self.leases.stop()
        # The token hub keeps reading (a daemon thread): the running post-processors depend on it.
        self._pool.shutdown(wait=False, cancel_futures=False)


def _report(future: Future[str]) -> None:
    error = future.exception()
    if error is not None:
        log.error("post-processing failed", exc_info=error)
