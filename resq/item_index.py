"""The item index: which stored response holds an item, so ``item_reference`` is one lookup.

A client that stores its responses (the Vercel AI SDK's default) sends earlier
output back as ``{"type": "item_reference", "id": "msg_..."}``. Every item of a
stored response is indexed under its owner and id (:func:`resq.keys.item_ref`):
the API indexes a response's input items when it accepts it, the post-processor
its output items when it stores the final Response, both with the TTL of the
stored response. The index only points: the item itself is read from the
response record (output) or its input record, so a response that is deleted or
expires takes its items with it, and an id sent again in a later request (Codex
resends its whole history) points at the latest response that holds it.

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

RESOLVE_LUA: Final = (
    records.OWNERSHIP_LUA
    + """
-- KEYS: item-index keys; ARGV[1]: the record key of response 'RID', ARGV[2]: its input key
-- Returns, per key, false or {response_id, where, owner, store, final, payload}: payload is
-- the record's Response JSON for an output item, the input record for an input item.
local result = {}
for index, key in ipairs(KEYS) do
  local ref = redis.call('GET', key)
  local entry = false
  if ref then
    local rid, where = string.match(ref, '^(%S+) (%a)$')
    if rid then
      local owner, store, final, payload = ownership_of((string.gsub(ARGV[1], 'RID', rid, 1)))
      if owner then
        if where == 'i' then
          payload = redis.call('GET', (string.gsub(ARGV[2], 'RID', rid, 1)))
        end
        entry = {rid, where, owner, store, final, payload or ''}
      end
    end
  end
  result[index] = entry
end
return result
"""
)
RECORD_KEY_TEMPLATE: Final = keys.record("RID")
INPUT_KEY_TEMPLATE: Final = keys.input_items("RID")


def index_items(
    pipe: Any, owner: str, response_id: str, items: Iterable[Item], where: Where, ttl_s: int
) -> None:
    """Queue on ``pipe`` (sync or async) the index entries of ``items`` of ``response_id``."""
    value = f"{response_id} {where}"
    for item in items:
        item_id = item.get("id")
        if isinstance(item_id, str) and item_id:
            pipe.set(keys.item_ref(owner, item_id), value, ex=ttl_s)


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
