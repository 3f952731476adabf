"""The item index: which stored responses hold an item, so ``item_reference`` is one lookup.

A client that stores its responses (the Vercel AI SDK's default) sends earlier
output back as ``{"type": "item_reference", "id": "msg_..."}``. Every item of a
stored response is indexed under its owner and id (:func:`resq.keys.item_holders`):
the API indexes a response's input items when it accepts it, the post-processor
its output items when it stores the final Response, both with the TTL of the
stored response. The index only points: the item itself is read from the
response record (output) or its input record, so a response that is deleted or
expires takes its items with it.

An id sent again in a later request (Codex resends its whole history; a resolved
reference is recorded as the item itself) has several holders. The index keeps
the latest :data:`HOLDERS_KEPT` of them, latest first, and a reference resolves
to the latest one still stored: deleting the newest response that resent an
item leaves the item referable through the earlier ones.

:data:`RESOLVE_LUA` resolves every reference of a request in one round trip.
It builds the record keys from the response ids it finds, which a Redis Cluster
would refuse across slots; resq runs on one Redis (docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal

from resq import keys, records

Item = dict[str, Any]
Where = Literal["o", "i"]
OUTPUT: Final = "o"
INPUT: Final = "i"

HOLDERS_KEPT: Final = 16
"""Holders kept per item id: enough for a client that deletes a few recent responses, bounded
for one that resends the same items every turn."""

INDEX_LUA: Final = """
-- KEYS: holder lists; ARGV: '<response_id> <o|i>', TTL seconds, holders kept.
-- The holder goes first (once), the oldest past the bound go, the list lives as long as it.
for _, key in ipairs(KEYS) do
  redis.call('LREM', key, 0, ARGV[1])
  redis.call('LPUSH', key, ARGV[1])
  redis.call('LTRIM', key, 0, tonumber(ARGV[3]) - 1)
  redis.call('EXPIRE', key, ARGV[2])
end
return #KEYS
"""

RESOLVE_LUA: Final = (
    records.OWNERSHIP_LUA
    + """
-- KEYS: per reference, its holder list and its entry of the single-holder index before it;
-- ARGV[1]: the record key of response 'RID', ARGV[2]: its input key.
-- Returns, per reference, false or {response_id, where, owner, store, final, payload}: the latest
-- holder that is stored and (for output) final, else the latest one still there, so that the
-- caller says why it cannot be used. payload is the record's Response JSON for an output item,
-- the input record for an input item.
local function holder(ref)
  local rid, where = string.match(ref, '^(%S+) (%a)$')
  if not rid then
    return nil
  end
  local owner, store, final, payload = ownership_of((string.gsub(ARGV[1], 'RID', rid, 1)))
  if not owner then
    return nil
  end
  return {rid, where, owner, store, final, payload}
end
local result = {}
for index = 1, #KEYS, 2 do
  local refs = redis.call('LRANGE', KEYS[index], 0, -1)
  local single = redis.call('GET', KEYS[index + 1])
  if single then
    refs[#refs + 1] = single
  end
  local chosen = false
  for _, ref in ipairs(refs) do
    local entry = holder(ref)
    if entry then
      if entry[4] == '1' and (entry[2] == 'i' or entry[5] == '1') then
        chosen = entry
        break
      end
      chosen = chosen or entry
    end
  end
  if chosen then
    if chosen[2] == 'i' then
      chosen[6] = redis.call('GET', (string.gsub(ARGV[2], 'RID', chosen[1], 1)))
    end
    chosen[6] = chosen[6] or ''
  end
  result[#result + 1] = chosen
end
return result
"""
)
RECORD_KEY_TEMPLATE: Final = keys.record("RID")
INPUT_KEY_TEMPLATE: Final = keys.input_items("RID")


def index_items(
    pipe: Any, owner: str, response_id: str, items: Iterable[Item], where: Where, ttl_s: int
) -> None:
    """Queue on ``pipe`` (sync or async) ``response_id`` as the latest holder of ``items``: one
    script for all of them."""
    holder_keys = [
        keys.item_holders(owner, item_id)
        for item in items
        if isinstance(item_id := item.get("id"), str) and item_id
    ]
    if holder_keys:
        pipe.eval(INDEX_LUA, len(holder_keys), *holder_keys, f"{response_id} {where}", ttl_s, HOLDERS_KEPT)


def resolve_keys(owner: str, item_ids: Iterable[str]) -> list[str]:
    """The keys :data:`RESOLVE_LUA` reads for ``item_ids``, in order (two per id)."""
    return [
        key
        for item_id in item_ids
        for key in (keys.item_holders(owner, item_id), keys.item_ref(owner, item_id))
    ]


@dataclass(frozen=True)
class IndexedItem:
    """What the index says of one referenced id, read in the same step as the record."""

    response_id: str
    where: Where
    owner: str
    store: bool
    final: bool
    payload: bytes
    """The Response JSON (output items) or the input record JSON (input items)."""


def parse_resolved(raw: list[Any]) -> list[IndexedItem | None]:
    """The entries :data:`RESOLVE_LUA` returned, one per key asked (None: not indexed, or gone)."""
    resolved: list[IndexedItem | None] = []
    for entry in raw:
        if not entry:
            resolved.append(None)
            continue
        response_id, where, owner, store, final, payload = entry
        resolved.append(
            IndexedItem(
                response_id=response_id.decode(),
                where=INPUT if where == b"i" else OUTPUT,
                owner=owner.decode(),
                store=store == b"1",
                final=final == b"1",
                payload=payload,
            )
        )
    return resolved
