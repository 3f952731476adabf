"""Turns: the history of ``previous_response_id`` chains, each turn stored once.

A stored response's *turn* (hash :func:`resq.keys.turn`) holds its own input items
(``input``), its output items once it ends (``output``), the response it continued
(``parent``), how many turns continue it (``children``) and whether the response
itself was deleted (``deleted``). A continuation walks the chain of parents: a
chain of N turns costs O(N) bytes, where storing each response's whole
conversation cost O(N^2).

Earlier turns outlive their responses while a later turn needs them:

- a new turn refreshes the TTL of every ancestor (to the store TTL plus the longest
  a generation may take), so no ancestor expires before its newest descendant;
- deleting a response deletes its turn only when no turn continues it; otherwise
  the turn is marked ``deleted`` and goes when its last child goes (the release
  walks up, deleting every deleted ancestor left without children).

Ownership needs no check here: a chain is reached only from a response the caller
may see (:meth:`api.store.ResponseStore.earlier_conversation`), and every turn of
it was created by that response's owner (a request may only continue its owner's
responses).

The scripts follow parent links to keys of other responses, which a Redis Cluster
would refuse across slots; resq runs on one Redis (docs/operations.md), as for
:mod:`resq.item_index`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from redis.asyncio.client import Pipeline as AsyncPipeline

from resq import jsonutil, keys

Item = dict[str, Any]

TURN_KEY_TEMPLATE: Final = keys.turn("RID")
"""The turn key of response ``RID`` (the scripts build parents' keys from it)."""

_TURN_KEY = """
local function turn_key(response_id)
  return (string.gsub(ARGV[1], 'RID', response_id, 1))
end
"""

CREATE_LUA: Final = (
    _TURN_KEY
    + """
-- KEYS[1] the new turn; ARGV[1] turn key template, ARGV[2] parent response id ('' for none),
-- ARGV[3] input items JSON, ARGV[4] TTL of the turn, ARGV[5] TTL every ancestor gets at least.
-- Returns the number of ancestors refreshed, or -1 when the parent's turn is gone (nothing written).
local parent = ARGV[2]
if parent ~= '' and redis.call('EXISTS', turn_key(parent)) == 0 then
  return -1
end
redis.call('HSET', KEYS[1], 'parent', parent, 'input', ARGV[3], 'children', 0, 'deleted', 0)
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
if parent == '' then
  return 0
end
redis.call('HINCRBY', turn_key(parent), 'children', 1)
local ancestor_ttl = tonumber(ARGV[5])
local refreshed = 0
local at = parent
while at ~= '' do
  local key = turn_key(at)
  if redis.call('TTL', key) < ancestor_ttl then
    redis.call('EXPIRE', key, ancestor_ttl)
  end
  refreshed = refreshed + 1
  at = redis.call('HGET', key, 'parent') or ''
end
return refreshed
"""
)

HISTORY_LUA: Final = (
    _TURN_KEY
    + """
-- KEYS[1] the turn to start from; ARGV[1] turn key template.
-- Returns {complete, input_1, output_1, input_2, output_2, ...} from that turn up to the first
-- one: complete is 1, or 0 when an ancestor is gone (never expected: see the module docstring).
local result = {1}
local key = KEYS[1]
while true do
  local fields = redis.call('HMGET', key, 'parent', 'input', 'output')
  if not fields[2] then
    result[1] = 0
    return result
  end
  result[#result + 1] = fields[2]
  result[#result + 1] = fields[3] or '[]'
  if not fields[1] or fields[1] == '' then
    return result
  end
  key = turn_key(fields[1])
end
"""
)

RELEASE_LUA: Final = (
    _TURN_KEY
    + """
-- KEYS[1] the turn of a deleted response; ARGV[1] turn key template.
-- Marks it deleted; deletes it if no turn continues it, then each deleted ancestor left
-- without children. Returns the number of turns deleted.
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then
  return 0
end
redis.call('HSET', key, 'deleted', 1)
local deleted = 0
while true do
  local fields = redis.call('HMGET', key, 'parent', 'children', 'deleted')
  if fields[3] ~= '1' or tonumber(fields[2] or '0') > 0 then
    return deleted
  end
  redis.call('DEL', key)
  deleted = deleted + 1
  local parent = fields[1] or ''
  if parent == '' then
    return deleted
  end
  key = turn_key(parent)
  if redis.call('EXISTS', key) == 0 then
    return deleted
  end
  redis.call('HINCRBY', key, 'children', -1)
end
"""
)


SET_OUTPUT_LUA: Final = """
-- KEYS[1] a turn; ARGV[1] its output items JSON. For a response that failed or was cancelled
-- (a finished one gets its output with its final record: resq.records.FINALIZE_LUA).
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'output', ARGV[1])
end
"""


def create_arguments(
    parent: str | None, items: list[Item], ttl_s: int, ancestor_ttl_s: int
) -> list[str | int]:
    """``ARGV`` of :data:`CREATE_LUA` for a turn of ``items`` continuing ``parent``."""
    return [TURN_KEY_TEMPLATE, parent or "", jsonutil.dumps(items).decode(), ttl_s, ancestor_ttl_s]


def stage_parent_check(pipe: AsyncPipeline, parent: str) -> None:
    """Queue a guard of a step that creates a turn continuing ``parent``: it answers 0 when the
    parent's turn is gone (deleted since the request read it), so that the step writes nothing,
    where :data:`CREATE_LUA` alone would skip only the turn and leave its response recorded."""
    pipe.exists(keys.turn(parent))


@dataclass(frozen=True)
class History:
    """A chain of turns read by :data:`HISTORY_LUA`, oldest first."""

    turns: list[tuple[list[Item], list[Item]]]
    """Each turn's ``(input items, output items)``."""
    complete: bool


def parse_history(raw: list[Any]) -> History:
    """The reply of :data:`HISTORY_LUA`, oldest turn first."""
    complete = int(raw[0]) == 1
    pairs = [
        (jsonutil.loads(raw[index]), jsonutil.loads(raw[index + 1])) for index in range(1, len(raw) - 1, 2)
    ]
    return History(turns=pairs[::-1], complete=complete)
