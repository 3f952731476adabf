"""The post-processor's I/O loop: token stream in, event log and store out.

One call owns one response from its first token to its terminal event (sticky
ownership, like TensorRT-LLM's post-process workers). It can be re-run on the
same response at any time: it rebuilds its state from the token stream and
skips the events already logged, so a worker that dies mid-stream loses
nothing and duplicates nothing when another one takes over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from redis import Redis
from redis.exceptions import ResponseError

from resq import item_index, jsonutil, keys
from resq.catalog import ModelCatalog
from resq.events import types
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess import metrics
from resq.postprocess.processor import Finished, ResponseProcessor
from resq.records import FINALIZE_LUA, MARK_IN_PROGRESS_LUA
from resq.redis_types import optional_text, range_entries, stream_entries
from resq.sealed import sealer_from_settings
from resq.settings import Settings
from resq.wire import FinishEntry, StartEntry, decode_entry

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
READ_COUNT = 512


class EventLogWriter:
    """Appends events with their explicit ids, skipping those already logged."""

    def __init__(self, redis: Redis, response_id: str, already_logged: int) -> None:
        self._redis = redis
        self._key = keys.events(response_id)
        self._skip_below = already_logged

    def append(self, events: list[EncodedEvent]) -> None:
        """Log ``events`` in one round trip."""
        fresh = [event for event in events if event.sequence_number >= self._skip_below]
        if not fresh:
            return
        pipe = self._redis.pipeline(transaction=False)
        for event in fresh:
            # NOMKSTREAM: the API creates the log with `response.created`; a log that is
            # missing was deleted (DELETE) and must not come back without a TTL.
            pipe.xadd(
                self._key,
                {"type": event.type, "data": event.data},
                id=keys.event_entry_id(event.sequence_number),
                nomkstream=True,
            )
        for result in pipe.execute(raise_on_error=False):
            if isinstance(result, ResponseError):
                # Redis refused an id at or below the last one: another post-processor
                # already logged this event. Exactly-once holds; nothing to do.
                log.warning("event already logged for %s: %s", self._key, result)
        self._skip_below = fresh[-1].sequence_number + 1
        metrics.note_events_logged(len(fresh))


def _logged_state(redis: Redis, response_id: str) -> tuple[int, bool]:
    """How many events are logged, and whether the last one is terminal."""
    last = range_entries(redis.xrevrange(keys.events(response_id), count=1))
    if not last:
        return 0, False
    entry_id, fields = last[0]
    return keys.sequence_number_of(entry_id) + 1, fields.get(b"type") in types.TERMINAL_TYPES_BYTES


def _finalize(redis: Redis, response_id: str, finished: Finished, ttl_s: int) -> tuple[str, bytes]:
    status, stored = redis.eval(
        FINALIZE_LUA,
        3,
        keys.record(response_id),
        keys.events(response_id),
        keys.input_items(response_id),
        finished.status,
        finished.response_json,
        ttl_s,
    )
    return status.decode(), stored


def _fail_before_processing(
    redis: Redis, response_id: str, created: dict[str, Any], first_number: int, message: str, ttl_s: int
) -> str:
    """End a response that cannot be post-processed at all (e.g. its model is gone)."""
    response = {**created, "status": "failed", "error": {"code": "server_error", "message": message}}
    status, stored = _finalize(redis, response_id, Finished("failed", jsonutil.dumps(response)), ttl_s)
    if status == "missing":
        return status
    emitter = EventEmitter(first_number)
    EventLogWriter(redis, response_id, first_number).append(
        [emitter.emit_with_response_json(types.TERMINAL_BY_STATUS[status], stored)]
    )
    return status


HANDED_OVER = "handed-over"
"""What :func:`run_postprocess` returns when it stopped because another post-processor took over."""


def run_postprocess(
    redis: Redis,
    catalog: ModelCatalog,
    settings: Settings,
    response_id: str,
    keep_going: Callable[[], bool] | None = None,
) -> str:
    """Post-process ``response_id`` to its terminal event; returns its final status.

    ``keep_going`` is asked between reads: when it turns false (this process lost its
    lease on the response) the call stops and returns :data:`HANDED_OVER`.
    """
    created_json, options_json, store_flag, owner = redis.hmget(
        keys.record(response_id), "created", "options", "store", "owner"
    )
    if created_json is None or options_json is None:
        log.info("response %s has no record (deleted or expired); nothing to do", response_id)
        return "missing"
    options = ProcessingOptions.model_validate_json(options_json)
    created = jsonutil.loads(created_json)
    ttl_s = settings.store_ttl_s if store_flag == b"1" else settings.transient_ttl_s

    already_logged, done = _logged_state(redis, response_id)
    if done:
        redis.delete(keys.tokens(response_id))
        return "done"

    tokenizer = catalog.get(options.model)
    if tokenizer is None:
        return _fail_before_processing(
            redis,
            response_id,
            created,
            max(already_logged, options.first_sequence_number),
            f"The model {options.model!r} is no longer served.",
            ttl_s,
        )

    processor = ResponseProcessor(response_id, created, tokenizer, options, sealer_from_settings(settings))
    writer = EventLogWriter(redis, response_id, already_logged)
    tokens_key = keys.tokens(response_id)
    last_id: bytes | str = "0-0"
    while True:
        if keep_going is not None and not keep_going():
            log.warning("post-processing of %s was taken over by another post-processor", response_id)
            return HANDED_OVER
        entries = stream_entries(redis.xread({tokens_key: last_id}, count=READ_COUNT, block=READ_BLOCK_MS))
        if not entries:
            if not redis.exists(keys.record(response_id)):
                log.info("response %s was deleted while in flight", response_id)
                return "missing"
            continue
        events: list[EncodedEvent] = []
        for entry_id, fields in entries:
            last_id = entry_id
            entry = decode_entry(fields)
            if isinstance(entry, StartEntry):
                redis.eval(
                    MARK_IN_PROGRESS_LUA,
                    1,
                    keys.record(response_id),
                    jsonutil.dumps(processor.in_progress_response()),
                )
            events += processor.on_entry(entry)
            if isinstance(entry, FinishEntry):
                break
        writer.append(events)
        metrics.note_batch_logged(entries[0][0])
        if processor.finish is not None:
            index_owner = optional_text(owner) if store_flag == b"1" else None
            return _complete(redis, response_id, processor, writer, ttl_s, index_owner)


def _complete(
    redis: Redis,
    response_id: str,
    processor: ResponseProcessor,
    writer: EventLogWriter,
    ttl_s: int,
    index_owner: str | None,
) -> str:
    # The store is written FIRST, then the terminal event: a client that sees the
    # terminal event can always GET the final Response (and reference its items).
    finished = processor.final_response()
    status, stored = _finalize(redis, response_id, finished, ttl_s)
    if status == "cancelled" and finished.status != "cancelled":
        status, stored = _finalize(redis, response_id, processor.final_response("cancelled"), ttl_s)
    if status == "missing":
        return status
    if index_owner is not None:
        pipe = redis.pipeline(transaction=False)
        output = jsonutil.loads(stored).get("output", [])
        item_index.index_items(pipe, index_owner, response_id, output, item_index.OUTPUT, ttl_s)
        pipe.execute()
    writer.append([processor.terminal_event(status, stored)])
    redis.delete(keys.tokens(response_id))
    return status
