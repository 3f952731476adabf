"""Post-processing one response with its log context and metrics: what workers and the inline API call."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from redis import Redis

from resq.catalog import ModelCatalog
from resq.logs import response_context
from resq.postprocess import metrics
from resq.postprocess.runner import AlongTheEnd, run_postprocess
from resq.postprocess.token_hub import TokenSource
from resq.settings import Settings

log = logging.getLogger(__name__)

CRASHED = "crashed"
"""Status label of a post-processor that raised (its response is left to recovery)."""


def postprocess_response(
    redis: Redis,
    catalog: ModelCatalog,
    settings: Settings,
    response_id: str,
    keep_going: Callable[[], bool] | None = None,
    tokens: TokenSource | None = None,
    opening: list[Any] | None = None,
    along: AlongTheEnd | None = None,
) -> str:
    """:func:`run_postprocess` for ``response_id``, every log line tagged with it, and counted."""
    with response_context(response_id), metrics.ACTIVE.track_inprogress():
        try:
            status = run_postprocess(
                redis, catalog, settings, response_id, keep_going, tokens, opening, along
            )
        except BaseException:
            metrics.RESPONSES.labels(CRASHED).inc()
            raise
        metrics.RESPONSES.labels(status).inc()
        log.info("post-processing ended: %s", status)
        return status
