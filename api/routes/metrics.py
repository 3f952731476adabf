"""``GET /metrics``: this API process's Prometheus metrics, with queue depths read from Redis."""

from __future__ import annotations

import logging
import time

import anyio
from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from redis.exceptions import RedisError
from starlette.responses import Response

from api import metrics
from api.deps import StateDep
from api.state import AppState
from resq import keys
from resq.redis_types import texts

log = logging.getLogger(__name__)

router = APIRouter()

SCRAPE_REDIS_TIMEOUT_S = 2.0
QUEUES = (keys.POSTPROCESS_QUEUE,)
"""Queues measured besides the generation queue of each model with a card."""
WORKER_SETS = {"gpu": keys.GPU_WORKERS, "postprocess": keys.POSTPROCESS_WORKERS}


async def _refresh_from_redis(state: AppState) -> None:
    """Queue depths and live workers: two pipelined round trips, bounded in time."""
    fresh_after = f"({time.time() - state.settings.worker_ttl_s}"
    try:
        with anyio.fail_after(SCRAPE_REDIS_TIMEOUT_S):
            models = await state.redis.hkeys(keys.MODELS)
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("metrics: Redis did not answer: %s", exc)
        metrics.REDIS_UP.set(0)
        return
    queues = [*(keys.generate_queue(name) for name in sorted(texts(models))), *QUEUES]
    pipe = state.redis.pipeline(transaction=False)
    for queue in queues:
        pipe.llen(keys.celery_queue(queue))
    for members in WORKER_SETS.values():
        pipe.zcount(members, fresh_after, "+inf")
    try:
        with anyio.fail_after(SCRAPE_REDIS_TIMEOUT_S):
            replies = await pipe.execute()
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("metrics: Redis did not answer: %s", exc)
        metrics.REDIS_UP.set(0)
        return
    metrics.REDIS_UP.set(1)
    for queue, depth in zip(queues, replies, strict=False):
        metrics.QUEUE_DEPTH.labels(queue).set(depth)
    for role, alive in zip(WORKER_SETS, replies[len(queues) :], strict=True):
        metrics.WORKERS_ALIVE.labels(role).set(alive)


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(state: StateDep) -> Response:
    """The Prometheus text exposition of this process's registry."""
    await _refresh_from_redis(state)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
