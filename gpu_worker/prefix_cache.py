"""Prefix caching: how many prompt tokens the engine reused, as the engine itself decided, and
whose blocks a request may reuse.

transformers' paged cache shares the KV blocks of a prompt prefix another request already
computed (``allow_block_sharing``, on unless ``RESQ_PREFIX_CACHING=false``): when the
scheduler first admits a request, ``PagedAttentionCache.search_prefix_match`` returns the
number of prompt tokens whose blocks it shares instead of computing them. resq records that
number per engine request (wrapping the method once per process) and reports it as
``usage.input_tokens_details.cached_tokens``; nothing is estimated. A model whose cache
cannot share blocks (sliding-window or hybrid attention) matches nothing: 0.

Blocks are shared within one API key only. A block's hash chains to its parent's from the
prompt's first block, so resq salts the chain's root with the request's owner (the caller's
key fingerprint, :func:`salt`), as vLLM's ``cache_salt`` does: a request of another key
computes different hashes for the same tokens and matches none of those blocks. Without the
salt, ``cached_tokens`` (and the first token's time) told a key whether another key had sent
a given prompt, one page at a time. Requests of no key (auth off) share one space, as before.
The engine thread is the only one that matches and registers blocks, so the salt of the
request being matched or registered is one module variable, set around those two calls.

Cached blocks are evicted least recently used first, and only as many as the room needed
(:func:`evict_until_margin`, :func:`evict_for_room`). transformers counts an unreferenced cached
block as used, and evicted every cached block at once in both places it makes room: when free room
fell under the scheduler's safety margin, and when a request did not fit. A worker that had served
its cache's worth of prompts then lost every agent's prefix together, and each one's next turn
computed its whole history again (vLLM's and SGLang's caches evict the blocks released longest ago
first, as this does).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from typing import Any

from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import cache_allocator
from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
from transformers.generation.continuous_batching.scheduler import Scheduler

_MARK = "_resq_records_prefix_hits"
_hits: dict[str, int] = {}
"""Engine request id -> prompt tokens reused at its admission (written by the engine thread)."""
_salts: dict[str, int] = {}
"""Engine request id -> the root of its block hashes (requests with an owner only)."""
_current_salt: int | None = None
"""The salt of the request whose blocks the engine thread is matching or registering now."""
EVICTED_SHARE = 4
"""Each eviction pass frees this share (a quarter) of each allocator's cached blocks, the oldest
(at least one), until there is room again."""


def _salted(compute: Callable[[int | None, list[int]], int]) -> Callable[[int | None, list[int]], int]:
    def compute_block_hash(parent_hash: int | None, tokens: list[int]) -> int:
        if parent_hash is None:  # the prompt's first block: its chain starts at the owner's salt
            parent_hash = _current_salt
        return compute(parent_hash, tokens)

    return compute_block_hash


def install() -> None:
    """Record every prefix match of this process's engines, and salt block hashes by owner
    (idempotent)."""
    current = PagedAttentionCache.search_prefix_match
    if getattr(current, _MARK, False):
        return
    mark_complete = PagedAttentionCache.mark_complete_blocks

    def search_prefix_match(self: PagedAttentionCache, request_id: str, prompt_ids: list[int]) -> int:
        global _current_salt
        _current_salt = _salts.get(request_id)
        try:
            matched: int = current(self, request_id, prompt_ids)
        finally:
            _current_salt = None
        # A request is matched when it is first scheduled; should it ever be matched again, the
        # first figure is the one its prompt got.
        _hits.setdefault(request_id, matched)
        return matched

    def mark_complete_blocks(self: PagedAttentionCache, state: Any, complete_blocks: dict[str, int]) -> None:
        global _current_salt
        _current_salt = _salts.get(state.request_id)
        try:
            mark_complete(self, state, complete_blocks)
        finally:
            _current_salt = None

    offload_requests = OffloadingManager.offload_requests

    def offload_or_evict(self: OffloadingManager) -> bool:
        # transformers' own evicts every cached block first, then offloads running requests.
        return evict_for_room(self) or bool(offload_requests(self))

    setattr(search_prefix_match, _MARK, True)
    PagedAttentionCache.search_prefix_match = search_prefix_match  # type: ignore[method-assign]
    PagedAttentionCache.mark_complete_blocks = mark_complete_blocks  # type: ignore[method-assign]
    Scheduler._try_to_meet_safety_margin = evict_until_margin  # type: ignore[method-assign, assignment]
    OffloadingManager.offload_requests = offload_or_evict  # type: ignore[method-assign]
    # Both callers look the function up in their module at each call.
    cache_allocator.compute_block_hash = _salted(cache_allocator.compute_block_hash)  # type: ignore[assignment]


def evict_until_margin(scheduler: Scheduler) -> bool:
    """The scheduler's ``_try_to_meet_safety_margin``: whether the cache has its margin of free room
    for new prefills, after evicting as few cached blocks as that takes, least recently used first.

    A ledger's ``cached_blocks`` is in release order (a block reused leaves it, and comes back at its
    end when released again), so its head holds the blocks no request used for longest.
    """
    cache = scheduler.cache
    cache.pool.try_to_free_sectors()
    while cache.compute_free_capacity() < scheduler.safety_margin:
        if not _evict_oldest(cache):
            return False  # nothing cached is left to evict: new prefills wait
        cache.pool.try_to_free_sectors()
    return True


def evict_for_room(manager: OffloadingManager) -> bool:
    """Make room by evicting cached blocks, oldest first, before any running request is offloaded
    (the engine loop calls ``offload_requests`` when a batch could not be scheduled, or a running
    request could not grow); whether it made the room asked for.

    Running requests that could not grow (``starved_requests``): evicted until they all fit. No such
    request (a waiting one did not fit): one share, and the scheduler tries again, evicting a share
    more each time it still does not fit. False once nothing cached is left: the running requests
    are offloaded then, as transformers does.
    """
    cache, starved = manager.cache, manager.scheduler.starved_requests
    if not starved:
        return _evict_oldest(cache)
    needed = [
        {
            name: allocator.needs_new_blocks(state.request_id, state.current_len(), request_len)
            for name, allocator in cache.cache_allocators.items()
        }
        for state, request_len in starved
    ]
    while cache.count_storable_requests(needed) < len(starved):
        if not _evict_oldest(cache):
            return False
    return True


def _evict_oldest(cache: PagedAttentionCache) -> bool:
    """Evict the oldest :data:`EVICTED_SHARE` of every allocator's cached blocks (at least one), as
    transformers' ``evict_cached_blocks`` evicts them all; whether any was evicted."""
    evicted_any = False
    for allocator in cache.cache_allocators.values():
        ledger = allocator.ledger
        count = max(1, len(ledger.cached_blocks) // EVICTED_SHARE) if ledger.cached_blocks else 0
        oldest = list(itertools.islice(ledger.cached_blocks, count))
        for block_id in oldest:
            del ledger.cached_blocks[block_id]
            ledger.hash_to_block.pop(ledger.block_to_hash.pop(block_id))
        if oldest:
            cache.pool.free_blocks(allocator.index, oldest)
            evicted_any = True
    return evicted_any


def salt(request_id: str, owner: str) -> None:
    """Hash ``request_id``'s blocks in ``owner``'s space (no owner: the shared one)."""
    if owner:
        digest = hashlib.blake2b(owner.encode(), digest_size=8, person=b"resq-prefix").digest()
        _salts[request_id] = int.from_bytes(digest, "little")


def reused(request_id: str) -> int:
    """The prompt tokens the engine reused for ``request_id`` (0 when it matched nothing)."""
    return _hits.get(request_id, 0)


def forget(request_id: str) -> None:
    """Drop what was recorded for a request that ended."""
    _hits.pop(request_id, None)
    _salts.pop(request_id, None)
