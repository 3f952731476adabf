"""Leases of post-processors on responses: who turns a response's tokens into events.

The API registers a lease, not yet taken, when it accepts a response; the
post-processor that starts on it takes the lease and renews it (one script call
every third of ``RESQ_POSTPROCESS_LEASE_S`` for all the responses of a process).
When a post-processor dies its leases lapse, and the reaper of any process able
to post-process takes them over: the taker rebuilds the state from the token
stream and skips the events already logged (:mod:`resq.postprocess.runner`).
A lease registered but never taken lapses too, so a lost ``postprocess``
message, or an API that died before it started its inline post-processor, is
covered the same way.

Lease times are Redis server time (``TIME``), so hosts' clocks do not matter.
A post-processor that finds it lost a lease (it was paused for longer than the
lease) stops; if it still appends meanwhile, the event log refuses duplicates.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Final

from redis import Redis
from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.client import Pipeline
from redis.exceptions import NoScriptError, RedisError

from resq import keys
from resq.events import types
from resq.records import LOG_ENDED_LUA

log = logging.getLogger(__name__)

_NOW_MS: Final = "local t = redis.call('TIME'); local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

REGISTER_LUA: Final = (
    _NOW_MS
    + """
-- KEYS: leases, holders; ARGV: response id, lease ms. A lease nobody holds yet.
redis.call('ZADD', KEYS[1], 'NX', now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSETNX', KEYS[2], ARGV[1], '')
return 1
"""
)

ACQUIRE_LUA: Final = (
    _NOW_MS
    + """
-- KEYS: leases, holders; ARGV: response id, holder, lease ms.
-- Taken when nobody holds it, when the holder is the caller, or when it lapsed.
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
local holder = redis.call('HGET', KEYS[2], ARGV[1])
if expiry and holder and holder ~= '' and holder ~= ARGV[2] and tonumber(expiry) > now then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""
)

RENEW_LUA: Final = (
    _NOW_MS
    + """
-- KEYS: leases, holders; ARGV: holder, lease ms, response ids. Returns the ids no longer held.
local lost = {}
for index = 3, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[index]) == ARGV[1] then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[index])
  else
    table.insert(lost, ARGV[index])
  end
end
return lost
"""
)

RELEASE_LUA: Final = """
-- KEYS: leases, holders; ARGV: response id, holder. The response needs no post-processor any more.
if redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 1
end
return 0
"""

RELEASE_ENDED_LUA: Final = (
    LOG_ENDED_LUA
    + """
-- KEYS: leases, holders, the event log; ARGV: response id, holder, the terminal event types.
-- RELEASE_LUA, only once the log ends with a terminal event: it rides on the post-processor's
-- last writes, which may not all have landed. Returns 1 released, 0 not.
if not log_ended(KEYS[3], 3) or redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""
)

LAPSED_LUA: Final = (
    _NOW_MS
    + """
-- KEYS: leases; ARGV: most ids to return. Responses whose lease lapsed, oldest first.
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
"""
)

_LEASE_KEYS: Final = [keys.POSTPROCESS_LEASES, keys.POSTPROCESS_LEASE_HOLDERS]


def register_lease(pipe: AsyncPipeline, response_id: str, lease_s: float) -> None:
    """Queue the registration of a new response's lease, not yet taken (the API, before it
    records the response)."""
    pipe.eval(REGISTER_LUA, 2, *_LEASE_KEYS, response_id, int(lease_s * 1000))


class PostprocessLeases:
    """The leases one post-processing process holds, renewed by a thread of its own."""

    def __init__(self, redis: Redis, holder_id: str, lease_s: float) -> None:
        self.holder_id = holder_id
        self._redis = redis
        self._lease_ms = int(lease_s * 1000)
        self._renew_every_s = lease_s / 3
        self._acquire = redis.register_script(ACQUIRE_LUA)
        self._renew = redis.register_script(RENEW_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._release_ended = redis.register_script(RELEASE_ENDED_LUA)
        self._lapsed = redis.register_script(LAPSED_LUA)
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-renewal", daemon=True)

    def start(self) -> None:
        """Load the release-along script, and start renewing.

        Loaded up front, a response's release rides on its terminal event from the first response
        on: otherwise the first one's ``NOSCRIPT`` would release it in a round trip after the
        terminal event, which a client may see before the lease is dropped. After a Redis restart
        that is still the fallback (:meth:`release` loads the script again).
        """
        try:
            self._redis.script_load(RELEASE_ENDED_LUA)
        except RedisError as error:
            log.warning("could not load the lease release script now (%s); it loads on first use", error)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing (the leases still held lapse, and others take the responses over)."""
        self._stop.set()

    @property
    def held_count(self) -> int:
        """Responses this process post-processes now."""
        with self._lock:
            return len(self._held)

    def take(self, response_id: str) -> bool:
        """Take the lease of ``response_id``; False when a live post-processor (this one included) holds it."""
        return self.take_along(response_id, lambda _pipe: None)[0]

    def take_along(
        self, response_id: str, stage: Callable[[Pipeline], None]
    ) -> tuple[bool, list[Any] | None]:
        """:meth:`take`, with the commands ``stage`` queues sent in the same round trip, after it.

        Returns whether the lease was taken and, when it was, the replies of those commands (None
        when any of them failed, or the script had to be loaded first: the caller reads again).
        """
        if self.holds(response_id):  # a duplicate message: this process already works on it
            return False, None
        pipe = self._redis.pipeline(transaction=False)
        # By sha, not through the Script object: redis-py would add a SCRIPT EXISTS round trip.
        pipe.evalsha(
            self._acquire.sha, len(_LEASE_KEYS), *_LEASE_KEYS, response_id, self.holder_id, self._lease_ms
        )
        stage(pipe)
        taken, *replies = pipe.execute(raise_on_error=False)
        reads_valid = True
        if isinstance(taken, NoScriptError):
            # Redis restarted without its scripts: the Script object loads it. The reads ran
            # before the lease was taken, so they are left to the caller to make again.
            taken = self._acquire(keys=_LEASE_KEYS, args=[response_id, self.holder_id, self._lease_ms])
            reads_valid = False
        elif isinstance(taken, Exception):
            raise taken
        if not taken:
            return False, None
        with self._lock:
            self._held.add(response_id)
        reads_valid = reads_valid and not any(isinstance(reply, Exception) for reply in replies)
        return True, replies if reads_valid else None

    def holds(self, response_id: str) -> bool:
        """Whether this process still holds the lease (renewal did not find it taken over)."""
        with self._lock:
            return response_id in self._held

    def release(self, response_id: str, along: ReleaseAlong | None = None) -> None:
        """The response is done: drop the lease (unless ``along`` released it already)."""
        with self._lock:
            self._held.discard(response_id)
        if along is None or not along.released:
            self._release(keys=_LEASE_KEYS, args=[response_id, self.holder_id])
        if along is not None and along.script_missing:
            # Loaded now (after a start, or a Redis restart) for the releases that follow.
            self._redis.script_load(RELEASE_ENDED_LUA)

    def release_along(self, response_id: str) -> ReleaseAlong:
        """The release of ``response_id``'s lease, to send with its post-processor's last writes
        (then :meth:`release` needs no round trip of its own)."""
        return ReleaseAlong(self._release_ended.sha, self.holder_id, response_id)

    def abandon(self, response_id: str) -> None:
        """Stop renewing without releasing: the lease lapses and another post-processor retries."""
        with self._lock:
            self._held.discard(response_id)

    def lapsed(self, limit: int) -> list[str]:
        """Responses whose lease lapsed (candidates for a takeover), oldest first."""
        return [member.decode() for member in self._lapsed(keys=[keys.POSTPROCESS_LEASES], args=[limit])]

    def renew_now(self) -> None:
        """Renew every lease held; forget those another process took over."""
        with self._lock:
            held = sorted(self._held)
        if not held:
            return
        lost = self._renew(keys=_LEASE_KEYS, args=[self.holder_id, self._lease_ms, *held])
        if lost:
            names = [member.decode() for member in lost]
            log.warning("leases taken over by other post-processors: %s", ", ".join(names))
            with self._lock:
                self._held.difference_update(names)

    def _run(self) -> None:
        while not self._stop.wait(self._renew_every_s):
            try:
                self.renew_now()
            except Exception:  # Redis may be restarting: keep renewing
                log.warning("renewing post-process leases failed; retrying", exc_info=True)


class ReleaseAlong:
    """A lease's release queued on a response's last writes (:meth:`PostprocessLeases.release_along`).

    It releases only once the response's event log ends with a terminal event, so it may go out
    with the terminal event itself: when that write fails, the lease stays, and
    :meth:`PostprocessLeases.release` sends the usual release after the post-processor's retries.
    """

    def __init__(self, script_sha: str, holder_id: str, response_id: str) -> None:
        self._script_sha = script_sha
        self._holder_id = holder_id
        self._response_id = response_id
        self.released = False
        """Whether the queued release went through (the lease is dropped in Redis)."""
        self.script_missing = False
        """Redis did not know the script (``NOSCRIPT``): :meth:`PostprocessLeases.release` loads it."""

    def queue(self, pipe: Pipeline) -> None:
        """Queue the release on ``pipe``, by the script's sha (no ``SCRIPT EXISTS`` round trip; a
        ``NOSCRIPT`` reply after a Redis restart leaves it to :meth:`PostprocessLeases.release`)."""
        pipe.evalsha(
            self._script_sha,
            3,
            *_LEASE_KEYS,
            keys.events(self._response_id),
            self._response_id,
            self._holder_id,
            *types.TERMINAL_TYPES_LISTED,
        )

    def settle(self, reply: object) -> None:
        """Take the queued release's reply (an exception when it failed)."""
        self.released = reply == 1
        self.script_missing = isinstance(reply, NoScriptError)
