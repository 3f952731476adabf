"""Generation messages: sending one, and seeing which responses have one waiting.

A ``resq.generate`` message carries only the response id; the job itself is in
the response's generation hash. It goes to the queue of the job's model
(``generate:<model>``), which only GPU workers serving that model consume, so a
job never reaches a worker that would render it with another model. Its Celery
task id starts with the response id, so the reaper can tell a job that waits in
its queue behind others (leave it) from one whose message was lost (send another).

Reading the queue relies on how kombu's Redis transport stores it: a list named
after the queue holding JSON envelopes whose ``headers.id`` is the task id (the
test suite checks this against real Celery messages).
"""

from __future__ import annotations

import logging
import uuid

from celery import Celery
from redis import Redis

from resq import jsonutil, keys
from resq.redis_types import texts
from resq.task_messages import CommandQueue, TaskMessages

log = logging.getLogger(__name__)

QUEUE_SCAN_PAGE = 1000


def generation_task_id(response_id: str) -> str:
    """A fresh Celery task id for a generation message of ``response_id``."""
    return f"{response_id}/{uuid.uuid4().hex[:12]}"


def _generation_queue(model: str, worker_id: str | None) -> str:
    return keys.generate_queue(model) if worker_id is None else keys.worker_generate_queue(model, worker_id)


def send_generation(celery: Celery, response_id: str, model: str, worker_id: str | None = None) -> None:
    """Send one ``resq.generate`` message for ``response_id`` (blocking): to ``model``'s shared
    queue, or to ``worker_id``'s own queue of it (cache-aware routing)."""
    celery.send_task(
        keys.GENERATE_TASK,
        kwargs={"response_id": response_id},
        queue=_generation_queue(model, worker_id),
        task_id=generation_task_id(response_id),
    )


def queue_generation(
    messages: TaskMessages, pipe: CommandQueue, response_id: str, model: str, worker_id: str | None = None
) -> None:
    """:func:`send_generation`'s message, as commands added to ``pipe`` (it goes out when ``pipe`` runs)."""
    messages.queue_on(
        pipe,
        keys.GENERATE_TASK,
        _generation_queue(model, worker_id),
        {"response_id": response_id},
        generation_task_id(response_id),
    )


def queue_postprocessing(messages: TaskMessages, pipe: CommandQueue, response_id: str) -> None:
    """The ``resq.postprocess`` message of ``response_id``, as commands added to ``pipe``."""
    messages.queue_on(pipe, keys.POSTPROCESS_TASK, keys.POSTPROCESS_QUEUE, {"response_id": response_id})


def _response_id_of(message: bytes | str) -> str | None:
    try:
        task_id = jsonutil.loads(message)["headers"]["id"]
    except (ValueError, KeyError, TypeError):
        return None
    return str(task_id).split("/", 1)[0] if isinstance(task_id, str) else None


def generation_queues(redis: Redis) -> list[str]:
    """The generation queues of every model with a card (served now or before), shared and those
    of the GPU workers that beat now (a dead worker's own queue is nobody's: its jobs count as lost)."""
    models = texts(redis.hkeys(keys.MODELS))
    beating = texts(redis.zrange(keys.GPU_WORKERS, 0, -1))
    # A worker's details key expires with its heartbeat: one read says which are alive.
    details = redis.mget([keys.worker_info("gpu", worker) for worker in beating]) if beating else []
    workers = [worker for worker, found in zip(beating, details, strict=True) if found is not None]
    shared = [keys.generate_queue(model) for model in models]
    own = [keys.worker_generate_queue(model, worker) for model in models for worker in workers]
    return sorted(shared + own)


def queued_generations(redis: Redis) -> set[str]:
    """Ids of the responses that have a message waiting in a generation queue."""
    found: set[str] = set()
    for queue in generation_queues(redis):
        start = 0
        while True:
            page = redis.lrange(keys.celery_queue(queue), start, start + QUEUE_SCAN_PAGE - 1)
            for message in page:
                response_id = _response_id_of(message)
                if response_id is not None:
                    found.add(response_id)
            if len(page) < QUEUE_SCAN_PAGE:
                break
            start += QUEUE_SCAN_PAGE
    return found
