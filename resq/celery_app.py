"""The Celery app every role builds the same way: Redis broker, JSON only.

Roles register their own tasks on it (``gpu_worker`` the generate task,
``workers`` the post-process task); the API only sends by task name, so it
imports neither role.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]

from resq import keys
from resq.redis_urls import celery_broker_url
from resq.settings import Settings


def make_celery(settings: Settings) -> Celery:
    """A Celery app on ``settings.redis_url`` with resq's queues and JSON serialisation."""
    app = Celery("resq", broker=celery_broker_url(settings.redis_url), set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        result_backend=None,
        # Generation queues are per model (keys.generate_queue), created as they are first used.
        task_queues=(Queue(keys.POSTPROCESS_QUEUE),),
        task_routes={
            keys.POSTPROCESS_TASK: {"queue": keys.POSTPROCESS_QUEUE},
        },
        task_default_queue=keys.POSTPROCESS_QUEUE,
        # One message at a time per worker slot: a busy GPU worker leaves queued jobs to idle ones.
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        broker_connection_retry_on_startup=True,
        # What the Redis-restart fault tests prove, pinned (Celery 6 turns it on by default): a
        # lost broker connection does not cancel the task running (a GPU worker's wait for room
        # in its engine); resq's own claims decide who generates. (Celery 5 still warns at each
        # connection loss that the default will change; the value stays the one tested.)
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_transport_options={
            "socket_keepalive": True,
            "health_check_interval": 30,
            # kombu's ack emulation copies every delivered message into an `unacked` hash and
            # index (a MULTI on delivery, another on ack) to redeliver it after an hour if its
            # worker dies: two round trips per message that resq's own recovery makes
            # redundant (the reaper sends a lost generation message again after
            # RESQ_DISPATCH_TIMEOUT_S, and a post-processor's unclaimed lease lapses to another).
            # Off, a worker that stops cleanly still puts back the messages it held.
            "ack_emulation": False,
        },
        # Task events feed Flower; they cost a Redis publish per task state, so they are opt-in.
        worker_send_task_events=settings.celery_events,
        task_send_sent_event=settings.celery_events,
    )
    return app


def worker_options(settings: Settings) -> list[str]:
    """The ``celery worker`` flags both worker roles pass: none of Celery's worker-to-worker
    traffic, which resq's own heartbeats and recovery replace.

    Gossip and mingle always off; Celery's ``worker-heartbeat`` events (a Redis publish every
    2 s per worker) only with ``RESQ_CELERY_EVENTS``, since only Flower reads them.
    """
    options = ["--without-gossip", "--without-mingle"]
    if not settings.celery_events:
        options.append("--without-heartbeat")
    return options
