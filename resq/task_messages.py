"""Celery task messages as the Redis commands that publish them, for a caller's own pipeline.

``celery.send_task`` publishes on a connection of its own: a blocking round trip per message,
so the API ran it on a thread pool, and its routing, producer pool and per-publish Redis client
cost about a millisecond of CPU per message (profiled: more than the API spends relaying a
256-token stream's frames). The API instead queues the commands that publish its two messages
in the MULTI that records the response: record, staged job and messages land together, in the
round trip the request already made, with no thread hop.

The commands are not written by hand. The message is Celery's own
(``app.amqp.create_task_message``, what ``send_task`` builds), and kombu's own Redis channel
turns it into commands: ``prepare_message`` and ``basic_publish`` give the envelope its body
encoding, delivery tag and delivery info, and the transport's ``_put`` hands the final
``LPUSH`` to a publish batch (kombu's hook for batched publishing), here one that adds the
commands to the caller's pipeline instead of running them. ``tests/unit/test_task_messages.py`` checks that what they
push equals what ``send_task`` pushes, and that a worker consumes it.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

from celery import Celery
from celery.utils.nodenames import anon_nodename
from kombu import serialization
from kombu.utils.uuid import uuid

PERSISTENT = 2
"""kombu's delivery mode of a direct queue's messages (``send_task`` sets it from the queue's exchange)."""


class CommandQueue(Protocol):
    """What the commands go into: a redis-py pipeline (sync or asyncio)."""

    def lpush(self, name: Any, *values: Any) -> Any: ...

    def pexpire(self, name: Any, time: Any) -> Any: ...


class _IntoPipeline:
    """A kombu publish batch that adds the commands of one publish to a caller's pipeline."""

    def __init__(self, pipe: CommandQueue) -> None:
        self._pipe = pipe
        self.added = 0

    def add(self, name: str, *args: Any) -> None:
        getattr(self._pipe, name)(*args)
        self.added += 1


class TaskMessages:
    """Builds the publish commands of Celery task messages on ``celery``'s broker (Redis)."""

    def __init__(self, celery: Celery) -> None:
        """Nothing connects here: :meth:`connect` opens kombu's channel (it pings Redis)."""
        self._celery = celery
        self._channel: Any = None
        self._connection: Any = None
        self._lock = threading.Lock()
        self._origin: tuple[int, str] | None = None

    @property
    def connected(self) -> bool:
        """Whether :meth:`queue_on` can run without a blocking round trip."""
        return self._channel is not None

    def connect(self) -> None:
        """Open kombu's Redis channel (blocking, once): its constructor checks the connection."""
        with self._lock:
            if self._channel is not None:
                return
            connection = self._celery.connection_for_write()
            channel = connection.default_channel
            if getattr(channel, "global_keyprefix", ""):
                # The collected keys would lack the prefix kombu's own client adds.
                raise ValueError("broker_transport_options.global_keyprefix is not supported")
            self._connection, self._channel = connection, channel

    def queue_on(
        self, pipe: CommandQueue, task: str, queue: str, kwargs: dict[str, Any], task_id: str | None = None
    ) -> None:
        """Add to ``pipe`` the commands that publish task ``task`` with ``kwargs`` to the direct
        queue ``queue``, as ``send_task(task, kwargs=kwargs, queue=queue, task_id=task_id)`` would:
        the message goes out when ``pipe`` runs."""
        if self._channel is None:
            self.connect()
        channel = self._channel
        headers, properties, body, _ = self._celery.amqp.create_task_message(
            task_id or uuid(),
            task,
            (),
            kwargs,
            ignore_result=None,
            # What Celery would compute per message (a saferepr of each, the host's name): the
            # same strings, made once or cheaply (the kwargs are a few short strings).
            argsrepr="()",
            kwargsrepr=_kwargs_repr(kwargs),
            origin=self._origin_name(),
        )
        content_type, content_encoding, payload = serialization.dumps(body, serializer="json")  # type: ignore[no-untyped-call]
        properties["delivery_mode"] = PERSISTENT
        message = channel.prepare_message(payload, 0, content_type, content_encoding, headers, properties)
        into = _IntoPipeline(pipe)
        # A direct queue's message goes through the anonymous exchange, routed by the queue's name.
        channel.basic_publish(message, exchange="", routing_key=queue, _publish_batch=into)
        if not into.added:
            raise RuntimeError("kombu published without handing its commands to the batch")

    def _origin_name(self) -> str:
        """Celery's ``origin`` header (``gen<pid>@<host>``), computed once per process."""
        pid = os.getpid()
        if self._origin is None or self._origin[0] != pid:
            self._origin = (pid, anon_nodename())
        return self._origin[1]

    def close(self) -> None:
        """Release kombu's connection."""
        with self._lock:
            if self._connection is not None:
                self._connection.release()
            self._connection = self._channel = None


SHORT_REPR = 128
"""Celery's ``saferepr`` equals ``repr`` for a dict of strings shorter than its limits."""


def _kwargs_repr(kwargs: dict[str, Any]) -> str | None:
    """``kwargsrepr`` as Celery would write it, when that is plain ``repr``; else None (Celery's)."""
    if all(isinstance(value, str) and len(value) < SHORT_REPR for value in kwargs.values()):
        return repr(kwargs)
    return None
