"""``resq postprocess-worker``: consume the ``postprocess`` queue with a pool of threads.

Each task owns one response from its first token to its terminal event; the
threads spend most of their time blocked on Redis, so one process serves many
responses, and several processes share the CPU work.
"""

from __future__ import annotations

import logging
import os
import socket

from celery import Celery

from resq import keys
from resq.catalog import ModelCatalog
from resq.celery_app import make_celery
from resq.heartbeat import Heartbeat, new_worker_id
from resq.metrics import serve_worker_metrics
from resq.postprocess.observed import postprocess_response
from resq.redis_client import sync_redis
from resq.settings import Settings

log = logging.getLogger(__name__)


def register_postprocess_task(app: Celery, settings: Settings) -> None:
    """Bind the ``resq.postprocess`` task of ``app``."""
    redis = sync_redis(settings.redis_url)
    catalog = ModelCatalog(redis)

    @app.task(name=keys.POSTPROCESS_TASK, ignore_result=True)  # type: ignore[untyped-decorator]
    def postprocess(response_id: str) -> str:
        return postprocess_response(redis, catalog, settings, response_id)


def run(settings: Settings) -> None:
    """Run one post-process worker process until SIGTERM/SIGINT."""
    redis = sync_redis(settings.redis_url)
    worker_id = new_worker_id("postprocess")
    heartbeat = Heartbeat(
        redis,
        keys.POSTPROCESS_WORKERS,
        "postprocess",
        worker_id,
        settings.heartbeat_s,
        settings.worker_ttl_s,
        details=lambda: {"pid": os.getpid(), "concurrency": settings.postprocess_concurrency},
    )
    app = make_celery(settings)
    register_postprocess_task(app, settings)
    serve_worker_metrics(settings)
    heartbeat.start()
    log.info("post-process worker %s consuming queue %r", worker_id, keys.POSTPROCESS_QUEUE)
    try:
        app.worker_main(
            [
                *(["--quiet"] if settings.log_format == "json" else []),  # the banner is not JSON
                "worker",
                f"--queues={keys.POSTPROCESS_QUEUE}",
                "--pool=threads",
                f"--concurrency={settings.postprocess_concurrency}",
                f"--hostname=postprocess-{os.getpid()}@{socket.gethostname()}",
                f"--loglevel={settings.log_level.upper()}",
                "--without-gossip",
                "--without-mingle",
            ]
        )
    finally:
        heartbeat.stop()
