"""Per-API-key rate limit: a token bucket in Redis, shared by every API replica.

Each key's bucket holds up to ``RESQ_RATE_LIMIT_RPM`` tokens (a minute's worth
of burst) and refills at ``RPM / 60`` tokens a second; every ``/v1`` request
takes one. The bucket is one hash updated by one Lua script on Redis's own clock,
so replicas never race and never disagree about time. It expires once it would
be full again, which is the same as not existing.
"""

from __future__ import annotations

from typing import Final

from redis.asyncio import Redis

from api.caller import Caller
from resq import keys

TOKEN_BUCKET_LUA: Final = """
-- KEYS[1] bucket; ARGV: capacity (tokens), refill (tokens a second)
-- Takes one token if there is one: returns {1, 0}; else {0, ms until there is one}.
local capacity = tonumber(ARGV[1])
local per_ms = tonumber(ARGV[2]) / 1000
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or capacity
local at = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - at) * per_ms)
local taken = 0
local wait_ms = 0
if tokens >= 1 then
  tokens = tokens - 1
  taken = 1
else
  wait_ms = math.ceil((1 - tokens) / per_ms)
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'at', string.format('%d', now))
-- Once full again the bucket is the same as a missing one: let it go then.
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - tokens) / per_ms) + 1000)
return {taken, wait_ms}
"""

ANONYMOUS_BUCKET = "anonymous"
"""Bucket of every caller of an open API (no keys): they share one limit."""


class RateLimiter:
    """Takes one token from the caller's bucket per request."""

    def __init__(self, redis: Redis, requests_per_minute: int) -> None:
        self._script = redis.register_script(TOKEN_BUCKET_LUA)
        self._capacity = requests_per_minute
        self._per_second = requests_per_minute / 60

    @property
    def requests_per_minute(self) -> int:
        """The configured limit."""
        return self._capacity

    async def take(self, caller: Caller) -> float | None:
        """None when the request may go ahead; otherwise the seconds until it may."""
        bucket = keys.rate_limit(caller.owner or ANONYMOUS_BUCKET)
        taken, wait_ms = await self._script(keys=[bucket], args=[self._capacity, self._per_second])
        return None if taken == 1 else int(wait_ms) / 1000
