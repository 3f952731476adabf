"""The response record: status, Response snapshot and options of one response.

Every status change is one Lua script, so it is atomic across API replicas and
workers, and a terminal status is never overwritten: a late ``completed`` does
not replace ``cancelled``.

Record fields (hash ``keys.record``):

- ``status``: ``queued``, ``in_progress``, ``completed``, ``incomplete``,
  ``failed`` or ``cancelled``;
- ``response``: the latest Response JSON (the final one once terminal);
- ``final``: ``1`` once the post-processor wrote the final Response;
- ``options``: JSON of :class:`resq.options.ProcessingOptions`;
- ``store``, ``background``: ``1`` or ``0``; ``owner``: who created it.
"""

from __future__ import annotations

from typing import Final

TERMINAL_STATUSES: Final = frozenset({"completed", "incomplete", "failed", "cancelled"})

MARK_IN_PROGRESS_LUA: Final = """
-- KEYS[1] record; ARGV[1] Response JSON with status in_progress
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'response', ARGV[1])
  return 'in_progress'
end
return status
"""

FINALIZE_LUA: Final = """
-- KEYS: record, events, input
-- ARGV: status, Response JSON, TTL of what stays (record, events, input)
-- Returns {status, stored Response JSON}. A response finalised before keeps what
-- it has (a re-run post-processor reuses it byte for byte); a response cancelled
-- meanwhile is only finalised with status 'cancelled'.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return {'missing', ''}
end
local final = redis.call('HGET', KEYS[1], 'final')
if final == '1' then
  return {status, redis.call('HGET', KEYS[1], 'response')}
end
if status == 'cancelled' and ARGV[1] ~= 'cancelled' then
  return {'cancelled', ''}
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'response', ARGV[2], 'final', '1')
local ttl = tonumber(ARGV[3])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('EXPIRE', KEYS[3], ttl)
end
return {ARGV[1], ARGV[2]}
"""

CANCEL_LUA: Final = """
-- KEYS: record, cancel flag; ARGV: cancel flag TTL
-- Returns the status after the call: 'cancelled' when this call (or an earlier
-- one) cancelled it, the terminal status otherwise, false when missing.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return false
end
if status == 'queued' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled')
  redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[1]))
  return 'cancelled'
end
return status
"""

DELETE_LUA: Final = """
-- KEYS[1] record, KEYS[2] cancel flag, KEYS[3..] every other key of the response
-- ARGV[1] cancel flag TTL
-- Removes the response in one step. A generation not finished yet gets the cancel
-- flag (the one key left, expiring on its own) so that the GPU worker stops it; a
-- finished one loses every key. Returns the status it had, false when missing.
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return false
end
local final = redis.call('HGET', KEYS[1], 'final')
for index = 3, #KEYS do
  redis.call('DEL', KEYS[index])
end
redis.call('DEL', KEYS[1])
if final == '1' then
  redis.call('DEL', KEYS[2])
else
  redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[1]))
end
return status
"""
