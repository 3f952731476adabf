"""Redis losing or refusing writes under the post-processor, against a real Redis.

Item 4 of issue 15: an event-log write Redis refuses (out of memory under ``noeviction``)
is retried, then fails the response cleanly or is left to a takeover, never leaving a gap.
Item 5: a token stream that moves back in time (Redis lost its last second, the GPU worker
regenerated it) is read by position, so no text is read twice or skipped; events the log
lost are logged again as they were.

A Redis server of these tests' own: they set ``maxmemory`` and rewrite streams.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import redis
from prometheus_client import REGISTRY
from redis.exceptions import ReadOnlyError

from resq import jsonutil, keys, records
from resq.catalog import ModelCatalog, TextTokenizer
from resq.events import builders as build
from resq.events import types
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess import event_log, runner
from resq.postprocess.event_log import Backoff, EventLogWriter, LogRewoundError, RedisRefusedError
from resq.postprocess.positions import ConsumedTokens, TokenGapError, TokensRewrittenError
from resq.postprocess.token_hub import TokenSource, TokenStreamHub
from resq.recovery.leases import RELEASE_ENDED_LUA, PostprocessLeases
from resq.redis_types import range_entries
from resq.settings import Settings
from resq.wire import FinishEntry, StartEntry, TokensEntry, TokenStreamEntry, encode_entry
from tests.support.invariants import check_stream, output_text
from tests.support.redis_server import PrivateRedis
from tests.support.tokenizer import tiny_tokenizer
from tests.unit.test_events import base_response

RESPONSE_ID = "resp_" + "e" * 32
TEXT = "Hello! The answer is 4, and the question was long forgotten by then."
"""ASCII: every token adds text, so every entry adds a delta (tests wait for them)."""
FAST = Backoff(attempts=3, first_delay_s=0.01, max_delay_s=0.01)
WAIT_S = 10.0


@pytest.fixture
def r(private_redis: PrivateRedis) -> Iterator[redis.Redis]:
    client = private_redis.client()
    client.config_set("maxmemory", 0)
    client.flushdb()
    yield client
    client.config_set("maxmemory", 0)
    client.close()


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return tiny_tokenizer()


@pytest.fixture
def token_ids(tokenizer: TextTokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT)
    assert len(ids) >= 16
    return ids


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "WRITE_BACKOFF", FAST)


# --- helpers -------------------------------------------------------------------------------------


class Catalog:
    """The part of :class:`ModelCatalog` the runner uses."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer

    def get(self, name: str) -> TextTokenizer | None:
        return self._tokenizer


def events_of(count: int, first: int = 0, tag: str = "") -> list[EncodedEvent]:
    return [
        EncodedEvent(number, "response.output_text.delta", f'{{"n":{number},"tag":"{tag}"}}'.encode())
        for number in range(first, first + count)
    ]


def new_log(r: redis.Redis) -> None:
    """An event log holding event 0 (the API creates it with ``response.created``)."""
    r.xadd(keys.events(RESPONSE_ID), {"type": "response.created", "data": b"{}"}, id=keys.event_entry_id(0))


def log_entries(r: redis.Redis) -> list[tuple[int, bytes]]:
    return [
        (keys.sequence_number_of(entry_id), fields[b"data"])
        for entry_id, fields in range_entries(r.xrange(keys.events(RESPONSE_ID)))
    ]


def logged_events(r: redis.Redis) -> list[dict[str, Any]]:
    return [jsonutil.loads(data) for _, data in log_entries(r)]


def keep_first(r: redis.Redis, key: str, count: int) -> None:
    """Make a stream hold only its first ``count`` entries, as a Redis that came back older would
    (rebuilt, not XDEL'd: XDEL would keep the stream's last id, which a real loss does not)."""
    kept = range_entries(r.xrange(key, count=count))
    pipe = r.pipeline(transaction=True)
    pipe.delete(key)
    for entry_id, fields in kept:
        pipe.xadd(key, fields, id=entry_id)  # type: ignore[arg-type]
    pipe.execute()


def start_response(r: redis.Redis, status: str = "queued") -> None:
    """A record and its event log as the API leaves them (``response.created`` logged): ``queued``
    as a background response's, ``in_progress`` as a foreground one's."""
    created = base_response(status)
    r.hset(
        keys.record(RESPONSE_ID),
        mapping={
            "status": status,
            "created": jsonutil.dumps(created),
            "options": ProcessingOptions(model="tiny").model_dump_json(),
            "store": "0",
            "owner": "",
        },
    )
    head = EventEmitter().emit(build.response_event(types.CREATED, created))
    r.xadd(keys.events(RESPONSE_ID), {"type": head.type, "data": head.data}, id=keys.event_entry_id(0))


def start_foreground_response(r: redis.Redis) -> None:
    """A record and its event log as the API leaves a foreground response's: ``response.created``
    and ``response.in_progress`` logged, the processor told so (:func:`api.submission.accept`)."""
    created = base_response("in_progress")
    options = ProcessingOptions(model="tiny", first_sequence_number=2, in_progress_logged=True)
    r.hset(
        keys.record(RESPONSE_ID),
        mapping={
            "status": "in_progress",
            "created": jsonutil.dumps(created),
            "options": options.model_dump_json(),
            "store": "0",
            "owner": "",
        },
    )
    emitter = EventEmitter()
    for kind in (types.CREATED, types.IN_PROGRESS):
        head = emitter.emit(build.response_event(kind, created))
        r.xadd(
            keys.events(RESPONSE_ID),
            {"type": head.type, "data": head.data},
            id=keys.event_entry_id(head.sequence_number),
        )


def add_entries(r: redis.Redis, entries: list[TokenStreamEntry], ids: list[str] | None = None) -> None:
    """Append in one transaction: a blocked reader gets them all in one read."""
    pipe = r.pipeline(transaction=True)
    for index, entry in enumerate(entries):
        pipe.xadd(keys.tokens(RESPONSE_ID), encode_entry(entry), id=ids[index] if ids else "*")
    pipe.execute()


def chunks(token_ids: list[int], start: int, end: int, size: int) -> list[TokenStreamEntry]:
    return [TokensEntry(token_ids[at : min(at + size, end)], start=at) for at in range(start, end, size)]


SOURCES: dict[str, TokenSource | None] = {}
"""The token source the runner reads through: set per test by :func:`token_source`."""


@pytest.fixture(autouse=True, params=["direct", "hub"])
def token_source(request: pytest.FixtureRequest, r: redis.Redis) -> Iterator[str]:
    """Every runner test twice: one ``XREAD`` per read, and the worker's hub, whose steady path
    logs the common case on its own thread (every fault below must reach the thread's path)."""
    hub = TokenStreamHub(r, block_ms=200) if request.param == "hub" else None
    SOURCES["current"] = hub
    yield request.param
    SOURCES.clear()
    if hub is not None:
        hub.close()


def postprocess(r: redis.Redis, tokenizer: TextTokenizer) -> str:
    return runner.run_postprocess(
        r, cast(ModelCatalog, Catalog(tokenizer)), Settings(), RESPONSE_ID, tokens=SOURCES.get("current")
    )


class Background:
    """``run_postprocess`` in a thread: the test feeds the token stream meanwhile."""

    def __init__(self, r: redis.Redis, tokenizer: TextTokenizer) -> None:
        self.result: str | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(r, tokenizer), daemon=True)
        self._thread.start()

    def _run(self, r: redis.Redis, tokenizer: TextTokenizer) -> None:
        client = redis.Redis(connection_pool=r.connection_pool)
        try:
            self.result = postprocess(client, tokenizer)
        except BaseException as error:  # reported by join()
            self.error = error

    def join(self) -> str:
        self._thread.join(WAIT_S * 2)
        assert not self._thread.is_alive(), "the post-processor did not end"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def log_length(r: redis.Redis) -> int:
    return int(r.xlen(keys.events(RESPONSE_ID)))


def deltas(events: list[dict[str, Any]]) -> str:
    return "".join(event["delta"] for event in events if event["type"] == types.OUTPUT_TEXT_DELTA)


# --- the writer: duplicates, refusals, lost events ------------------------------------------------


def test_events_already_logged_are_skipped_not_taken_for_errors(r: redis.Redis) -> None:
    new_log(r)
    other = EventLogWriter(r, RESPONSE_ID, 1, FAST)
    other.append(events_of(3, first=1, tag="other"))
    writer = EventLogWriter(r, RESPONSE_ID, 1, FAST)  # started when only event 0 was logged
    writer.append(events_of(5, first=1, tag="mine"))
    logged = log_entries(r)
    assert [number for number, _ in logged] == [0, 1, 2, 3, 4, 5]
    assert [b"other" in data for _, data in logged] == [False] + [True] * 3 + [False] * 2


def test_an_append_refused_for_lack_of_memory_is_retried_until_it_lands(r: redis.Redis) -> None:
    new_log(r)
    r.config_set("maxmemory", 1)  # everything that writes is refused (noeviction)
    waits: list[float] = []

    def sleep(delay_s: float) -> None:
        waits.append(delay_s)
        if len(waits) == 3:
            r.config_set("maxmemory", 0)

    writer = EventLogWriter(r, RESPONSE_ID, 1, Backoff(attempts=10, first_delay_s=0.01), sleep=sleep)
    writer.append(events_of(3, first=1))
    assert waits == [0.01, 0.02, 0.04]
    assert [number for number, _ in log_entries(r)] == [0, 1, 2, 3]


def test_an_append_redis_keeps_refusing_raises_and_writes_nothing(r: redis.Redis) -> None:
    new_log(r)
    writer = EventLogWriter(r, RESPONSE_ID, 1, FAST)
    writer.append(events_of(1, first=1))
    r.config_set("maxmemory", 1)
    with pytest.raises(RedisRefusedError, match="OutOfMemoryError"):
        writer.append(events_of(2, first=2))
    r.config_set("maxmemory", 0)
    assert [number for number, _ in log_entries(r)] == [0, 1]
    # Nothing later can be logged past the hole either; the refused events can.
    writer.append(events_of(3, first=2))
    assert [number for number, _ in log_entries(r)] == [0, 1, 2, 3, 4]


def test_every_other_error_is_retried_too(r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only OOM: any refusal (here a read-only replica, faked) is retried, then reported."""
    new_log(r)
    writer = EventLogWriter(r, RESPONSE_ID, 1, Backoff(attempts=3, first_delay_s=0), sleep=lambda _: None)
    real = writer._append
    refusals = [ReadOnlyError("You can't write against a read only replica.")] * 2

    def flaky(**kwargs: Any) -> Any:
        if refusals:
            raise refusals.pop()
        return real(**kwargs)

    monkeypatch.setattr(writer, "_append", flaky)
    writer.append(events_of(1, first=1))
    assert [number for number, _ in log_entries(r)] == [0, 1]
    refusals.extend([ReadOnlyError("READONLY")] * 3)
    with pytest.raises(RedisRefusedError, match="ReadOnlyError"):
        writer.append(events_of(1, first=2))


def test_events_the_log_lost_are_logged_again_as_they_were(r: redis.Redis) -> None:
    new_log(r)
    writer = EventLogWriter(r, RESPONSE_ID, 1, FAST)
    writer.append(events_of(3, first=1))
    writer.append(events_of(3, first=4))
    before = log_entries(r)
    keep_first(r, keys.events(RESPONSE_ID), 3)  # Redis came back without events 3..6
    writer.append(events_of(2, first=7))
    assert log_entries(r) == [
        *before,
        *((event.sequence_number, event.data) for event in events_of(2, first=7)),
    ]


def test_events_lost_beyond_what_the_writer_keeps_raise_rewound(r: redis.Redis) -> None:
    now = [0.0]
    new_log(r)
    writer = EventLogWriter(r, RESPONSE_ID, 1, FAST, replay_window_s=5, clock=lambda: now[0])
    writer.append(events_of(3, first=1))
    now[0] = 10.0
    writer.append(events_of(2, first=4))  # the first four are forgotten now
    keep_first(r, keys.events(RESPONSE_ID), 2)
    with pytest.raises(LogRewoundError):
        writer.append(events_of(1, first=6))
    assert [number for number, _ in log_entries(r)] == [0, 1]  # no gap: nothing was written


def test_a_deleted_log_does_not_come_back(r: redis.Redis) -> None:
    new_log(r)
    writer = EventLogWriter(r, RESPONSE_ID, 1, FAST)
    writer.append(events_of(1, first=1))
    r.delete(keys.events(RESPONSE_ID))
    writer.append(events_of(2, first=2))
    assert not r.exists(keys.events(RESPONSE_ID))


# --- reading tokens by position --------------------------------------------------------------------


def test_tokens_already_consumed_are_dropped() -> None:
    consumed = ConsumedTokens()
    assert consumed.take(TokensEntry([1, 2, 3], [0.1, 0.2, 0.3], start=0)) == TokensEntry(
        [1, 2, 3], [0.1, 0.2, 0.3], start=0
    )
    assert consumed.take(TokensEntry([2, 3], start=1)) is None
    assert consumed.take(TokensEntry([3, 4, 5], [0.3, 0.4, 0.5], start=2)) == TokensEntry(
        [4, 5], [0.4, 0.5], start=3
    )
    assert consumed.take(TokensEntry([6])) == TokensEntry([6])  # no position: follows
    assert consumed.count == 6 and not consumed.all_placed


def test_a_gap_and_a_rewritten_token_are_told_apart() -> None:
    consumed = ConsumedTokens()
    consumed.take(TokensEntry([1, 2, 3], start=0))
    with pytest.raises(TokenGapError):
        consumed.take(TokensEntry([5], start=4))
    with pytest.raises(TokensRewrittenError) as rewritten:
        consumed.take(TokensEntry([2, 9, 4], start=1))
    assert rewritten.value.position == 2
    with pytest.raises(TokenGapError):
        consumed.check_finish(FinishEntry("stop", 1, 4))
    consumed.check_finish(FinishEntry("stop", 1, 3))
    assert consumed.count == 3


# --- the runner -------------------------------------------------------------------------------------


def reference_events(r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int]) -> list[dict[str, Any]]:
    start_response(r)
    add_entries(
        r, [StartEntry(7), *chunks(token_ids, 0, len(token_ids), 3), FinishEntry("stop", 7, len(token_ids))]
    )
    assert postprocess(r, tokenizer) == "completed"
    events = logged_events(r)
    r.flushdb()
    return events


def delta_count(r: redis.Redis) -> int:
    return sum(1 for event in logged_events(r) if event["type"] == types.OUTPUT_TEXT_DELTA)


def feed_chunk_by_chunk(r: redis.Redis, token_ids: list[int]) -> list[TokenStreamEntry]:
    """Two-token chunks, each once the one before it is logged as a delta, then the finish."""
    sent = chunks(token_ids, 0, len(token_ids), 2)
    for index, entry in enumerate(sent):
        add_entries(r, [entry])
        wait_for(lambda count=index + 1: delta_count(r) >= count, f"chunk {index}'s delta")
    add_entries(r, [FinishEntry("stop", 7, len(token_ids))])
    return sent


def _batches(path: str) -> float:
    return REGISTRY.get_sample_value("resq_postprocess_batches_total", {"path": path}) or 0.0


def test_a_stream_that_only_continues_is_logged_on_the_hubs_thread(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int], token_source: str
) -> None:
    """Chunks that follow one another are turned into events and logged by the hub's thread (its
    steady path); the start and the finish by the response's own. The log is the same either way."""
    expected = reference_events(r, tokenizer, token_ids)
    start_response(r)
    hub_before, thread_before = _batches("hub"), _batches("thread")
    background = Background(r, tokenizer)
    add_entries(r, [StartEntry(7)])
    wait_for(lambda: r.hget(keys.record(RESPONSE_ID), "status") == b"in_progress", "the start")
    sent = feed_chunk_by_chunk(r, token_ids)
    assert background.join() == "completed"
    events = logged_events(r)
    final = check_stream(events)
    assert deltas(events) == output_text(final) == output_text(expected[-1]["response"]) == TEXT
    assert delta_count(r) == len(sent)
    hub_batches, thread_batches = _batches("hub") - hub_before, _batches("thread") - thread_before
    if token_source == "hub":
        # The first chunk may still reach the thread (it reads right after the start); the rest not.
        assert hub_batches >= len(sent) - 1, (hub_batches, thread_batches)
        assert thread_batches <= 3, (hub_batches, thread_batches)
    else:
        assert hub_batches == 0
        assert thread_batches >= len(sent)


def test_a_foreground_response_wakes_its_thread_only_for_its_finish(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int], token_source: str
) -> None:
    """A foreground response's start logs nothing and marks nothing: with the hub it is taken on
    the hub's thread like the chunks after it, and the response's own thread wakes for the finish
    alone (one batch)."""
    start_foreground_response(r)
    hub_before, thread_before = _batches("hub"), _batches("thread")
    background = Background(r, tokenizer)
    time.sleep(0.5)  # the post-processor waits on its stream
    add_entries(r, [StartEntry(7)])
    sent = feed_chunk_by_chunk(r, token_ids)
    assert background.join() == "completed"
    assert output_text(check_stream(logged_events(r))) == TEXT
    hub_batches, thread_batches = _batches("hub") - hub_before, _batches("thread") - thread_before
    if token_source == "hub":
        assert (hub_batches, thread_batches) == (len(sent) + 1, 1)
    else:
        assert hub_batches == 0


@pytest.mark.parametrize("created_status", ["queued", "in_progress"])
def test_only_a_record_created_queued_is_marked_in_progress_at_the_start(
    r: redis.Redis,
    tokenizer: TextTokenizer,
    token_ids: list[int],
    monkeypatch: pytest.MonkeyPatch,
    created_status: str,
) -> None:
    """A background response's record moves to ``in_progress`` (with its in-progress object) when
    generation starts; a foreground one's starts there, so no round trip is spent marking it."""
    marked: list[str] = []
    evaluate = redis.Redis.eval

    def spied_eval(self: redis.Redis, script: str, *args: Any) -> Any:
        if script == records.MARK_IN_PROGRESS_LUA:
            marked.append(str(args[1]))
        return evaluate(self, script, *args)

    monkeypatch.setattr(redis.Redis, "eval", spied_eval)
    start_response(r, created_status)
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, len(token_ids), 4)])
    add_entries(r, [FinishEntry("stop", 7, len(token_ids))])
    assert postprocess(r, tokenizer) == "completed"
    events = logged_events(r)
    assert output_text(check_stream(events)) == TEXT
    in_progress = [event for event in events if event["type"] == types.IN_PROGRESS]
    assert len(in_progress) == 1 and in_progress[0]["response"]["status"] == "in_progress"
    assert marked == ([keys.record(RESPONSE_ID)] if created_status == "queued" else [])


def test_a_foreground_response_opened_by_the_api_gets_no_second_in_progress(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int]
) -> None:
    """The API logs a foreground response's ``response.in_progress`` with ``response.created``
    (:func:`api.submission.accept`): the post-processor's start then logs nothing, and its first
    event is numbered after both."""
    start_foreground_response(r)
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, len(token_ids), 4)])
    add_entries(r, [FinishEntry("stop", 7, len(token_ids))])
    assert postprocess(r, tokenizer) == "completed"
    events = logged_events(r)
    assert output_text(check_stream(events)) == TEXT
    assert [event["type"] for event in events].count(types.IN_PROGRESS) == 1
    assert events[2]["type"] == types.OUTPUT_ITEM_ADDED


@pytest.mark.parametrize("reply", ["common", "unexpected"])
def test_the_answers_last_events_and_its_final_record_go_in_one_round_trip(
    r: redis.Redis,
    tokenizer: TextTokenizer,
    token_ids: list[int],
    monkeypatch: pytest.MonkeyPatch,
    reply: str,
) -> None:
    """The items' closing events are logged in the pipeline that writes the final record (no
    FINALIZE of its own); a reply other than the common one sends the same events through the
    full append, which skips what the log holds: never an event twice."""
    finalized: list[object] = []
    evaluate = redis.Redis.eval

    def spied_eval(self: redis.Redis, script: str, *args: Any) -> Any:
        if script == records.FINALIZE_LUA:
            finalized.append("pipelined" if isinstance(self, redis.client.Pipeline) else "alone")
        return evaluate(self, script, *args)

    monkeypatch.setattr(redis.Redis, "eval", spied_eval)
    if reply == "unexpected":
        monkeypatch.setattr(event_log.StagedAppend, "settle", lambda self, reply: False)
    start_response(r, "in_progress")
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, len(token_ids), 4)])
    add_entries(r, [FinishEntry("stop", 7, len(token_ids))])
    assert postprocess(r, tokenizer) == "completed"
    events = logged_events(r)
    assert output_text(check_stream(events)) == TEXT  # consecutive numbers: nothing doubled
    assert [event["type"] for event in events][-4:] == [
        types.OUTPUT_TEXT_DONE,
        types.CONTENT_PART_DONE,
        types.OUTPUT_ITEM_DONE,
        types.COMPLETED,
    ]
    assert r.hget(keys.record(RESPONSE_ID), "status") == b"completed"
    assert finalized == ["pipelined"]  # the final record went out in the closing events' pipeline


def test_entries_read_twice_give_their_text_once(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int]
) -> None:
    expected = reference_events(r, tokenizer, token_ids)
    start_response(r)
    n = len(token_ids)
    # A stream holding repeats and overlaps, as after a loss and a resume.
    add_entries(
        r,
        [
            StartEntry(7),
            *chunks(token_ids, 0, 9, 3),
            StartEntry(7),
            *chunks(token_ids, 3, 9, 3),
            TokensEntry(token_ids[4:11], start=4),
            *chunks(token_ids, 11, n, 3),
            FinishEntry("stop", 7, n),
        ],
    )
    assert postprocess(r, tokenizer) == "completed"
    events = logged_events(r)
    final = check_stream(events)
    assert output_text(final) == deltas(events) == TEXT
    assert output_text(final) == output_text(expected[-1]["response"])


def test_a_stream_rewritten_after_a_loss_is_followed_without_repeats(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Redis loses the last tokens and events; the GPU worker regenerates the tokens (other
    chunks): the text is read once and the lost events come back byte for byte."""
    start_response(r)
    background = Background(r, tokenizer)
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, 6, 3)])
    wait_for(lambda: log_length(r) > 2, "the first events")
    kept_events = log_length(r)
    add_entries(r, chunks(token_ids, 6, 12, 3))  # the second that Redis will lose
    wait_for(lambda: log_length(r) > kept_events, "the events of the lost second")
    seen_by_clients = log_entries(r)
    keep_first(r, keys.tokens(RESPONSE_ID), 3)
    keep_first(r, keys.events(RESPONSE_ID), kept_events)
    n = len(token_ids)
    add_entries(
        r, [TokensEntry(token_ids[6:12], start=6), *chunks(token_ids, 12, n, 4), FinishEntry("stop", 7, n)]
    )
    assert background.join() == "completed"
    events = logged_events(r)
    final = check_stream(events)
    assert output_text(final) == deltas(events) == TEXT
    assert log_entries(r)[: len(seen_by_clients)] == seen_by_clients
    assert "(Redis came back older); logging them again" in caplog.text


def test_a_log_that_lost_more_than_the_writer_keeps_is_rebuilt(
    r: redis.Redis,
    tokenizer: TextTokenizer,
    token_ids: list[int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(event_log, "REPLAY_WINDOW_S", -1.0)  # keeps nothing
    start_response(r)
    background = Background(r, tokenizer)
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, 6, 3)])
    wait_for(lambda: log_length(r) > 2, "the first events")
    kept_events = log_length(r)
    add_entries(r, chunks(token_ids, 6, 12, 3))
    wait_for(lambda: log_length(r) > kept_events, "the events of the lost second")
    keep_first(r, keys.tokens(RESPONSE_ID), 3)
    keep_first(r, keys.events(RESPONSE_ID), kept_events)
    n = len(token_ids)
    add_entries(r, [TokensEntry(token_ids[6:n], start=6), FinishEntry("stop", 7, n)])
    assert background.join() == "completed"
    events = logged_events(r)
    assert output_text(check_stream(events)) == deltas(events) == TEXT
    assert "went back in time" in caplog.text


def test_entries_below_the_read_cursor_are_found_by_reading_again(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Across a loss, Redis' clock (the entry ids) may go back: regenerated entries then sort
    below the reader's cursor, and the next one it sees starts past what it consumed."""
    start_response(r)
    background = Background(r, tokenizer)
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, 3, 3)], ids=["1000-0", "1001-0"])
    wait_for(lambda: log_length(r) > 2, "the first events")
    logged = log_length(r)
    add_entries(r, chunks(token_ids, 3, 6, 3), ids=["5000-0"])  # read, then lost
    wait_for(lambda: log_length(r) > logged, "their events")
    keep_first(r, keys.tokens(RESPONSE_ID), 2)
    n = len(token_ids)
    add_entries(r, chunks(token_ids, 3, 9, 3), ids=["2000-0", "2001-0"])  # regenerated: below the cursor
    add_entries(r, [*chunks(token_ids, 9, n, 3), FinishEntry("stop", 7, n)])
    assert background.join() == "completed"
    events = logged_events(r)
    assert output_text(check_stream(events)) == deltas(events) == TEXT
    assert "reading it again from the start" in caplog.text


def test_tokens_missing_from_the_whole_stream_fail_the_response_cleanly(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int]
) -> None:
    start_response(r)
    add_entries(
        r,
        [
            StartEntry(7),
            *chunks(token_ids, 0, 6, 3),
            *chunks(token_ids, 9, 12, 3),
            FinishEntry("stop", 7, 12),
        ],
    )
    assert postprocess(r, tokenizer) == "failed"
    events = logged_events(r)
    final = check_stream(events)
    assert events[-1]["type"] == types.FAILED
    assert final["error"]["code"] == "server_error" and "lost tokens" in final["error"]["message"]
    assert output_text(final) == deltas(events) == tokenizer.decode(token_ids[:6])
    assert final["output"][0]["status"] == "incomplete"
    assert r.hget(keys.record(RESPONSE_ID), "status") == b"failed"
    assert r.exists(keys.cancel(RESPONSE_ID))  # the GPU worker stops generating it


def test_tokens_regenerated_differently_fail_the_response_cleanly(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int]
) -> None:
    """Sampling regenerated other tokens than those already streamed: no text follows both."""
    start_response(r)
    background = Background(r, tokenizer)
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, 6, 3)])
    wait_for(lambda: log_length(r) > 2, "the first events")
    keep_first(r, keys.tokens(RESPONSE_ID), 2)  # tokens 3..5 lost (their events were not)
    other = [token for token in tokenizer.encode(" Bonjour") if token not in token_ids[3:6]]
    assert other
    add_entries(r, [TokensEntry(other, start=3)])
    assert background.join() == "failed"
    events = logged_events(r)
    final = check_stream(events)
    assert "rewritten" in final["error"]["message"]
    assert output_text(final) == deltas(events)


def test_events_redis_keeps_refusing_fail_the_response_cleanly(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Appends refused (injected), the failure itself accepted: ``response.failed``, nothing after."""
    refuse = "resq-test:refuse-appends"
    for script in ("APPEND_LUA", "APPEND_MANY_LUA"):  # a writer's own appends, and the hub's rounds
        monkeypatch.setattr(
            event_log,
            script,
            f"if redis.call('EXISTS', '{refuse}') == 1 then\n"
            "  return redis.error_reply('OOM command not allowed when used memory > maxmemory (injected)')\n"
            "end\n" + getattr(event_log, script),
        )
    refusing_hub = None
    if SOURCES.get("current") is not None:  # a hub whose rounds' script is the refusing one too
        SOURCES["current"] = refusing_hub = TokenStreamHub(r, block_ms=200)
    try:
        start_response(r)
        background = Background(r, tokenizer)
        add_entries(r, [StartEntry(7), *chunks(token_ids, 0, 6, 3)])
        wait_for(lambda: log_length(r) > 2, "the first events")
        r.set(refuse, "1")
        add_entries(r, chunks(token_ids, 6, 9, 3))
        assert background.join() == "failed"
        events = logged_events(r)
        final = check_stream(events)
        assert final["error"]["code"] == "server_error"
        # The refused batch went out with the failure: the text is what was read, once.
        assert output_text(final) == deltas(events) == tokenizer.decode(token_ids[:9])
        assert events[-1]["type"] == types.FAILED
        assert r.hget(keys.record(RESPONSE_ID), "status") == b"failed"
        length = log_length(r)
        r.delete(refuse)
        add_entries(r, [*chunks(token_ids, 9, len(token_ids), 3), FinishEntry("stop", 7, len(token_ids))])
        assert postprocess(r, tokenizer) == "done"  # a later post-processor adds nothing
        assert log_length(r) == length
    finally:
        if refusing_hub is not None:
            refusing_hub.close()


def test_out_of_memory_leaves_no_gap_and_a_takeover_finishes(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int]
) -> None:
    """Redis out of memory refuses the events and the failure alike: the post-processor stops
    with the log as it was; once memory is back, a takeover goes on from there."""
    start_response(r)
    background = Background(r, tokenizer)
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, 6, 3)])
    wait_for(lambda: log_length(r) > 2, "the first events")
    before = log_entries(r)
    pipe = r.pipeline(transaction=True)  # the tokens land, then nothing can be written
    pipe.xadd(keys.tokens(RESPONSE_ID), encode_entry(TokensEntry(token_ids[6:9], start=6)))
    pipe.config_set("maxmemory", 1)
    pipe.execute()
    with pytest.raises(RedisRefusedError, match="OutOfMemoryError"):
        background.join()
    assert log_entries(r) == before
    r.config_set("maxmemory", 0)
    n = len(token_ids)
    add_entries(r, [*chunks(token_ids, 9, n, 3), FinishEntry("stop", 7, n)])
    assert postprocess(r, tokenizer) == "completed"
    events = logged_events(r)
    assert output_text(check_stream(events)) == deltas(events) == TEXT


# --- the end: index entries, terminal event and the token stream's removal --------------------------


def stored_by(r: redis.Redis, owner: str) -> None:
    """Make the response a stored one of ``owner`` (its output items get index entries)."""
    r.hset(keys.record(RESPONSE_ID), mapping={"store": "1", "owner": owner})


def test_the_end_indexes_logs_and_drops_the_tokens_in_one_round_trip(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the final record, the output's index entries, the terminal event and the removal of
    the token stream go in one pipeline (three round trips before, on every response)."""
    start_response(r, "in_progress")
    stored_by(r, "alice")
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, len(token_ids), 4)])
    add_entries(r, [FinishEntry("stop", 7, len(token_ids))])
    stepwise: list[str] = []
    monkeypatch.setattr(runner._Run, "_index_output", lambda self, output: stepwise.append("index"))
    delete = redis.Redis.delete

    def spied_delete(self: redis.Redis, *names: Any) -> Any:
        stepwise.append("delete")
        return delete(self, *names)

    monkeypatch.setattr(redis.Redis, "delete", spied_delete)
    assert postprocess(r, tokenizer) == "completed"
    assert stepwise == []
    events = logged_events(r)
    assert output_text(check_stream(events)) == TEXT and events[-1]["type"] == types.COMPLETED
    assert r.exists(keys.tokens(RESPONSE_ID)) == 0
    items = events[-1]["response"]["output"]
    assert items and all(
        r.lrange(keys.item_holders("alice", item["id"]), 0, -1) == [f"{RESPONSE_ID} o".encode()]
        for item in items
    )


@pytest.mark.parametrize("end", ["one round", "step by step"])
def test_the_lease_is_released_along_the_terminal_event_when_the_end_goes_in_one_round(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int], monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """The post-processor's lease goes in the terminal event's round trip (no release of its own);
    when that round trip did not log the terminal event (finished step by step), the lease stays
    for the usual release, which still drops it."""
    if end == "step by step":
        refuse = "return redis.error_reply('refused here')"
        monkeypatch.setattr(event_log.StagedAppend, "queue", lambda self, pipe: pipe.eval(refuse, 0))
    start_response(r, "in_progress")
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, len(token_ids), 4)])
    add_entries(r, [FinishEntry("stop", 7, len(token_ids))])
    leases = PostprocessLeases(r, "pp-1", lease_s=30)
    r.script_load(RELEASE_ENDED_LUA)  # what the first release of a worker does (tests/unit/test_recovery.py)
    assert leases.take(RESPONSE_ID)
    along = leases.release_along(RESPONSE_ID)
    status = runner.run_postprocess(
        r,
        cast(ModelCatalog, Catalog(tokenizer)),
        Settings(),
        RESPONSE_ID,
        tokens=SOURCES.get("current"),
        along=along,
    )
    assert status == "completed"
    assert along.released == (end == "one round")
    assert (r.hget(keys.POSTPROCESS_LEASE_HOLDERS, RESPONSE_ID) is None) == (end == "one round")
    leases.release(RESPONSE_ID, along)
    assert r.zcard(keys.POSTPROCESS_LEASES) == 0 and r.hlen(keys.POSTPROCESS_LEASE_HOLDERS) == 0
    assert output_text(check_stream(logged_events(r))) == TEXT


def test_an_error_in_the_one_round_end_is_finished_step_by_step_without_a_second_terminal_event(
    r: redis.Redis, tokenizer: TextTokenizer, token_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "DELETE_ENDED_TOKENS_LUA", "return redis.error_reply('refused here')")
    start_response(r, "in_progress")
    stored_by(r, "alice")
    add_entries(r, [StartEntry(7), *chunks(token_ids, 0, len(token_ids), 4)])
    add_entries(r, [FinishEntry("stop", 7, len(token_ids))])
    assert postprocess(r, tokenizer) == "completed"
    events = logged_events(r)
    assert [event["type"] for event in events].count(types.COMPLETED) == 1
    assert output_text(check_stream(events)) == TEXT
    assert r.exists(keys.tokens(RESPONSE_ID)) == 0
    item = events[-1]["response"]["output"][0]
    assert r.lrange(keys.item_holders("alice", item["id"]), 0, -1) == [f"{RESPONSE_ID} o".encode()]


@pytest.mark.parametrize("last", [types.OUTPUT_TEXT_DELTA, types.COMPLETED])
def test_the_token_stream_is_dropped_only_after_a_terminal_event(r: redis.Redis, last: str) -> None:
    """A takeover that finds no terminal event reads the token stream again: it must still be there."""
    new_log(r)
    r.xadd(keys.events(RESPONSE_ID), {"type": last, "data": b"{}"}, id=keys.event_entry_id(1))
    add_entries(r, [StartEntry(7)])
    r.eval(
        runner.DELETE_ENDED_TOKENS_LUA,
        2,
        keys.events(RESPONSE_ID),
        keys.tokens(RESPONSE_ID),
        *sorted(types.TERMINAL_TYPES),
    )
    assert r.exists(keys.tokens(RESPONSE_ID)) == (0 if last == types.COMPLETED else 1)


def test_a_rounds_appends_in_one_call_do_what_each_append_does(r: redis.Redis) -> None:
    """:class:`SharedAppends` (the hub's round): per log, the same reply and the same log as
    :data:`event_log.APPEND_LUA` on its own: appended, partly held already, a hole, a log gone."""

    def event(number: int) -> EncodedEvent:
        return EncodedEvent(number, "response.output_text.delta", b'{"n":%d}' % number)

    def prepare(prefix: str) -> list[tuple[str, list[EncodedEvent]]]:
        cases = {"fresh": (2, [2, 3]), "partly": (3, [1, 2, 3, 4]), "hole": (1, [3, 4]), "gone": (-1, [0])}
        appends = []
        for name, (held, numbers) in cases.items():
            key = f"{prefix}:{name}"
            r.delete(key)
            for number in range(max(held, 0)):
                r.xadd(key, {"type": "x", "data": b"%d" % number}, id=keys.event_entry_id(number))
            appends.append((key, [event(number) for number in numbers]))
        return appends

    alone = r.register_script(event_log.APPEND_LUA)
    one_by_one = [
        int(alone(keys=[key], args=[events[0].sequence_number, *event_log._pairs(events)]))
        for key, events in prepare("resq-test:append-alone")
    ]
    shared = event_log.SharedAppends(r.register_script(event_log.APPEND_MANY_LUA))
    together = prepare("resq-test:append-shared")
    for key, events in together:
        shared.add(key, events)
    assert len(shared) == 4
    assert shared.send() == one_by_one == [2, 3, 1, -1]
    for name in ("fresh", "partly", "hole", "gone"):
        assert [fields for _, fields in r.xrange(f"resq-test:append-alone:{name}")] == [
            fields for _, fields in r.xrange(f"resq-test:append-shared:{name}")
        ]
    assert r.xlen("resq-test:append-shared:fresh") == 4 and r.xlen("resq-test:append-shared:partly") == 5
    assert r.xlen("resq-test:append-shared:hole") == 1 and not r.exists("resq-test:append-shared:gone")
    assert event_log.SharedAppends(r.register_script(event_log.APPEND_MANY_LUA)).send() == []
