"""Cache-aware routing: an agent's next turn goes to the GPU worker that holds its prefix.

Prefix caching (:mod:`gpu_worker.prefix_cache`) only helps when consecutive turns land on
the same engine. A GPU worker that claims a job records itself as the affinity of the job's
routing keys (``resq:affinity:<model>:<kind>:<digest>`` -> worker id, with
:data:`AFFINITY_TTL_S`): its ``prompt_cache_key``, its conversation, and its own response id
(which the next turn names as ``previous_response_id``). The API looks the new request's keys
up in one script (:data:`ROUTE_LUA`), most specific first, and sends the job to that worker's
own queue (``generate:<model>@<worker id>``), unless the worker is gone (its details key
expired with its heartbeat), serves another model, or has no free slot: then to the model's
shared queue, as every other job. Recovery always re-dispatches to the shared queue.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal

from resq import keys

AFFINITY_TTL_S: Final = 600
"""How long a worker stays the affinity of a key after it last claimed a job of it (seconds)."""
Kind = Literal["cache", "conversation", "response"]
Outcome = Literal["hit", "fallback", "none"]


def affinity_key(model: str, kind: Kind, value: str) -> str:
    """The key naming the worker that last served ``value`` (hashed: clients choose cache keys)."""
    digest = hashlib.blake2b(value.encode(), digest_size=16).hexdigest()
    return f"{keys.PREFIX}:affinity:{model}:{kind}:{digest}"


@dataclass(frozen=True)
class RoutingKeys:
    """What a request may be routed by, and what its job records for the turns after it."""

    lookup: tuple[str, ...]
    """Affinity keys to look up, most specific first."""
    record: tuple[str, ...]
    """Affinity keys the worker that claims the job sets to itself."""


def routing_keys(
    model: str,
    response_id: str,
    prompt_cache_key: str | None,
    conversation_id: str | None,
    previous_response_id: str | None,
) -> RoutingKeys:
    """The lookup and record keys of one request."""
    lookup: list[str] = []
    record: list[str] = [affinity_key(model, "response", response_id)]
    if prompt_cache_key:
        lookup.append(affinity_key(model, "cache", prompt_cache_key))
        record.append(affinity_key(model, "cache", prompt_cache_key))
    if conversation_id:
        lookup.append(affinity_key(model, "conversation", conversation_id))
        record.append(affinity_key(model, "conversation", conversation_id))
    if previous_response_id:
        lookup.append(affinity_key(model, "response", previous_response_id))
    return RoutingKeys(tuple(lookup), tuple(record))


ROUTE_LUA: Final = """
-- KEYS: affinity keys, most specific first; ARGV[1] worker details key template ('WID'),
-- ARGV[2] the job's model. Returns {outcome, worker id}: 'hit' (that worker is alive, serves the
-- model and has a free slot), 'fallback' (it is not), 'none' (no key names a worker).
local worker = false
for _, key in ipairs(KEYS) do
  worker = redis.call('GET', key)
  if worker then break end
end
if not worker then
  return {'none', ''}
end
local details = redis.call('GET', (string.gsub(ARGV[1], 'WID', worker, 1)))
if not details then
  return {'fallback', worker}
end
local ok, info = pcall(cjson.decode, details)
if not ok or info['model'] ~= ARGV[2] or (tonumber(info['active']) or 0) >= (tonumber(info['max_batch']) or 0) then
  return {'fallback', worker}
end
return {'hit', worker}
"""
WORKER_DETAILS_TEMPLATE: Final = keys.worker_info("gpu", "WID")


def parse_route(reply: Any) -> tuple[Outcome, str | None]:
    """The outcome of :data:`ROUTE_LUA` and the worker to send to (None: the shared queue)."""
    outcome = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    worker = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
    if outcome == "hit":
        return "hit", worker
    return ("fallback" if outcome == "fallback" else "none"), None


def record(pipe: Any, worker_id: str, affinity_keys: Iterable[str]) -> None:
    """Queue on ``pipe`` the commands making ``worker_id`` the affinity of ``affinity_keys``."""
    for key in affinity_keys:
        pipe.set(key, worker_id, ex=AFFINITY_TTL_S)
