"""The post-processor's I/O loop: token stream in, event log and store out.

One call owns one response from its first token to its terminal event (sticky
ownership, like TensorRT-LLM's post-process workers). It can be re-run on the
same response at any time: it rebuilds its state from the token stream and
skips the events already logged, so a worker that dies mid-stream loses
nothing and duplicates nothing when another one takes over.

Redis may also lose its latest writes (``appendfsync everysec`` and a crash) or
refuse writes (out of memory under ``noeviction``):

- the token stream is read by position (:mod:`resq.postprocess.positions`): tokens
  the GPU worker regenerated after a loss are not read twice;
- the event log is written by :class:`~resq.postprocess.event_log.EventLogWriter`:
  events the log lost are appended again as they were, and when they cannot be,
  the whole state is rebuilt from the token stream (:class:`LogRewoundError`);
- a write Redis keeps refusing fails the response cleanly (the events not logged,
  the open items closed ``incomplete``, ``response.failed`` with ``server_error`` and
  the final record, in one step); when even that is refused the call raises, its
  lease lapses and a takeover carries on once Redis accepts writes again. In no case
  is an event logged after a missing one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import RedisError

from resq import conversations, faults, item_index, jsonutil, keys, records, turns
from resq.catalog import ModelCatalog
from resq.events import types
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess import metrics
from resq.postprocess.event_log import (
    Backoff,
    Ending,
    EventLogWriter,
    LogRewoundError,
    RedisRefusedError,
    SharedAppends,
    StagedAppend,
    retrying,
)
from resq.postprocess.positions import ConsumedTokens, TokenGapError, TokensRewrittenError
from resq.postprocess.processor import Finished, ResponseProcessor
from resq.postprocess.token_hub import DirectTokenSource, SteadyBatch, TokenSource, TokenStream
from resq.protocols import make_protocol
from resq.records import FINALIZE_LUA, LOG_ENDED_LUA, MARK_IN_PROGRESS_LUA
from resq.redis_types import StreamEntry, optional_bytes, range_entries
from resq.sealed import sealer_from_settings
from resq.settings import Settings
from resq.status import FinalStatus
from resq.wire import FinishEntry, StartEntry, TokensEntry, decode_entry

log = logging.getLogger(__name__)

DELETE_ENDED_TOKENS_LUA = (
    LOG_ENDED_LUA
    + """
-- KEYS: the event log, the token stream; ARGV: the terminal event types.
-- Deletes the token stream only if the log's last event is terminal: a response whose end is
-- not logged yet keeps its tokens for whoever logs it.
if log_ended(KEYS[1], 1) then return redis.call('DEL', KEYS[2]) end
return 0
"""
)

READ_BLOCK_MS = 1000
READ_COUNT = 512
MAX_REBUILDS = 3
"""Rebuilds from the token stream after the event log went back in time, per call."""
WRITE_BACKOFF = Backoff()
"""How a refused write is retried (about 5 s in all) before the response fails."""


def _logged_state(redis: Redis, response_id: str) -> tuple[int, bool]:
    """How many events are logged, and whether the last one is terminal."""
    return _parse_logged_state(redis.xrevrange(keys.events(response_id), count=1))


def _parse_logged_state(reply: object) -> tuple[int, bool]:
    """:func:`_logged_state` of an ``XREVRANGE ... COUNT 1`` reply."""
    last = range_entries(reply)
    if not last:
        return 0, False
    entry_id, fields = last[0]
    return keys.sequence_number_of(entry_id) + 1, fields.get(b"type") in types.TERMINAL_TYPES_BYTES


FINALIZE_KEYS = 4


def _finalize_arguments(response_id: str, finished: Finished, ttl_s: int) -> list[str | bytes | int]:
    """:data:`FINALIZE_LUA`'s keys (:data:`FINALIZE_KEYS` of them) and arguments for ``finished``."""
    return [
        keys.record(response_id),
        keys.events(response_id),
        keys.input_items(response_id),
        keys.turn(response_id),
        finished.status,
        finished.response_json,
        ttl_s,
        jsonutil.dumps(jsonutil.loads(finished.response_json).get("output", [])),
    ]


def _finalized(reply: Any) -> tuple[FinalStatus | Literal["missing"], bytes]:
    """:data:`FINALIZE_LUA`'s reply: the record's status and its stored Response."""
    status, stored = reply
    return cast("FinalStatus | Literal['missing']", status.decode()), stored


def _finalize(
    redis: Redis, response_id: str, finished: Finished, ttl_s: int
) -> tuple[FinalStatus | Literal["missing"], bytes]:
    """Write the final record (once: a finalised response keeps what it has); its status and bytes."""
    arguments = _finalize_arguments(response_id, finished, ttl_s)
    return retrying(
        lambda: _finalized(redis.eval(FINALIZE_LUA, FINALIZE_KEYS, *arguments)),
        f"the final Response of {response_id}",
        WRITE_BACKOFF,
    )


def _fail_before_processing(
    redis: Redis,
    response_id: str,
    created: dict[str, Any],
    options: ProcessingOptions,
    first_number: int,
    message: str,
    ttl_s: int,
) -> str:
    """End a response that cannot be post-processed at all (e.g. its model is gone)."""
    protocol = make_protocol(response_id, created, options)
    status, stored = _finalize(redis, response_id, Finished("failed", protocol.unprocessable(message)), ttl_s)
    if status == "missing":
        return status
    final_status: FinalStatus = "cancelled" if status == "cancelled" else "failed"
    EventLogWriter(redis, response_id, first_number, WRITE_BACKOFF).append(
        [protocol.terminal_event(EventEmitter(first_number), final_status, stored)]
    )
    return status


HANDED_OVER = "handed-over"
"""What :func:`run_postprocess` returns when it stopped because another post-processor took over."""


OPENING_READS = 2
"""How many commands :func:`stage_opening_reads` queues."""


def stage_opening_reads(pipe: Pipeline, response_id: str) -> None:
    """Queue on ``pipe`` what :func:`run_postprocess` reads first: the record and the log's last event
    (:data:`OPENING_READS` commands)."""
    pipe.hmget(keys.record(response_id), records.PROCESSING_FIELDS)
    pipe.xrevrange(keys.events(response_id), count=1)


class AlongTheEnd(Protocol):
    """A command its caller wants sent with a response's last writes (a lease's release)."""

    def queue(self, pipe: Pipeline) -> None:
        """Queue it (one command) after the terminal event."""
        ...

    def settle(self, reply: object) -> None:
        """Its reply (an exception when it failed)."""
        ...


def run_postprocess(
    redis: Redis,
    catalog: ModelCatalog,
    settings: Settings,
    response_id: str,
    keep_going: Callable[[], bool] | None = None,
    tokens: TokenSource | None = None,
    opening: list[Any] | None = None,
    along: AlongTheEnd | None = None,
) -> str:
    """Post-process ``response_id`` to its terminal event; returns its final status.

    ``keep_going`` is asked between reads: when it turns false (this process lost its
    lease on the response) the call stops and returns :data:`HANDED_OVER`. ``tokens``
    reads the token stream (default: one ``XREAD`` per read; a post-process worker passes
    its :class:`~resq.postprocess.token_hub.TokenStreamHub`). ``opening``: the replies of
    :func:`stage_opening_reads`, read in an earlier round trip (the lease's). ``along``: sent in the
    round trip of the terminal event, when the response ends in one (settled only if it went). Raises
    :class:`RedisRefusedError` when Redis refused every write, the failure included
    (nothing half-written: a takeover goes on later).
    """
    # The record and the log's last event in one round trip: a post-processor's first two reads
    # (or in the round trip that took the lease, ``opening``).
    if opening is None:
        pipe = redis.pipeline(transaction=False)
        stage_opening_reads(pipe, response_id)
        opening = pipe.execute()
    values, last_logged = opening
    record = records.parse_processing([optional_bytes(value) for value in values])
    if record is None:
        log.info("response %s has no record (deleted or expired); nothing to do", response_id)
        return "missing"
    options = record.options
    created = jsonutil.loads(record.created_json)
    ttl_s = settings.store_ttl_s if record.store else settings.transient_ttl_s

    for rebuild in range(MAX_REBUILDS + 1):
        already_logged, done = (
            _parse_logged_state(last_logged) if rebuild == 0 else _logged_state(redis, response_id)
        )
        if done:
            redis.delete(keys.tokens(response_id))
            return "done"
        tokenizer = catalog.get(options.model)
        if tokenizer is None:
            return _fail_before_processing(
                redis,
                response_id,
                created,
                options,
                max(already_logged, options.first_sequence_number),
                f"The model {options.model!r} is no longer served.",
                ttl_s,
            )
        processor = ResponseProcessor(
            response_id,
            created,
            tokenizer,
            options,
            # Deriving the keys is an HMAC and a cipher set-up: only for responses that seal reasoning.
            sealer_from_settings(settings) if options.seal_reasoning_for is not None else None,
        )
        run = _Run(
            redis,
            tokens or DirectTokenSource(redis),
            response_id,
            processor,
            EventLogWriter(redis, response_id, already_logged, WRITE_BACKOFF),
            ttl_s,
            settings.transient_ttl_s,
            record.owner if record.store else None,
            _ConversationAppend(options.conversation_id, settings.store_ttl_s)
            if options.conversation_id is not None
            else None,
            # Only a background response's record starts ``queued``; the others start in progress.
            created_queued=created.get("status") == "queued",
            along=along,
        )
        try:
            return run.run(keep_going)
        except LogRewoundError as rewound:
            # Redis lost events of the log that this writer no longer has: start over from the
            # token stream, which the processor turns into the same events again.
            log.warning("the event log of %s went back in time (%s); rebuilding", response_id, rewound)
            if rebuild == MAX_REBUILDS:
                raise
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _ConversationAppend:
    """Where a response that belongs to a conversation appends its items when it ends."""

    conversation_id: str
    ttl_s: int


APPENDED_STATUSES = frozenset({"completed", "incomplete"})
"""The final statuses whose input and output items join the response's conversation."""


class _Run:
    """One pass over the token stream with one processor (a rebuild starts a new one)."""

    def __init__(
        self,
        redis: Redis,
        tokens: TokenSource,
        response_id: str,
        processor: ResponseProcessor,
        writer: EventLogWriter,
        ttl_s: int,
        cancel_flag_ttl_s: int,
        index_owner: str | None,
        conversation: _ConversationAppend | None = None,
        created_queued: bool = True,
        along: AlongTheEnd | None = None,
    ) -> None:
        """``created_queued``: the record was created ``queued``, so the start marks it in progress
        (a record created in progress has nothing to mark: the mark's round trip is skipped)."""
        self._redis = redis
        self._tokens = tokens
        self._response_id = response_id
        self._processor = processor
        self._writer = writer
        self._ttl_s = ttl_s
        self._cancel_flag_ttl_s = cancel_flag_ttl_s
        self._index_owner = index_owner
        self._conversation = conversation
        self._created_queued = created_queued
        self._along = along
        self._consumed = ConsumedTokens()
        self._prompt_tokens = 0
        self._engine_stopped = False
        self._last_id: bytes | str = "0-0"
        """The last token-stream entry consumed (by this thread or by the hub's, see :meth:`step`)."""
        self._handed_back: list[EncodedEvent] = []
        """Events the hub's thread made and could not log as expected: this thread logs them."""
        self._hub_error: Exception | None = None
        """What failed on the hub's thread, raised on this one."""

    def run(self, keep_going: Callable[[], bool] | None) -> str:
        stream = self._tokens.open(keys.tokens(self._response_id))
        try:
            return self._follow(stream, keep_going)
        finally:
            stream.close()

    def step(self, entries: list[StreamEntry]) -> SteadyBatch | None:
        """The hub's thread: consume entries that only continue the answer (see
        :mod:`resq.postprocess.token_hub`); None leaves them to this run's thread.

        Only tokens at exactly the position expected are taken, and the start of a response whose
        record needs no marking (one not created ``queued``): a background start, finishes, gaps,
        rewrites and stop sequences stay on the thread's path. Never raises: a failure is
        handed back and raised on the thread.
        """
        processor = self._processor
        if processor.finish is not None or processor.stopped_early or self._handed_back:
            return None
        decoded: list[TokensEntry | StartEntry] = []
        expected = self._consumed.count
        for _, fields in entries:
            try:
                entry = decode_entry(fields)
            except Exception:  # a malformed entry: the thread's path meets it and fails as before
                return None
            if isinstance(entry, StartEntry) and not self._created_queued:
                decoded.append(entry)
                continue
            if not isinstance(entry, TokensEntry) or entry.start != expected:
                return None
            expected += len(entry.token_ids)
            decoded.append(entry)
        self._last_id = entries[-1][0]
        events: list[EncodedEvent] = []
        try:
            for entry in decoded:
                if isinstance(entry, StartEntry):
                    self._prompt_tokens = entry.prompt_tokens
                    events += processor.on_entry(entry)
                    continue
                fresh = self._consumed.take(entry)
                if fresh is not None:
                    events += processor.on_entry(fresh)
        except Exception as error:  # the thread raises it, as it would have
            self._hub_error = error
            return _HandedBack()
        if processor.stopped_early:  # the thread logs them and stops the engine
            self._handed_back = events
            return _HandedBack()
        return _SteadyAppend(self, self._writer.stage(events), entries[0][0])

    def _follow(self, stream: TokenStream, keep_going: Callable[[], bool] | None) -> str:
        response_id = self._response_id
        processor = self._processor
        gap_retried_at: int | None = None
        while True:
            if keep_going is not None and not keep_going():
                log.warning("post-processing of %s was taken over by another post-processor", response_id)
                return HANDED_OVER
            entries = stream.read(self._last_id, READ_COUNT, READ_BLOCK_MS, self)
            if self._hub_error is not None:
                raise self._hub_error
            # Events the hub's thread made but could not log go first, through the same append.
            events, self._handed_back = self._handed_back, []
            if not entries and not events:
                if not self._redis.exists(keys.record(response_id)):
                    log.info("response %s was deleted while in flight", response_id)
                    return "missing"
                continue
            started = False
            failure: str | None = None
            for entry_id, fields in entries:
                self._last_id = entry_id
                entry = decode_entry(fields)
                try:
                    if isinstance(entry, TokensEntry):
                        fresh = self._consumed.take(entry)
                        if fresh is None:
                            continue  # read before: the stream went back in time
                        entry = fresh
                    elif isinstance(entry, FinishEntry):
                        self._consumed.check_finish(entry)
                except TokenGapError as gap:
                    if gap_retried_at == gap.consumed or not self._consumed.all_placed:
                        failure = f"The token stream lost tokens: {gap}."
                        break
                    # The missing tokens are in the stream below the cursor: read it again.
                    log.warning("token stream of %s: %s; reading it again from the start", response_id, gap)
                    gap_retried_at, self._last_id = gap.consumed, "0-0"
                    break
                except TokensRewrittenError as rewritten:
                    failure = f"The token stream was rewritten after a Redis data loss: {rewritten}."
                    break
                if isinstance(entry, StartEntry):
                    started = True
                    self._prompt_tokens = entry.prompt_tokens
                events += processor.on_entry(entry)
                if isinstance(entry, FinishEntry):
                    break
            # The answer's last events go out with its final record (_complete): one round trip.
            closing = processor.finish is not None and failure is None
            try:
                if started and self._created_queued:
                    self._mark_in_progress()
                if not closing:
                    self._writer.append(events)
                if processor.stopped_early and not self._engine_stopped:
                    self._stop_engine()
            except RedisRefusedError as refused:
                log.error("%s; failing %s", refused, response_id)
                return self._give_up(events, "The server could not record the response's events.", refused)
            if entries:
                metrics.note_batch_logged(entries[0][0], "thread")
            if failure is not None:
                log.error("%s: %s", response_id, failure)
                return self._give_up([], failure, None)
            if closing:
                return self._complete(events)

    def _stop_engine(self) -> None:
        """A stop sequence ended the answer: the GPU worker need not generate what nobody sees.

        The cancel flag alone (the record keeps its status): the engine's ``cancelled`` finish
        then ends the response as the processor says, ``completed`` at the stop sequence.
        """
        self._engine_stopped = True
        retrying(
            lambda: self._redis.set(keys.cancel(self._response_id), "1", ex=self._cancel_flag_ttl_s),
            f"the stop of {self._response_id}'s generation",
            WRITE_BACKOFF,
        )

    def _mark_in_progress(self) -> None:
        retrying(
            lambda: self._redis.eval(
                MARK_IN_PROGRESS_LUA,
                1,
                keys.record(self._response_id),
                jsonutil.dumps(self._processor.in_progress_response()),
            ),
            f"the in-progress record of {self._response_id}",
            WRITE_BACKOFF,
        )

    def _complete(self, closing: list[EncodedEvent]) -> str:
        # The store is written FIRST, then the terminal event: a client that sees the
        # terminal event can always GET the final Response (and reference its items).
        redis, response_id, processor = self._redis, self._response_id, self._processor
        finished = processor.final_response()
        status, stored = self._log_and_finalize(closing, finished)
        if status == "cancelled" and finished.status != "cancelled":
            status, stored = _finalize(redis, response_id, processor.final_response("cancelled"), self._ttl_s)
        if status == "missing":
            return status
        faults.reached("postprocess.after_final_record")
        output: list[dict[str, Any]] = jsonutil.loads(stored).get("output", [])
        terminal = processor.terminal_event(status, stored)
        joins_conversation = self._conversation is not None and status in APPENDED_STATUSES
        if not joins_conversation and self._end_in_one_round(output, terminal):
            return status
        # Step by step, each write retried: a conversation's items go in between, or the
        # one round met an error (every step below is safe to repeat).
        self._index_output(output)
        if joins_conversation:
            self._append_to_conversation(output)
        self._writer.append([terminal])
        redis.delete(keys.tokens(response_id))
        return status

    def _log_and_finalize(
        self, closing: list[EncodedEvent], finished: Finished
    ) -> tuple[FinalStatus | Literal["missing"], bytes]:
        """Log the answer's last events (``closing``: its items' ends) and write the final record,
        in one pipeline; any other reply than the common one goes through each step's own retrying
        path, after it (both steps are safe to repeat).

        A refusal of the events past the retries raises :class:`RedisRefusedError`: the response is
        finished in the processor, so it is left to a takeover, as when they were logged alone.
        """
        staged = self._writer.stage(closing)
        if staged is None:
            return _finalize(self._redis, self._response_id, finished, self._ttl_s)
        arguments = _finalize_arguments(self._response_id, finished, self._ttl_s)
        pipe = self._redis.pipeline(transaction=False)
        staged.queue(pipe)
        pipe.eval(FINALIZE_LUA, FINALIZE_KEYS, *arguments)
        try:
            logged, final = pipe.execute(raise_on_error=False)
        except RedisError as error:
            logged = final = error
        if not staged.settle(logged):
            self._writer.append(closing)
        if isinstance(final, Exception):
            return _finalize(self._redis, self._response_id, finished, self._ttl_s)
        return _finalized(final)

    def _end_in_one_round(self, output: list[dict[str, Any]], terminal: EncodedEvent) -> bool:
        """The output's index entries, the terminal event, the token stream's removal and the
        caller's :class:`AlongTheEnd` (the lease's release) in one pipeline (four round trips
        otherwise, on every response); False when any part of it did not go as expected, for the
        caller to finish step by step.

        Sent in that order, so a client that sees the terminal event can reference the items;
        the stream is removed only if the log ends with a terminal event by then (a takeover
        that finds no terminal event reads the stream again).
        """
        response_id = self._response_id
        pipe = self._redis.pipeline(transaction=False)
        if self._index_owner is not None:
            item_index.index_items(
                pipe, self._index_owner, response_id, output, item_index.OUTPUT, self._ttl_s
            )
        staged = self._writer.stage([terminal])
        appended_at = len(pipe)
        if staged is not None:
            staged.queue(pipe)
        pipe.eval(
            DELETE_ENDED_TOKENS_LUA,
            2,
            keys.events(response_id),
            keys.tokens(response_id),
            *types.TERMINAL_TYPES_LISTED,
        )
        along_at = len(pipe)
        if self._along is not None:
            self._along.queue(pipe)
        try:
            replies = pipe.execute(raise_on_error=False)
        except RedisError:
            return False
        if self._along is not None:
            self._along.settle(replies[along_at])
        settled = staged is None or staged.settle(replies[appended_at])
        return settled and not any(isinstance(reply, Exception) for reply in replies)

    def _give_up(self, unlogged: list[EncodedEvent], message: str, cause: RedisRefusedError | None) -> str:
        """End the response ``failed`` (``server_error``) right after the events logged so far."""
        processor = self._processor
        if processor.finish is not None or processor.next_sequence_number < self._writer.already_logged:
            # Finished already (a takeover completes it), or still re-emitting what another
            # post-processor logged (its events are not this processor's to close): leave it.
            if cause is not None:
                raise cause
            raise RuntimeError(message)
        closing = processor.on_entry(FinishEntry("error", self._prompt_tokens, self._consumed.count, message))
        failed = processor.final_response("failed")
        cancelled = processor.final_response("cancelled")
        number = processor.next_sequence_number
        ending = Ending(
            failed.response_json,
            processor.terminal_event_at(number, "failed", failed.response_json),
            cancelled.response_json,
            processor.terminal_event_at(number, "cancelled", cancelled.response_json),
            self._ttl_s,
            self._cancel_flag_ttl_s,
        )
        status = self._writer.end(unlogged, closing, ending)
        if status == "moved":
            log.warning(
                "another post-processor logged further on %s; leaving it to that one", self._response_id
            )
            return HANDED_OVER
        if status == "final":
            return "done"
        if status in ("failed", "cancelled"):
            ended = failed.response_json if status == "failed" else cancelled.response_json
            output = jsonutil.loads(ended).get("output", [])
            self._index_output(output)
            output_json = jsonutil.dumps(output)
            retrying(
                lambda: self._redis.eval(turns.SET_OUTPUT_LUA, 1, keys.turn(self._response_id), output_json),
                f"the turn of {self._response_id}",
                WRITE_BACKOFF,
            )
            self._redis.delete(keys.tokens(self._response_id))
        return status

    def _append_to_conversation(self, output: list[dict[str, Any]]) -> None:
        """Append the response's input and output items to its conversation, exactly once.

        After the final record and before the terminal event: a client that sees the end can
        list the items. A takeover that finishes the response again appends nothing twice (the
        script refuses a response id it appended before); a conversation deleted meanwhile
        gets nothing.
        """
        if self._conversation is None:
            return
        conversation_id, ttl_s = self._conversation.conversation_id, self._conversation.ttl_s
        response_id = self._response_id
        raw_input = self._redis.get(keys.input_items(response_id))
        own: list[dict[str, Any]] = jsonutil.loads(raw_input)["items"] if raw_input else []
        items = [*own, *output]

        def write() -> Any:
            arguments = conversations.append_arguments(ttl_s, response_id, items)
            return self._redis.eval(
                conversations.APPEND_LUA, 4, *keys.conversation_keys(conversation_id), *arguments
            )

        outcome = retrying(write, f"the conversation items of {response_id}", WRITE_BACKOFF)
        # Another response (or a client's add) took one of these ids since this one was accepted:
        # those items join under fresh ids rather than replace what the conversation holds.
        while (renamed := conversations.renamed_where_taken(items, outcome)) is not None:
            log.warning(
                "%s: item ids taken in conversation %s meanwhile; appended under new ids",
                response_id,
                conversation_id,
            )
            items = renamed
            outcome = retrying(write, f"the conversation items of {response_id}", WRITE_BACKOFF)
        if outcome in (b"missing", "missing"):
            log.info("conversation %s is gone; %s appends nothing to it", conversation_id, response_id)
        faults.reached("postprocess.after_conversation_append")

    def _index_output(self, output: list[dict[str, Any]]) -> None:
        if self._index_owner is None:
            return
        owner = self._index_owner

        def write() -> None:
            pipe = self._redis.pipeline(transaction=False)
            item_index.index_items(pipe, owner, self._response_id, output, item_index.OUTPUT, self._ttl_s)
            pipe.execute()

        retrying(write, f"the item index of {self._response_id}", WRITE_BACKOFF)


class _HandedBack:
    """A batch the hub's thread took but this run's thread must finish."""

    def queue(self, appends: SharedAppends) -> int:
        return 0

    def settle(self, replies: list[Any]) -> bool:
        return False


class _SteadyAppend:
    """The events of a steady batch, appended in the hub's shared pipeline."""

    def __init__(self, run: _Run, append: StagedAppend | None, oldest_entry_id: bytes) -> None:
        self._run = run
        self._append = append
        self._oldest_entry_id = oldest_entry_id

    def queue(self, appends: SharedAppends) -> int:
        if self._append is None:
            return 0
        self._append.join(appends)
        return 1

    def settle(self, replies: list[Any]) -> bool:
        if self._append is not None and not self._append.settle(replies[0]):
            # Not the common reply (a hole, a duplicate, a deleted log, an error): the thread's
            # append handles every case and retries, with the same events.
            self._run._handed_back = self._append.events
            return False
        metrics.note_batch_logged(self._oldest_entry_id, "hub")
        return True
