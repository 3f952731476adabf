"""Celery messages built as Redis commands (resq.task_messages) against what Celery itself sends.

The API queues its two messages in the MULTI that records a response; the reaper and the GPU
workers still call ``send_task``. Both must push the same envelope, or a worker would read
one of them wrongly: compared here field by field on a real Redis, and consumed with kombu.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from resq import keys
from resq.celery_app import make_celery
from resq.recovery.dispatch import (
    queue_generation,
    queue_postprocessing,
    queued_generations,
    send_generation,
)
from resq.settings import Settings
from resq.task_messages import TaskMessages
from tests.support.redis_server import PrivateRedis

MODEL = "m"
RESPONSE = "resp_0123456789abcdef0123456789abcdef"


@pytest.fixture
def celery(private_redis: PrivateRedis) -> Celery:
    return make_celery(Settings(redis_url=private_redis.url))


@pytest.fixture
def messages(celery: Celery) -> Iterator[TaskMessages]:
    built = TaskMessages(celery)
    yield built
    built.close()


def envelope(raw: bytes) -> dict[str, Any]:
    """A pushed message with the fields that differ between any two messages left out
    (delivery tag, reply-to, origin; the task id where Celery draws one) and its body decoded."""
    message = json.loads(raw)
    properties = message["properties"]
    assert properties.pop("delivery_tag")
    properties.pop("reply_to", None)
    message["headers"].pop("origin", None)
    assert properties["body_encoding"] == "base64"
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return dict(message)


def drop_ids(message: dict[str, Any]) -> dict[str, Any]:
    headers, properties = message["headers"], message["properties"]
    assert headers["id"] == headers["root_id"] == properties["correlation_id"]
    for field in ("id", "root_id"):
        headers.pop(field)
    properties.pop("correlation_id")
    return message


def test_a_generation_message_is_the_one_send_task_pushes(
    r: redis.Redis, celery: Celery, messages: TaskMessages
) -> None:
    queue = keys.generate_queue(MODEL)
    send_generation(celery, RESPONSE, MODEL)
    sent = r.lpop(queue)
    pipe = r.pipeline(transaction=True)
    queue_generation(messages, pipe, RESPONSE, MODEL)
    assert r.llen(queue) == 0, "nothing goes out before the pipeline runs"
    pipe.execute()
    queued = r.lpop(queue)
    assert isinstance(sent, bytes) and isinstance(queued, bytes)
    ours, celerys = envelope(queued), envelope(sent)
    # Each message has a fresh task id of the same shape: the response id, then a random part.
    assert ours["headers"]["id"].split("/")[0] == celerys["headers"]["id"].split("/")[0] == RESPONSE
    assert drop_ids(ours) == drop_ids(celerys)
    assert ours["headers"]["task"] == keys.GENERATE_TASK
    assert ours["body"][1] == {"response_id": RESPONSE}
    assert ours["properties"]["delivery_info"] == {"exchange": "", "routing_key": queue}


def test_a_message_to_a_workers_own_queue_and_a_postprocessing_message_match_too(
    r: redis.Redis, celery: Celery, messages: TaskMessages
) -> None:
    own = keys.worker_generate_queue(MODEL, "gpu@host:1")
    send_generation(celery, RESPONSE, MODEL, "gpu@host:1")
    celery.send_task(keys.POSTPROCESS_TASK, kwargs={"response_id": RESPONSE}, queue=keys.POSTPROCESS_QUEUE)
    sent = [r.lpop(own), r.lpop(keys.POSTPROCESS_QUEUE)]
    pipe = r.pipeline(transaction=True)
    queue_generation(messages, pipe, RESPONSE, MODEL, "gpu@host:1")
    queue_postprocessing(messages, pipe, RESPONSE)
    pipe.execute()
    queued = [r.lpop(own), r.lpop(keys.POSTPROCESS_QUEUE)]
    for ours, celerys in zip(queued, sent, strict=True):
        assert isinstance(ours, bytes) and isinstance(celerys, bytes)
        assert drop_ids(envelope(ours)) == drop_ids(envelope(celerys))


def test_a_queued_message_is_consumed_as_a_celery_task_and_seen_by_the_reaper(
    r: redis.Redis, celery: Celery, messages: TaskMessages
) -> None:
    r.hset(keys.MODELS, MODEL, "{}")  # the model has a card: the reaper reads its queue
    pipe = r.pipeline(transaction=True)
    queue_generation(messages, pipe, RESPONSE, MODEL)
    pipe.execute()
    assert queued_generations(r) == {RESPONSE}
    with celery.connection_for_read() as connection:
        consumed = connection.SimpleQueue(keys.generate_queue(MODEL)).get(timeout=5)
        assert consumed.headers["task"] == keys.GENERATE_TASK
        assert consumed.headers["id"].startswith(RESPONSE + "/")
        args, kwargs, _embed = consumed.decode()
        assert (args, kwargs) == ([], {"response_id": RESPONSE})
        consumed.ack()


def test_nothing_connects_before_first_use_and_a_step_never_run_sends_nothing(
    r: redis.Redis, messages: TaskMessages
) -> None:
    assert not messages.connected
    pipe = r.pipeline(transaction=True)
    queue_postprocessing(messages, pipe, RESPONSE)  # connects on first use
    assert messages.connected
    pipe.reset()  # the request failed before its step ran: no message for a response never recorded
    assert r.llen(keys.POSTPROCESS_QUEUE) == 0


def test_a_lost_broker_connection_does_not_cancel_running_tasks() -> None:
    """Pinned ahead of Celery 6, whose default flips: the Redis-restart fault tests
    (tests/e2e/test_faults.py) prove resq with running tasks left alone."""
    app = make_celery(Settings(redis_url="redis://127.0.0.1:6379/15"))
    assert app.conf.worker_cancel_long_running_tasks_on_connection_loss is False
    assert (app.conf.task_serializer, app.conf.accept_content) == ("json", ["json"])
