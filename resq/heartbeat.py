"""Worker liveness: each worker process beats into a sorted set in Redis.

``/health`` and ``/v1/models`` count a worker as alive while its last beat is
younger than ``RESQ_WORKER_TTL_S``; a worker that dies simply stops beating.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from redis import Redis

from resq import jsonutil, keys

log = logging.getLogger(__name__)


def new_worker_id(role: str) -> str:
    """A worker id that names its host and process."""
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


class Heartbeat:
    """A daemon thread that publishes ``worker_id`` as alive every ``interval_s``."""

    def __init__(
        self,
        redis: Redis,
        members_key: str,
        role: str,
        worker_id: str,
        interval_s: float,
        ttl_s: float,
        details: Callable[[], dict[str, Any]] | None = None,
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        self._redis = redis
        self._members_key = members_key
        self._info_key = keys.worker_info(role, worker_id)
        self._worker_id = worker_id
        self._interval_s = interval_s
        self._ttl_s = ttl_s
        self._details = details or dict
        self._on_beat = on_beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{role}", daemon=True)

    def start(self) -> None:
        """Beat once now (so the worker is visible at once), then in the background."""
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and withdraw the worker."""
        self._stop.set()
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.zrem(self._members_key, self._worker_id)
            pipe.delete(self._info_key)
            pipe.execute()
        except Exception:  # best effort on the way out: Redis may be gone already
            log.debug("could not withdraw %s", self._worker_id, exc_info=True)

    def beat(self) -> None:
        """Publish one beat."""
        now = time.time()
        pipe = self._redis.pipeline(transaction=False)
        pipe.zadd(self._members_key, {self._worker_id: now})
        # Forget members that stopped beating long ago, so the set stays small.
        pipe.zremrangebyscore(self._members_key, "-inf", now - 10 * self._ttl_s)
        pipe.set(self._info_key, jsonutil.dumps(self._details()), ex=max(1, int(self._ttl_s)))
        pipe.execute()
        if self._on_beat is not None:
            self._on_beat()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.beat()
            except Exception:  # Redis may be restarting: keep beating
                log.warning("heartbeat of %s failed; retrying", self._worker_id, exc_info=True)


def alive_workers(redis_members: list[tuple[bytes, float]], now: float, ttl_s: float) -> list[str]:
    """Ids of the members whose last beat is younger than ``ttl_s``."""
    return [member.decode() for member, score in redis_members if now - score < ttl_s]
