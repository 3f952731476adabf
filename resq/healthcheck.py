"""``resq healthcheck ROLE``: whether the role running in this container works (for Docker's HEALTHCHECK).

- ``api``: ``/health`` answers and the API reaches Redis. A missing worker does not
  make the API unhealthy (restarting it would not help); ``/health`` itself, 200
  only when everything answers, is what a load balancer should probe.
- ``gpu-worker`` / ``postprocess-worker``: a worker of this host (container) has a
  fresh heartbeat in Redis. A GPU worker beats only once its model is loaded and
  its engine runs, and stops when the engine dies.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from redis import Redis
from redis.exceptions import RedisError

from resq import jsonutil, keys
from resq.embedded_redis import masked_url
from resq.redis_types import scored_members
from resq.settings import Settings

ROLES = ("api", "gpu-worker", "postprocess-worker")
TIMEOUT_S = 3.0

_HEARTBEATS = {
    "gpu-worker": ("gpu", keys.GPU_WORKERS),
    "postprocess-worker": ("postprocess", keys.POSTPROCESS_WORKERS),
}
_ANY_INTERFACE = {"0.0.0.0", "::", ""}


@dataclass(frozen=True)
class Health:
    """The verdict and what it is based on."""

    healthy: bool
    detail: str


def check(role: str, settings: Settings, hostname: str | None = None) -> Health:
    """The health of ``role`` as run on ``hostname`` (default: this host)."""
    if role == "api":
        return check_api(settings)
    heartbeat_role, members_key = _HEARTBEATS[role]
    return check_worker(settings, heartbeat_role, members_key, hostname or socket.gethostname())


def check_api(settings: Settings) -> Health:
    """The API on this host answers ``/health`` and reports Redis reachable."""
    host = "127.0.0.1" if settings.host in _ANY_INTERFACE else settings.host
    url = f"http://{host}:{settings.port}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            body = reply.read()
    except urllib.error.HTTPError as error:  # 503 still carries the report
        body = error.read()
    except (urllib.error.URLError, OSError) as exc:
        return Health(False, f"{url} does not answer: {exc}")
    try:
        report = jsonutil.loads(body)
    except ValueError:
        return Health(False, f"{url} answered something else than JSON: {body[:200]!r}")
    return Health(report.get("redis") == "ok", f"{url}: {body.decode(errors='replace')}")


def check_worker(settings: Settings, heartbeat_role: str, members_key: str, hostname: str) -> Health:
    """A ``heartbeat_role`` worker of ``hostname`` beat less than ``RESQ_WORKER_TTL_S`` ago."""
    prefix = f"{heartbeat_role}@{hostname}:"
    client = Redis.from_url(settings.redis_url, socket_connect_timeout=TIMEOUT_S, socket_timeout=TIMEOUT_S)
    try:
        beats = scored_members(client.zrange(members_key, 0, -1, withscores=True))
    except (RedisError, OSError) as exc:
        return Health(False, f"Redis at {masked_url(settings.redis_url)} does not answer: {exc}")
    finally:
        client.close()
    now = time.time()
    ages = [now - score for member, score in beats if member.decode().startswith(prefix)]
    if not ages:
        return Health(False, f"no {heartbeat_role} worker of host {hostname} has a heartbeat in Redis")
    youngest = min(ages)
    if youngest >= settings.worker_ttl_s:
        return Health(False, f"the last heartbeat of {prefix}* is {youngest:.1f}s old")
    return Health(True, f"{prefix}* beat {youngest:.1f}s ago")
