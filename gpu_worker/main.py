"""``resq gpu-worker``: load the model, start the engine, consume the ``generate`` queue."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from celery import Celery

from gpu_worker import metrics
from gpu_worker.engine import Engine
from gpu_worker.model_loading import load_model
from gpu_worker.publisher import TokenPublisher
from gpu_worker.service import GenerationService
from resq import keys
from resq.catalog import register_model
from resq.celery_app import make_celery
from resq.heartbeat import Heartbeat, new_worker_id
from resq.logs import response_context
from resq.metrics import serve_worker_metrics
from resq.redis_client import sync_redis
from resq.settings import Settings
from resq.wire import GenerationJob

log = logging.getLogger(__name__)


def register_generate_task(app: Celery, service: GenerationService) -> None:
    """Bind the ``resq.generate`` task of ``app`` to ``service``."""

    @app.task(name=keys.GENERATE_TASK, ignore_result=True)  # type: ignore[untyped-decorator]
    def generate(job: dict[str, object]) -> None:
        parsed = GenerationJob.model_validate(job)
        with response_context(parsed.response_id):
            service.submit(parsed)


def _watch_engine(publisher: TokenPublisher) -> None:
    # A dead engine cannot recover in-process: stop the worker so its supervisor
    # (compose, systemd, `resq up`) restarts it, instead of accepting jobs it cannot run.
    while publisher.fatal_error is None:
        time.sleep(1.0)
    log.error("generation engine failed (%s); shutting the GPU worker down", publisher.fatal_error)
    os.kill(os.getpid(), signal.SIGTERM)


def _drain(publisher: TokenPublisher, grace_s: float) -> None:
    """Let the requests in the engine finish, for up to ``grace_s`` seconds."""
    deadline = time.monotonic() + grace_s
    if publisher.active_count:
        log.info("waiting up to %.0fs for %d requests to finish", grace_s, publisher.active_count)
    while publisher.active_count and time.monotonic() < deadline:
        time.sleep(0.1)


def run(settings: Settings) -> None:
    """Run one GPU worker until SIGTERM/SIGINT."""
    loaded = load_model(settings)
    redis = sync_redis(settings.redis_url)
    register_model(redis, loaded.card, loaded.tokenizer_json)

    engine = Engine(loaded, settings)
    engine.start()
    publisher = TokenPublisher(redis, engine, settings.transient_ttl_s)
    publisher.start()
    metrics.watch_engine(lambda: publisher.active_count, settings.max_batch)
    serve_worker_metrics(settings)
    worker_id = new_worker_id("gpu")
    heartbeat = Heartbeat(
        redis,
        keys.GPU_WORKERS,
        "gpu",
        worker_id,
        settings.heartbeat_s,
        settings.worker_ttl_s,
        details=lambda: {
            "model": loaded.card.name,
            "device": str(loaded.device),
            "active": publisher.active_count,
            "max_batch": settings.max_batch,
            "pid": os.getpid(),
        },
    )
    heartbeat.start()
    threading.Thread(target=_watch_engine, args=(publisher,), name="engine-watch", daemon=True).start()

    app = make_celery(settings)
    register_generate_task(app, GenerationService(redis, engine, publisher))
    log.info("GPU worker %s serving %r; consuming queue %r", worker_id, loaded.card.name, keys.GENERATE_QUEUE)
    try:
        app.worker_main(
            [
                *(["--quiet"] if settings.log_format == "json" else []),  # the banner is not JSON
                "worker",
                f"--queues={keys.GENERATE_QUEUE}",
                "--pool=solo",
                "--concurrency=1",
                f"--hostname=gpu-{os.getpid()}@{socket.gethostname()}",
                f"--loglevel={settings.log_level.upper()}",
                "--without-gossip",
                "--without-mingle",
            ]
        )
    finally:
        heartbeat.stop()
        _drain(publisher, settings.shutdown_grace_s)
        publisher.stop()
        engine.stop()
        publisher.fail_remaining("The GPU worker shut down before the response finished.")
