"""``resq postprocess-worker``: consume the ``postprocess`` queue with a pool of threads.

Each task owns one response from its first token to its terminal event, under a
lease (:mod:`resq.recovery.leases`); the threads spend most of their time
blocked on Redis, so one process serves many responses, and several processes
share the CPU work. The worker's reaper adopts the responses of post-processors
that died, and takes its turn at reaping lost generations.
"""

from __future__ import annotations

import logging
import os
import socket

from celery import Celery
from celery.signals import worker_ready

from resq import faults, keys
from resq.celery_app import make_celery, worker_options
from resq.heartbeat import Heartbeat, new_worker_id
from resq.metrics import serve_worker_metrics
from resq.postprocess.service import PostprocessService
from resq.recovery.dispatch import send_generation
from resq.recovery.reaper import Reaper
from resq.redis_client import sync_redis
from resq.settings import Settings
from resq.startup_heap import freeze_startup_heap

log = logging.getLogger(__name__)


def register_postprocess_task(app: Celery, service: PostprocessService) -> None:
    """Bind the ``resq.postprocess`` task of ``app`` to ``service``."""

    @app.task(name=keys.POSTPROCESS_TASK, ignore_result=True)  # type: ignore[untyped-decorator]
    def postprocess(response_id: str) -> str:
        return service.run(response_id)


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
    service = PostprocessService(settings, worker_id)
    register_postprocess_task(app, service)
    serve_worker_metrics(settings)
    reaper = Reaper(
        redis,
        settings,
        worker_id,
        send_generation=lambda response_id, model: send_generation(app, response_id, model),
        take_over_postprocessing=service.take_over_lapsed,
    )
    heartbeat.start()
    service.start()
    reaper.start()
    log.info("post-process worker %s consuming queue %r", worker_id, keys.POSTPROCESS_QUEUE)
    faults.prepare()  # the settings behind the fault points, read now rather than by a first response
    # What the process built to start out of the collector's sight (resq.startup_heap): a full
    # collection stopped every response of the process for 55-115 ms in the middle of a load.
    freeze_startup_heap()
    worker_ready.connect(lambda **_: freeze_startup_heap(collect=False), weak=False)
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
                *worker_options(settings),
            ]
        )
    finally:
        reaper.stop()
        service.close()
        heartbeat.stop()
