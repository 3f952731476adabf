"""``GET /health``: 200 only when Redis, a GPU worker and (when configured) a post-process worker answer."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
from fastapi import APIRouter
from redis.exceptions import RedisError
from starlette.responses import Response

from api.deps import StateDep
from api.http import json_response
from api.state import AppState
from resq import keys
from resq.heartbeat import alive_workers
from resq.redis_types import scored_members

log = logging.getLogger(__name__)

router = APIRouter()

HEALTH_REDIS_TIMEOUT_S = 2.0
"""The most the check waits for Redis: the client's retries took 9 s to give up on a Redis that
refused connections, past the healthchecks' own timeouts (3 s in ``resq healthcheck``, 5 s in
compose), which then reported a hang instead of "Redis unreachable"."""


@router.get("/health")
async def health(state: StateDep) -> Response:
    """What is up, and what is missing (503 when anything is)."""
    report: dict[str, Any] = {"redis": "ok"}
    missing: list[str] = []
    try:
        with anyio.fail_after(HEALTH_REDIS_TIMEOUT_S):
            await _check_workers(state, report, missing)
    except (RedisError, OSError, TimeoutError) as exc:
        # /health is open to anyone: the exception's text names the internal host and port.
        log.warning("health check: Redis unreachable: %s", exc or "no answer in time")
        report["redis"] = "unreachable"
        missing.append("redis")
    if missing:
        return json_response({"status": "unavailable", "missing": missing, **report}, status_code=503)
    return json_response({"status": "ok", **report})


async def _check_workers(state: AppState, report: dict[str, Any], missing: list[str]) -> None:
    """Ping Redis and count the live workers of each role into ``report`` (``missing`` the absent)."""
    settings = state.settings
    await state.redis.ping()
    now = time.time()
    gpu = alive_workers(
        scored_members(await state.redis.zrange(keys.GPU_WORKERS, 0, -1, withscores=True)),
        now,
        settings.worker_ttl_s,
    )
    report["gpu_workers"] = len(gpu)
    if not gpu:
        missing.append("gpu_worker")
    if settings.postprocess_workers == 0:
        report["postprocess_workers"] = "inline"
    else:
        members = scored_members(await state.redis.zrange(keys.POSTPROCESS_WORKERS, 0, -1, withscores=True))
        postprocess = alive_workers(members, now, settings.worker_ttl_s)
        report["postprocess_workers"] = len(postprocess)
        if not postprocess:
            missing.append("postprocess_worker")
