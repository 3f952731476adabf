"""``resq gpu-worker``: load the model, start the engine, consume the ``generate`` queue."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from contextlib import ExitStack

from celery import Celery
from celery.signals import worker_ready, worker_shutting_down
from redis import Redis

from gpu_worker import metrics
from gpu_worker.engine import Engine
from gpu_worker.model_loading import load_model
from gpu_worker.publisher import TokenPublisher
from gpu_worker.service import GenerationService
from gpu_worker.shutdown import WorkRelease
from resq import faults, keys
from resq.catalog import ModelCard, mark_served, register_model
from resq.celery_app import make_celery, worker_options
from resq.heartbeat import Heartbeat, new_worker_id
from resq.logs import response_context
from resq.metrics import serve_worker_metrics
from resq.recovery.dispatch import send_generation
from resq.recovery.generations import Generations
from resq.recovery.reaper import Reaper
from resq.redis_client import sync_redis
from resq.settings import Settings
from resq.startup_heap import freeze_startup_heap

log = logging.getLogger(__name__)


def register_generate_task(app: Celery, service: GenerationService) -> None:
    """Bind the ``resq.generate`` task of ``app`` to ``service``."""

    # Acknowledged late: while this worker waits for room in its engine, the next message
    # stays in the queue (visible to the reaper, and free for an idle worker to take).
    @app.task(name=keys.GENERATE_TASK, ignore_result=True, acks_late=True)  # type: ignore[untyped-decorator]
    def generate(response_id: str) -> None:
        with response_context(response_id):
            service.submit(response_id)


ENGINE_FAILED_EXIT_CODE = 3
"""The GPU worker's exit status after its engine failed: non-zero, so that a supervisor that
restarts on failure (systemd's ``on-failure``) restarts it; Celery's warm shutdown returns 0."""


def _watch_engine(publisher: TokenPublisher) -> None:
    # A dead engine cannot recover in-process: stop the worker so its supervisor
    # (compose, systemd, `resq up`) restarts it, instead of accepting jobs it cannot run.
    # The publisher has handed the engine's requests back by then, for other workers to resume.
    while publisher.fatal_error is None:
        time.sleep(1.0)
    log.error("generation engine failed (%s); shutting the GPU worker down", publisher.fatal_error)
    os.kill(os.getpid(), signal.SIGTERM)


def _warm_up(engine: Engine) -> None:
    """One short request through the engine before the publisher and the queue start
    (:meth:`Engine.warm_up`): its first steps' one-time work is not a first request's."""
    began = time.monotonic()
    try:
        finished = engine.warm_up()
    except Exception:  # best effort: the first request pays what is left
        log.warning("the engine's warm-up failed; the first request warms it instead", exc_info=True)
        return
    took_ms = (time.monotonic() - began) * 1000
    if finished:
        log.info("engine warmed up in %.0f ms", took_ms)
    else:
        log.warning(
            "the engine's warm-up did not finish in %.0f ms; the first request warms it instead", took_ms
        )


def run(settings: Settings) -> int:
    """Run one GPU worker until SIGTERM/SIGINT; the Celery worker's exit code."""
    # The metrics port first: a port taken fails the start in a second, before a model is
    # loaded or an engine thread runs that would keep a half-started process alive.
    serve_worker_metrics(settings)
    loaded = load_model(settings)
    redis = sync_redis(settings.redis_url)
    engine = Engine(loaded, settings)
    # The card says what this engine can do, which only the built engine knows (penalties
    # need an eagerly run step); the API refuses what the card rules out.
    card = loaded.card.model_copy(update={"penalties": engine.penalties is not None})
    register_model(redis, card, loaded.tokenizer_json)
    worker_id = new_worker_id("gpu")
    app = make_celery(settings)
    generations = Generations(redis, settings.transient_ttl_s)
    publisher = TokenPublisher(
        redis,
        engine,
        generations,
        dispatch=lambda rid: send_generation(app, rid, card.name),
        max_losses=settings.gpu_max_losses,
        stream_interval_s=settings.stream_interval_ms / 1000,
    )
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
        # A Redis restarted without its data has forgotten the served models: publish again.
        on_beat=lambda: _ensure_registered(redis, card, loaded.tokenizer_json),
    )
    release = WorkRelease(
        publisher, settings.shutdown_grace_s, dispatch=lambda rid: send_generation(app, rid, card.name)
    )
    # Whatever was started is stopped on any way out, a failed start included (a live
    # engine thread would otherwise keep the process from exiting). The stack unwinds
    # last-in first: stop taking work, hand running work back, stop the engine, and only
    # then withdraw the heartbeat, so no reaper takes this worker's work while it still runs.
    with ExitStack() as started:
        started.callback(heartbeat.stop)
        engine.start()
        started.callback(engine.stop, hard=True)
        _warm_up(engine)
        publisher.start()
        metrics.watch_engine(lambda: publisher.active_count, settings.max_batch)
        heartbeat.start()
        threading.Thread(target=_watch_engine, args=(publisher,), name="engine-watch", daemon=True).start()
        service = GenerationService(
            redis,
            engine,
            publisher,
            generations,
            worker_id,
            dispatch=lambda rid: send_generation(app, rid, card.name),
            model=card.name,
        )
        register_generate_task(app, service)

        def shutting_down(**_: object) -> None:
            service.stopping.set()
            release.begin()

        worker_shutting_down.connect(shutting_down, weak=False)
        started.callback(release.finish)
        reaper = Reaper(
            redis, settings, worker_id, send_generation=lambda rid, model: send_generation(app, rid, model)
        )
        reaper.start()
        started.callback(reaper.stop)
        # The model's shared queue, and this worker's own (jobs routed here for its cached prefixes).
        queue = f"{keys.generate_queue(card.name)},{keys.worker_generate_queue(card.name, worker_id)}"
        log.info("GPU worker %s serving %r; consuming queues %s", worker_id, card.name, queue)
        faults.prepare()  # the settings behind the fault points, read now rather than by a first claim
        # The model, torch and transformers out of the collector's sight before the first job, and
        # Celery's consumer once it is up: a full collection stopped the engine for 190-330 ms.
        freeze_startup_heap()
        worker_ready.connect(lambda **_: freeze_startup_heap(collect=False), weak=False)
        exit_code = app.start(
            [
                *(["--quiet"] if settings.log_format == "json" else []),  # the banner is not JSON
                "worker",
                f"--queues={queue}",
                "--pool=solo",
                "--concurrency=1",
                f"--hostname=gpu-{os.getpid()}@{socket.gethostname()}",
                f"--loglevel={settings.log_level.upper()}",
                *worker_options(settings),
            ]
        )
    if publisher.fatal_error is not None:
        return ENGINE_FAILED_EXIT_CODE
    return int(exit_code or 0)


def _ensure_registered(redis: Redis, card: ModelCard, tokenizer_json: str) -> None:
    # Every beat: the card the hash holds must be this worker's (another worker, or an
    # earlier run of this one with another model, may have written it), and it is served now.
    registered = redis.hget(keys.MODELS, card.name)
    if registered is None or not ModelCard.model_validate_json(registered).renders_like(card):
        log.warning("model card %r in Redis is missing or another's; registering this worker's", card.name)
        register_model(redis, card, tokenizer_json)
    else:
        mark_served(redis, card.name)
