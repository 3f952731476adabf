"""Post-processing inside the API process (``RESQ_POSTPROCESS_WORKERS=0``).

The same runner the post-process workers use, on a pool of threads, like
TensorRT-LLM's ``num_postprocess_workers=0``: no extra processes, at the cost
of the API's own CPU.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from resq.catalog import ModelCatalog
from resq.postprocess.observed import postprocess_response
from resq.redis_client import sync_redis
from resq.settings import Settings

log = logging.getLogger(__name__)


class InlinePostprocessor:
    """Runs post-processing of responses on the API's own threads."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._redis = sync_redis(settings.redis_url)
        self._catalog = ModelCatalog(self._redis)
        self._pool = ThreadPoolExecutor(
            max_workers=settings.postprocess_concurrency, thread_name_prefix="inline-postprocess"
        )

    def submit(self, response_id: str) -> Future[str]:
        """Start post-processing ``response_id`` in the background."""
        future = self._pool.submit(
            postprocess_response, self._redis, self._catalog, self._settings, response_id
        )
        future.add_done_callback(self._report)
        return future

    @staticmethod
    def _report(future: Future[str]) -> None:
        error = future.exception()
        if error is not None:
            log.error("inline post-processing failed", exc_info=error)

    def close(self) -> None:
        """Stop taking work; running post-processors finish their response."""
        self._pool.shutdown(wait=False, cancel_futures=False)
        self._redis.close()
