"""Writing a response's event log: exactly once, without gaps, through Redis refusals.

Every write to an event log goes through here (the API's first events too,
:func:`stage_first_events`); the API's relay (:mod:`api.relay`) is its one reader.

Events are appended with the ids ``0-<sequence_number + 1>`` by one Lua script per batch
(:data:`APPEND_LUA`), which looks at the log's last event first:

- events the log already holds (another post-processor, or a retry whose reply was lost,
  logged them) are skipped: a duplicate is a count, not an error;
- events that would land after a hole are not written: the log lost events (Redis came
  back older than the writer, e.g. ``appendfsync everysec`` and a crash). The writer
  appends them again from what it logged in the last :data:`REPLAY_WINDOW_S` seconds,
  the same bytes that clients may already have, or raises :class:`LogRewoundError` when it no
  longer has them (the runner then rebuilds everything from the token stream).

Every other error (out of memory under ``noeviction``, a read-only replica, a lost
connection past redis-py's own retries) is retried with a bounded backoff
(:class:`Backoff`); past it :class:`RedisRefusedError` is raised and nothing of the batch is in
the log (a script's first write is the one Redis refuses under OOM, so a batch lands
whole or not at all). The runner then fails the response cleanly, or leaves it to a
takeover when even that cannot be written: no event is ever logged after a missing one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from redis import Redis
from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.client import Pipeline
from redis.commands.core import Script
from redis.exceptions import RedisError

from resq import keys
from resq.events.emitter import EncodedEvent
from resq.postprocess import metrics
from resq.records import EVENT_LOG_LENGTH_LUA, FAIL_LUA

log = logging.getLogger(__name__)


def stage_first_events(
    pipe: Pipeline | AsyncPipeline, response_id: str, events: list[EncodedEvent], ttl_s: int
) -> None:
    """Queue on ``pipe`` the log's first events (the API's, in the step that records the response).

    The log exists from then on: a post-processor refuses to write to a log that is gone
    (the response was deleted).
    """
    for event in events:
        pipe.xadd(
            keys.events(response_id),
            {"type": event.type, "data": event.data},
            id=keys.event_entry_id(event.sequence_number),
        )
    pipe.expire(keys.events(response_id), ttl_s)


T = TypeVar("T")

REPLAY_WINDOW_S = 30.0
"""How long the writer keeps the events it logged, to append them again if Redis loses them.
``appendfsync everysec`` loses at most a second or two; a lagging replica promoted may lose more."""

_APPEND_EVENTS_LUA = """
-- Appends to the event log `key` the events of ARGV[from..to] (type/data pairs, numbered from
-- `first`) that it does not hold yet, right after its last one. Returns how many events the log
-- held before: below `first` nothing was written (appending would leave a gap); -1: the log is
-- gone (the response was deleted; a missing log must not come back).
local function append_events(key, first, from, to)
  local count = event_log_length(key)
  if count < first then
    return count
  end
  for index = from, to, 2 do
    local number = first + (index - from) / 2
    if number >= count then
      redis.call('XADD', key, '0-' .. (number + 1), 'type', ARGV[index], 'data', ARGV[index + 1])
    end
  end
  return count
end
"""

APPEND_LUA = (
    EVENT_LOG_LENGTH_LUA
    + _APPEND_EVENTS_LUA
    + """
-- KEYS[1] event log; ARGV[1] sequence number of the first event; ARGV[2..] type/data pairs.
return append_events(KEYS[1], tonumber(ARGV[1]), 2, #ARGV)
"""
)

APPEND_MANY_LUA = (
    EVENT_LOG_LENGTH_LUA
    + _APPEND_EVENTS_LUA
    + """
-- KEYS: event logs; ARGV, for each log in turn: the sequence number of its first event, n, then
-- its n events' type/data pairs. Returns, per log, what APPEND_LUA returns for it.
local replies = {}
local at = 1
for log = 1, #KEYS do
  local count = tonumber(ARGV[at + 1])
  replies[log] = append_events(KEYS[log], tonumber(ARGV[at]), at + 2, at + 1 + 2 * count)
  at = at + 2 + 2 * count
end
return replies
"""
)
"""The appends of several logs as one script: one command and one reply for a round of them, and
one execution unit, so a reader blocked on those logs wakes once for all of them."""


class RedisRefusedError(Exception):
    """Redis kept refusing a write past the retries (out of memory, read-only, unreachable)."""


class LogRewoundError(Exception):
    """The event log lost events that this writer can no longer append again."""

    def __init__(self, key: str, length: int, expected: int) -> None:
        super().__init__(f"{key} holds {length} events, {expected} were logged")
        self.length = length


@dataclass(frozen=True, slots=True)
class Backoff:
    """How often, and how patiently, a refused write is tried again."""

    attempts: int = 8
    first_delay_s: float = 0.05
    max_delay_s: float = 2.0
    """The defaults wait about 5 s in all, then give up."""

    def delays(self) -> Iterator[float]:
        """The waits between attempts (one fewer than ``attempts``)."""
        delay = self.first_delay_s
        for _ in range(self.attempts - 1):
            yield delay
            delay = min(delay * 2, self.max_delay_s)


def retrying(
    write: Callable[[], T], what: str, backoff: Backoff, sleep: Callable[[float], None] = time.sleep
) -> T:
    """``write()``, tried again on every Redis error (it must be idempotent).

    Raises :class:`RedisRefusedError` once ``backoff`` is spent.
    """
    delays = backoff.delays()
    while True:
        try:
            return write()
        except RedisError as error:
            delay = next(delays, None)
            reason = f"{type(error).__name__}: {error}"
            if delay is None:
                raise RedisRefusedError(f"Redis refused {what} {backoff.attempts} times: {reason}") from error
            log.warning("Redis refused %s (%s); retrying in %.2fs", what, reason, delay)
            sleep(delay)


@dataclass(frozen=True, slots=True)
class Ending:
    """How a response ends when its post-processor gives up: one variant per status it can end in."""

    failed_json: bytes
    failed_event: EncodedEvent
    cancelled_json: bytes
    """Used when the response was cancelled meanwhile (a terminal status is never overwritten)."""
    cancelled_event: EncodedEvent
    ttl_s: int
    cancel_flag_ttl_s: int


class EventLogWriter:
    """Appends the events of one response, each exactly once and never after a hole."""

    def __init__(
        self,
        redis: Redis,
        response_id: str,
        already_logged: int,
        backoff: Backoff | None = None,
        replay_window_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._redis = redis
        self._response_id = response_id
        self._key = keys.events(response_id)
        self.already_logged = already_logged
        """Events the log held when this writer started (a takeover's processor re-emits them first)."""
        self._next = already_logged
        self._backoff = backoff or Backoff()
        self._window_s = REPLAY_WINDOW_S if replay_window_s is None else replay_window_s
        self._clock = clock
        self._sleep = sleep
        self._recent: deque[tuple[float, EncodedEvent]] = deque()
        self._append = redis.register_script(APPEND_LUA)
        self._fail = redis.register_script(FAIL_LUA)

    def append(self, events: list[EncodedEvent]) -> None:
        """Log ``events`` (consecutive, in order) in one round trip; see the module for the errors."""
        fresh = self._unlogged(events)
        if not fresh:
            return
        first, last = fresh[0].sequence_number, fresh[-1].sequence_number
        what = f"events {first}..{last} of {self._key}"

        def write(batch: list[EncodedEvent]) -> int:
            return int(self._append(keys=[self._key], args=[batch[0].sequence_number, *_pairs(batch)]))

        length = retrying(lambda: write(fresh), what, self._backoff, self._sleep)
        if 0 <= length < first:
            replayed = self._replay(length, first)
            log.warning(
                "%s lost events %d..%d (Redis came back older); logging them again",
                self._key,
                length,
                first - 1,
            )
            batch = replayed + fresh
            length = retrying(lambda: write(batch), what, self._backoff, self._sleep)
            if 0 <= length < batch[0].sequence_number:  # lost even more meanwhile
                raise LogRewoundError(self._key, length, first)
            first = batch[0].sequence_number
        if length < 0:
            log.info("%s is gone (the response was deleted); not logging", self._key)
            return
        if length > fresh[0].sequence_number:
            already = min(length, last + 1) - fresh[0].sequence_number
            log.info("%d events of %s were logged already (another post-processor)", already, self._key)
        self._committed(fresh, max(0, last + 1 - max(length, first)))

    def stage(self, events: list[EncodedEvent]) -> StagedAppend | None:
        """:meth:`append`'s common case, to be sent in a pipeline that other logs' appends share.

        None when there is nothing to write. The staged append commits only when the log held
        exactly the events before it; on any other reply (a hole, a duplicate, a deleted log, an
        error) nothing is changed here and the caller logs the same events with :meth:`append`,
        which handles every case (the script skips what the log already holds).
        """
        fresh = self._unlogged(events)
        return StagedAppend(self, fresh) if fresh else None

    def _unlogged(self, events: list[EncodedEvent]) -> list[EncodedEvent]:
        """The events past what this writer logged (those before it are only remembered)."""
        self._remember([event for event in events if event.sequence_number < self._next])
        return [event for event in events if event.sequence_number >= self._next]

    def _committed(self, fresh: list[EncodedEvent], written: int) -> None:
        """``fresh`` is in the log now, ``written`` of them by this write."""
        self._next = fresh[-1].sequence_number + 1
        self._remember(fresh)
        metrics.note_events_logged(written)

    def end(self, unlogged: list[EncodedEvent], closing: list[EncodedEvent], ending: Ending) -> str:
        """Log ``unlogged`` (events a refused :meth:`append` left out), then ``closing`` and the
        terminal event, and finalise the record: all in one step, or nothing.

        Returns the status it ended as (``failed`` or ``cancelled``), ``missing``, ``final`` when
        another post-processor finished the response, or ``moved`` when one logged further.
        Raises :class:`RedisRefusedError`, and :class:`LogRewoundError` when the log lost events this
        writer no longer has.
        """
        pending = [event for event in unlogged if event.sequence_number >= self._next]
        fresh = pending + closing
        first = self._next
        if (fresh[0].sequence_number if fresh else ending.failed_event.sequence_number) != first:
            raise RuntimeError(f"the end of {self._key} does not follow its events (at {first})")
        # The log may already hold the unlogged events (a reply lost), never the closing ones.
        limit = first + len(pending)
        what = f"the end of {self._key}"
        args_keys = [
            self._key,
            keys.record(self._response_id),
            keys.input_items(self._response_id),
            keys.cancel(self._response_id),
        ]
        variants: list[str | bytes] = [
            ending.failed_json,
            ending.failed_event.type,
            ending.failed_event.data,
            ending.cancelled_json,
            ending.cancelled_event.type,
            ending.cancelled_event.data,
        ]

        def write(batch: list[EncodedEvent], batch_first: int) -> tuple[str, int]:
            outcome, length = self._fail(
                keys=args_keys,
                args=[
                    batch_first,
                    limit,
                    len(batch),
                    *_pairs(batch),
                    ending.ttl_s,
                    ending.cancel_flag_ttl_s,
                    *variants,
                ],
            )
            return outcome.decode(), int(length)

        outcome, length = retrying(lambda: write(fresh, first), what, self._backoff, self._sleep)
        if outcome == "moved" and length < first:
            replayed = self._replay(length, first)
            outcome, length = retrying(
                lambda: write(replayed + fresh, length), what, self._backoff, self._sleep
            )
            if outcome == "moved" and length < first:
                raise LogRewoundError(self._key, length, first)
        return outcome

    # --- internals -----------------------------------------------------------------------------

    def _replay(self, length: int, first: int) -> list[EncodedEvent]:
        """The events ``length .. first - 1`` as this writer logged them, or :class:`LogRewoundError`."""
        replay = [event for _, event in self._recent if length <= event.sequence_number < first]
        if [event.sequence_number for event in replay] != list(range(length, first)):
            raise LogRewoundError(self._key, length, first)
        return replay

    def _remember(self, events: list[EncodedEvent]) -> None:
        # Kept: the events this writer logged, and those below what the log held when it
        # started (another post-processor logged them; this processor re-emits them the same).
        now = self._clock()
        last = self._recent[-1][1].sequence_number if self._recent else -1
        self._recent.extend((now, event) for event in events if event.sequence_number > last)
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()


class StagedAppend:
    """One log's append in a shared pipeline (:meth:`EventLogWriter.stage`)."""

    def __init__(self, writer: EventLogWriter, events: list[EncodedEvent]) -> None:
        self._writer = writer
        self.events = events
        """The events to log (consecutive, all past what the writer logged)."""

    def queue(self, pipe: Pipeline) -> None:
        """Queue the append on ``pipe`` (by the script's sha: no ``SCRIPT EXISTS`` round trip per
        pipeline; after a Redis restart the ``NOSCRIPT`` reply sends the events to :meth:`append`)."""
        writer = self._writer
        pipe.evalsha(writer._append.sha, 1, writer._key, self.events[0].sequence_number, *_pairs(self.events))

    def join(self, shared: SharedAppends) -> None:
        """Add the append to ``shared``, whose one script call appends to every log it holds."""
        shared.add(self._writer._key, self.events)

    def settle(self, reply: object) -> bool:
        """Commit on the common reply (the log held exactly the events before); False otherwise."""
        if reply != self.events[0].sequence_number:
            return False
        self._writer._committed(self.events, len(self.events))
        return True


class SharedAppends:
    """Appends to several event logs, sent as one :data:`APPEND_MANY_LUA` call (the post-process
    hub's round: one command, one reply and one wake-up of the API's hub for all of them, where a
    transaction of one ``EVALSHA`` per log cost a queued reply per log and a call per log)."""

    def __init__(self, script: Script) -> None:
        """``script``: :data:`APPEND_MANY_LUA`, registered with the client that sends it."""
        self._script = script
        self._keys: list[str] = []
        self._args: list[str | bytes | int] = []

    def add(self, key: str, events: list[EncodedEvent]) -> None:
        """Append ``events`` (consecutive, numbered from the first one's) to the log at ``key``."""
        self._keys.append(key)
        self._args += [events[0].sequence_number, len(events), *_pairs(events)]

    def __len__(self) -> int:
        return len(self._keys)

    def send(self) -> list[int]:
        """Append them all; each log's reply as :data:`APPEND_LUA` gives it, in the order added.

        One round trip (a ``NOSCRIPT`` after a Redis restart loads the script and sends it again,
        which is safe: an append skips the events its log holds). Raises what Redis raises; a
        script that fails appends nothing after the failing log, and a retry of any of them
        finds what was written.
        """
        if not self._keys:
            return []
        return [int(reply) for reply in self._script(keys=self._keys, args=self._args)]


def _pairs(events: list[EncodedEvent]) -> list[str | bytes]:
    pairs: list[str | bytes] = []
    for event in events:
        pairs += [event.type, event.data]
    return pairs
