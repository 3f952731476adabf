"""Conversations in Redis: the one owner of their four keys, their fields and their scripts.

A conversation (``POST /v1/conversations``) is an ordered list of items that
responses created with ``conversation`` continue and extend. Its keys
(:func:`resq.keys.conversation_keys`, one hash tag) are:

- ``conversation`` (hash): ``owner``, ``created_at``, ``metadata`` (JSON); the
  conversation exists while this key does;
- ``items`` (list): item ids in conversation order, each id once;
- ``item_data`` (hash): item id -> item JSON, for exactly the ids of ``items``;
- ``appended`` (set): the responses whose items were appended already.

Every script takes the four keys in that order and refreshes the TTL of all of
them, so that a conversation in use never loses a part of itself. Writes are one
script each, so the list and the hash never disagree, whichever API replica or
post-processor writes. :data:`APPEND_LUA` appends exactly once per marker: a
re-run post-processor appending a response's items again finds its marker and
writes nothing.

Item ids: an item keeps the id it was sent with (a client's, or one a response
gave it); an item sent without one gets :func:`new_item_id`, drawn at random:
nothing replays an add, so nothing needs ids derived from positions.

No FastAPI here: the API uses this module through an asyncio client, the
post-processor through a blocking one.
"""

from __future__ import annotations

import secrets
from typing import Any, Final

from resq import jsonutil

Item = dict[str, Any]

MAX_ITEMS_PER_ADD: Final = 20
"""Most items one create or add request may carry (OpenAI's limit)."""
MAX_ITEM_ID_CHARS: Final = 256

ITEM_ID_PREFIXES: Final = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "reasoning": "rs",
    "compaction": "cmp",
}
"""The id prefix of each item type an item may be added with (OpenAI's, where it has one)."""


def new_item_id(item_type: str) -> str:
    """A fresh id for an item of ``item_type``: its prefix and 32 random hex digits."""
    return f"{ITEM_ID_PREFIXES.get(item_type, 'item')}_{secrets.token_hex(16)}"


def is_item_id(value: str) -> bool:
    """Whether ``value`` may name a conversation item: 1-256 printable characters, no whitespace,
    and not ``.`` or ``..``.

    Item ids come from clients; they travel in URL paths (the item routes take a ``/`` in them;
    clients resolve the dot segments away, so those two could never be addressed) and are hash
    fields in Redis.
    """
    return (
        0 < len(value) <= MAX_ITEM_ID_CHARS
        and value.isprintable()
        and " " not in value
        and value not in (".", "..")
    )


# Lua shared by the scripts. KEYS are always resq.keys.conversation_keys(...):
# KEYS[1] conversation, KEYS[2] items, KEYS[3] item_data, KEYS[4] appended.
_REFRESH = """
local function refresh(ttl)
  for index = 1, 4 do
    redis.call('EXPIRE', KEYS[index], ttl)
  end
end
"""

_APPEND = """
-- Appends the (id, JSON) pairs of ARGV from `first` on. An id the conversation holds
-- keeps its place: HSET answers 0 for a field it only replaced.
local function append(first)
  for index = first, #ARGV, 2 do
    if redis.call('HSET', KEYS[3], ARGV[index], ARGV[index + 1]) == 1 then
      redis.call('RPUSH', KEYS[2], ARGV[index])
    end
  end
end
"""

_READ_ITEMS = """
-- The JSON of the items `ids` names, in that order, after the `into` table's entries.
-- HMGET in slices: unpack() fails past a few thousand arguments.
local function read_items(ids, into)
  for start = 1, #ids, 1000 do
    local slice = {}
    for index = start, math.min(start + 999, #ids) do
      slice[#slice + 1] = ids[index]
    end
    local data = redis.call('HMGET', KEYS[3], unpack(slice))
    for index = 1, #data do
      if data[index] then
        into[#into + 1] = data[index]
      end
    end
  end
  return into
end
"""

APPEND_LUA: Final = (
    _REFRESH
    + _APPEND
    + """
-- ARGV[1] TTL (s), ARGV[2] marker (a response id; '' for a client's own add),
-- ARGV[3..] item id, item JSON, item id, item JSON, ...
-- Returns 'missing' (no such conversation), 'duplicate' (the marker's items were
-- appended before: nothing written), {'taken', id, ...} (a response's items whose ids the
-- conversation holds already: nothing written) or 'appended'.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 'missing'
end
local marker = ARGV[2]
if marker ~= '' then
  if redis.call('SISMEMBER', KEYS[4], marker) == 1 then
    return 'duplicate'
  end
  -- A response's items never replace one the conversation holds (a client's add does).
  local taken = {'taken'}
  for index = 3, #ARGV, 2 do
    if redis.call('HEXISTS', KEYS[3], ARGV[index]) == 1 then
      taken[#taken + 1] = ARGV[index]
    end
  end
  if #taken > 1 then
    return taken
  end
end
append(3)
if marker ~= '' then
  redis.call('SADD', KEYS[4], marker)
end
refresh(tonumber(ARGV[1]))
return 'appended'
"""
)

CREATE_LUA: Final = (
    _REFRESH
    + _APPEND
    + """
-- ARGV[1] TTL (s), ARGV[2] owner, ARGV[3] created_at, ARGV[4] metadata JSON,
-- ARGV[5..] item id, item JSON, ... (the initial items)
-- Returns 'exists' (the id is taken: nothing written) or 'created'.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 'exists'
end
-- A conversation starts empty, whatever an earlier one of this id left behind.
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'created_at', ARGV[3], 'metadata', ARGV[4])
append(5)
refresh(tonumber(ARGV[1]))
return 'created'
"""
)

HEADER_LUA: Final = (
    _REFRESH
    + """
-- ARGV[1] TTL (s). Returns false (no such conversation) or {owner, created_at, metadata}.
local header = redis.call('HMGET', KEYS[1], 'owner', 'created_at', 'metadata')
if not header[1] then
  return false
end
refresh(tonumber(ARGV[1]))
return header
"""
)

ALL_ITEMS_LUA: Final = (
    _REFRESH
    + _READ_ITEMS
    + """
-- ARGV[1] TTL (s). Returns false (no such conversation) or {owner, item JSON, ...},
-- every item in conversation order.
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then
  return false
end
refresh(tonumber(ARGV[1]))
return read_items(redis.call('LRANGE', KEYS[2], 0, -1), {owner})
"""
)

PAGE_LUA: Final = (
    _REFRESH
    + _READ_ITEMS
    + """
-- ARGV[1] TTL (s), ARGV[2] limit, ARGV[3] order ('asc' or 'desc'), ARGV[4] after ('' for none)
-- Returns false (no such conversation), {owner, 'after_missing'} (no item `after`) or
-- {owner, has_more ('1' or '0'), item JSON, ...}: the items after `after` in that order.
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then
  return false
end
refresh(tonumber(ARGV[1]))
local limit = tonumber(ARGV[2])
local ascending = ARGV[3] == 'asc'
local total = redis.call('LLEN', KEYS[2])
local position = false
if ARGV[4] ~= '' then
  position = redis.call('LPOS', KEYS[2], ARGV[4])
  if not position then
    return {owner, 'after_missing'}
  end
end
local first, last, more
if ascending then
  first = position and position + 1 or 0
  last = first + limit - 1
  more = last < total - 1
else
  last = position and position - 1 or total - 1
  first = math.max(last - limit + 1, 0)
  more = first > 0
end
local ids = {}
if last >= first then
  ids = redis.call('LRANGE', KEYS[2], first, last)
end
if not ascending then
  local reversed = {}
  for index = #ids, 1, -1 do
    reversed[#reversed + 1] = ids[index]
  end
  ids = reversed
end
return read_items(ids, {owner, more and '1' or '0'})
"""
)

ITEM_LUA: Final = (
    _REFRESH
    + """
-- ARGV[1] TTL (s), ARGV[2] item id
-- Returns false (no such conversation), {owner} (no such item) or {owner, item JSON}.
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then
  return false
end
refresh(tonumber(ARGV[1]))
local item = redis.call('HGET', KEYS[3], ARGV[2])
if not item then
  return {owner}
end
return {owner, item}
"""
)

UPDATE_LUA: Final = (
    _REFRESH
    + """
-- ARGV[1] TTL (s), ARGV[2] metadata JSON. Returns 'missing' or 'updated'.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 'missing'
end
redis.call('HSET', KEYS[1], 'metadata', ARGV[2])
refresh(tonumber(ARGV[1]))
return 'updated'
"""
)

DELETE_ITEM_LUA: Final = (
    _REFRESH
    + """
-- ARGV[1] TTL (s), ARGV[2] item id. Returns 'missing' (no such conversation),
-- 'no_item' (no such item) or 'deleted'.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 'missing'
end
local status = 'no_item'
if redis.call('HDEL', KEYS[3], ARGV[2]) == 1 then
  redis.call('LREM', KEYS[2], 0, ARGV[2])
  status = 'deleted'
end
refresh(tonumber(ARGV[1]))
return status
"""
)

FREE_IDS_LUA: Final = """
-- ARGV: item ids. Returns 1 when the conversation holds none of them, 0 when it holds one (a
-- guard of resq.guarded_step: it only reads).
for index = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[3], ARGV[index]) == 1 then
    return 0
  end
end
return 1
"""

DELETE_LUA: Final = """
-- No ARGV. Removes every key of the conversation; returns 'missing' or 'deleted'.
if redis.call('DEL', KEYS[1]) == 0 then
  return 'missing'
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
return 'deleted'
"""


def item_pairs(items: list[Item]) -> list[str]:
    """``[id, JSON, id, JSON, ...]`` of ``items``, as the scripts take them; every item needs an id."""
    pairs: list[str] = []
    for index, item in enumerate(items):
        item_id = item.get("id")
        if not isinstance(item_id, str) or not item_id:
            raise ValueError(f"item {index} has no id: only items with ids can be appended")
        pairs += [item_id, jsonutil.dumps(item).decode()]
    return pairs


def append_arguments(ttl_s: int, marker: str, items: list[Item]) -> list[str | int]:
    """ARGV of :data:`APPEND_LUA`: the TTL, the marker ('' for none), then each item's id and JSON.

    Raises ValueError when an item has no id.
    """
    return [ttl_s, marker, *item_pairs(items)]


def renamed_where_taken(items: list[Item], reply: Any) -> list[Item] | None:
    """``items`` with a fresh id for each one :data:`APPEND_LUA` found taken (its ``reply``);
    None when the reply is not ``{'taken', id, ...}``.

    Two responses sent the same new item id to one conversation (each passed the duplicate
    check, made when it was accepted, before either appended): the later one's item joins under
    a fresh id instead of replacing the earlier one's. A client's add of an id the conversation
    holds already was checked as it was made, and replaces the item, as documented.
    """
    if not isinstance(reply, list) or not reply or _text(reply[0]) != "taken":
        return None
    taken = {_text(item_id) for item_id in reply[1:]}
    return [
        {**item, "id": new_item_id(str(item.get("type", "")))} if item.get("id") in taken else item
        for item in items
    ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
