"""``GET /health``: 200 only when Redis, a GPU worker and (when configured) a post-process worker answer."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import APIRouter
from redis.exceptions import RedisError
from starlette.responses import Response

from api.deps import StateDep
from api.http import json_response
from resq import keys
from resq.heartbeat import alive_workers
from resq.redis_types import scored_members

log = logging.getLogger(__name__)

router = APIRouter()


@router.get("/health")
async def health(state: StateDep) -> Response:
    """What is up, and what is missing (503 when anything is)."""
    settings = state.settings
    report: dict[str, Any] = {"redis": "ok"}
    missing: list[str] = []
    try:
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
            members = scored_members(
                await state.redis.zrange(keys.POSTPROCESS_WORKERS, 0, -1, withscores=True)
            )
            postprocess = alive_workers(members, now, settings.worker_ttl_s)
            report["postprocess_workers"] = len(postprocess)
            if not postprocess:
                missing.append("postprocess_worker")
    except (RedisError, OSError) as exc:
        # /health is open to anyone: the exception's text names the internal host and port.
        log.warning("health check: Redis unreachable: %s", exc)
        report["redis"] = "unreachable"
        missing.append("redis")
    if missing:
        return json_response({"status": "unavailable", "missing": missing, **report}, status_code=503)
    return json_response({"status": "ok", **report})
