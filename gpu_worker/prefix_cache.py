"""Prefix caching: how many prompt tokens the engine reused, as the engine itself decided.

transformers' paged cache shares the KV blocks of a prompt prefix another request already
computed (``allow_block_sharing``, on unless ``RESQ_PREFIX_CACHING=false``): when the
scheduler first admits a request, ``PagedAttentionCache.search_prefix_match`` returns the
number of prompt tokens whose blocks it shares instead of computing them. resq records that
number per engine request (wrapping the method once per process) and reports it as
``usage.input_tokens_details.cached_tokens``; nothing is estimated. A model whose cache
cannot share blocks (sliding-window or hybrid attention) matches nothing: 0.
"""

from __future__ import annotations

from transformers.generation.continuous_batching.cache import PagedAttentionCache

_MARK = "_resq_records_prefix_hits"
_hits: dict[str, int] = {}
"""Engine request id -> prompt tokens reused at its admission (written by the engine thread)."""


def install() -> None:
    """Record every prefix match of this process's engines (idempotent)."""
    current = PagedAttentionCache.search_prefix_match
    if getattr(current, _MARK, False):
        return

    def search_prefix_match(self: PagedAttentionCache, request_id: str, prompt_ids: list[int]) -> int:
        matched: int = current(self, request_id, prompt_ids)
        # A request is matched when it is first scheduled; should it ever be matched again, the
        # first figure is the one its prompt got.
        _hits.setdefault(request_id, matched)
        return matched

    setattr(search_prefix_match, _MARK, True)
    PagedAttentionCache.search_prefix_match = search_prefix_match  # type: ignore[method-assign]


def reused(request_id: str) -> int:
    """The prompt tokens the engine reused for ``request_id`` (0 when it matched nothing)."""
    return _hits.get(request_id, 0)


def forget(request_id: str) -> None:
    """Drop what was recorded for a request that ended."""
    _hits.pop(request_id, None)
