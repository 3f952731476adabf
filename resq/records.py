"""The response record: status, final object and options of one response. Its one owner.

Every module that reads or writes a record's fields goes through here: the API
creates it (:func:`create`), the store reads it (:data:`STORED_FIELDS`,
:func:`parse_stored`), the post-processor reads what it needs
(:data:`PROCESSING_FIELDS`, :func:`parse_processing`) and writes the final object
(:data:`FINALIZE_LUA`), the relay reads the final object (:data:`FINAL_OBJECT`). The
field names appear nowhere else. Every status change is one Lua script, so it is
atomic across API replicas and workers, and a terminal status is never
overwritten: a late ``completed`` does not replace ``cancelled``.

Record fields (hash ``keys.record``):

- ``status``: a :data:`resq.status.ResponseStatus`;
- ``created``: the object as created (the Response snapshot, or a chat completion's shared fields);
- ``response``: the latest object JSON (the final one once terminal: a Response, or a
  ``chat.completion`` / its error body);
- ``final``: ``1`` once the post-processor wrote the final Response;
- ``options``: JSON of :class:`resq.options.ProcessingOptions`;
- ``store``, ``background``: ``1`` or ``0``; ``owner``: who created it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, cast

from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.client import Pipeline

from resq import keys
from resq.options import ProcessingOptions
from resq.status import TERMINAL_STATUSES, ResponseStatus

__all__ = [
    "CANCEL_LUA",
    "DELETE_LUA",
    "FAIL_LUA",
    "FINALIZE_LUA",
    "FINAL_OBJECT",
    "MARK_IN_PROGRESS_LUA",
    "OWNERSHIP_LUA",
    "PROCESSING_FIELDS",
    "STORED_FIELDS",
    "TERMINAL_STATUSES",
    "NewRecord",
    "ProcessingRecord",
    "StoredRecord",
    "create",
    "parse_processing",
    "parse_stored",
]

FINAL_OBJECT: Final = "response"
"""The field holding the latest (once terminal, the final) object."""


@dataclass(frozen=True)
class NewRecord:
    """What the API records when it accepts a request."""

    status: ResponseStatus
    created_json: bytes
    options: ProcessingOptions
    store: bool
    background: bool
    owner: str


def create(pipe: Pipeline | AsyncPipeline, response_id: str, record: NewRecord, ttl_s: int) -> None:
    """Queue the commands that write a new record (expiring after ``ttl_s``) on ``pipe``."""
    key = keys.record(response_id)
    pipe.hset(
        key,
        mapping={
            "status": record.status,
            "created": record.created_json,
            FINAL_OBJECT: record.created_json,
            "options": record.options.model_dump_json(),
            "store": "1" if record.store else "0",
            "background": "1" if record.background else "0",
            "owner": record.owner,
        },
    )
    pipe.expire(key, ttl_s)


STORED_FIELDS: Final = ("status", FINAL_OBJECT, "final", "store", "background", "owner")
"""What the store reads of a record (``HMGET`` in this order, then :func:`parse_stored`)."""


@dataclass(frozen=True)
class StoredRecord:
    """A record as the store reads it, at one moment."""

    status: ResponseStatus
    object_json: bytes
    final: bool
    store: bool
    background: bool
    owner: str


def parse_stored(values: list[bytes | None]) -> StoredRecord | None:
    """The :data:`STORED_FIELDS` values as a record; None when it is missing."""
    status, latest, final, store, background, owner = values
    if status is None or latest is None:
        return None
    return StoredRecord(
        status=cast("ResponseStatus", status.decode()),
        object_json=latest,
        final=final == b"1",
        store=store == b"1",
        background=background == b"1",
        owner=(owner or b"").decode(),
    )


OWNERSHIP_LUA: Final = """
-- A Lua prelude: ownership_of(record) -> owner, store, final, latest object of a record, or nil
-- when it is missing (item references are resolved against it in the same step).
local function ownership_of(record)
  local fields = redis.call('HMGET', record, 'owner', 'store', 'final', 'response')
  if not fields[1] then
    return nil
  end
  return fields[1], fields[2] or '0', fields[3] or '0', fields[4]
end
"""

PROCESSING_FIELDS: Final = ("created", "options", "store", "owner")
"""What a post-processor reads of a record (``HMGET`` in this order, then :func:`parse_processing`)."""


@dataclass(frozen=True)
class ProcessingRecord:
    """A record as a post-processor needs it."""

    created_json: bytes
    options: ProcessingOptions
    store: bool
    owner: str


def parse_processing(values: list[bytes | None]) -> ProcessingRecord | None:
    """The :data:`PROCESSING_FIELDS` values as a record; None when it is missing."""
    created, options, store, owner = values
    if created is None or options is None:
        return None
    return ProcessingRecord(
        created_json=created,
        options=ProcessingOptions.model_validate_json(options),
        store=store == b"1",
        owner=(owner or b"").decode(),
    )


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
-- KEYS: record, events, input, turn
-- ARGV: status, Response JSON, TTL of what stays (record, events, input), output items JSON
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
-- A stored response's turn gets its output in the same step (resq.turns), and lives at least
-- as long as the response.
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HSET', KEYS[4], 'output', ARGV[4])
  if redis.call('TTL', KEYS[4]) < ttl then
    redis.call('EXPIRE', KEYS[4], ttl)
  end
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

EVENT_LOG_LENGTH_LUA: Final = """
-- The number of events in an event log (its top entry's id is 0-<that number>), -1 when it is gone.
local function event_log_length(key)
  local top = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if #top == 0 then
    if redis.call('EXISTS', key) == 0 then
      return -1
    end
    return 0
  end
  local id = top[1][1]
  return tonumber(string.sub(id, string.find(id, '-', 1, true) + 1))
end
"""
"""A Lua prelude: ``event_log_length(key)`` (event ids are ``0-<sequence_number + 1>``)."""

LOG_ENDED_LUA: Final = """
-- Whether an event log ends with a terminal event: its last event's type is one of ARGV[first..]
-- (the caller passes resq.events.types.TERMINAL_TYPES_LISTED there).
local function log_ended(key, first)
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if #last == 0 then return false end
  local fields = last[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 'type' then
      for index = first, #ARGV do
        if fields[i + 1] == ARGV[index] then return true end
      end
      return false
    end
  end
  return false
end
"""
"""A Lua prelude: ``log_ended(key, first)``, shared by the scripts that act only on an ended log."""

FAIL_LUA: Final = (
    EVENT_LOG_LENGTH_LUA
    + """
-- KEYS: events, record, input, cancel flag
-- ARGV[1] sequence number of the first event; ARGV[2] the most events the log may hold for this
-- call to go ahead; ARGV[3] n, the events before the terminal one; ARGV[4 .. 3+2n] their type/data
-- pairs; then: TTL of what stays, TTL of the cancel flag, and for 'failed' then 'cancelled' the
-- Response JSON, the terminal event's type and its data.
-- A post-processor that gives up on a response ends it in one step: the events still missing, the
-- closing events, the terminal event and the final record together, or nothing (under OOM the
-- first write is refused, and with it the rest). A takeover then finds either a response to go
-- on with or a finished one; never a terminal event without its record, nor a gap.
-- Returns {outcome, events logged before}: outcome 'failed' or 'cancelled' (what it ended as),
-- 'missing', 'final' (another post-processor finished it), 'moved' (the log does not end where
-- the caller thinks: it lost events, or another post-processor logged further).
local count = event_log_length(KEYS[1])
local status = redis.call('HGET', KEYS[2], 'status')
if count < 0 or not status then
  return {'missing', count}
end
if redis.call('HGET', KEYS[2], 'final') == '1' then
  return {'final', count}
end
local first = tonumber(ARGV[1])
if count < first or count > tonumber(ARGV[2]) then
  return {'moved', count}
end
local n = tonumber(ARGV[3])
local at = 4 + 2 * n
local ttl = tonumber(ARGV[at])
local outcome, variant = 'failed', at + 2
if status == 'cancelled' then
  outcome, variant = 'cancelled', at + 5
end
for index = 0, n - 1 do
  if first + index >= count then
    redis.call('XADD', KEYS[1], '0-' .. (first + index + 1), 'type', ARGV[4 + 2 * index], 'data', ARGV[5 + 2 * index])
  end
end
redis.call('XADD', KEYS[1], '0-' .. (first + n + 1), 'type', ARGV[variant + 1], 'data', ARGV[variant + 2])
redis.call('HSET', KEYS[2], 'status', outcome, 'response', ARGV[variant], 'final', '1')
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[1], ttl)
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('EXPIRE', KEYS[3], ttl)
end
-- The GPU worker may still be generating: stop it, as a cancel does.
redis.call('SET', KEYS[4], '1', 'EX', tonumber(ARGV[at + 1]))
return {outcome, count}
"""
)
