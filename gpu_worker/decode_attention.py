"""Decode steps' attention per sequence, instead of over the whole batch's keys.

Without a flash kernel (on a CPU, or a GPU without ``flash-attn``), transformers'
continuous batching runs ``sdpa`` over one packed sequence: the cache is read into
one run of every request's keys and values (``index_select`` of the flat read
index), each key head is copied once per query head that shares it (``repeat_kv``),
and the query tokens of every request attend to that whole run under a
block-diagonal mask that keeps each to its own keys (``build_attention_mask``). A
decode step of B requests of about L tokens each then scores B x (B x L) pairs, of
which B x L count: the work grows with the square of the batch. On the bench's tiny
model at 32 requests it was half of the engine's step.

For a pure decode step (``max_length_q == 1``: one query token per request) of a
full-attention layer on a CPU cache, :func:`install`'s two wrappers do instead:

- ``PagedAttentionCache.update`` writes the new keys and values as transformers does,
  then reads the cache straight into a padded ``[B, kv_heads, max_keys, head_dim]``
  block (one gather, as transformers' own read is one), and leaves which of those
  keys are real in the layer's keyword arguments (:data:`VALID_KEYS`);
- the ``sdpa`` entry of transformers' attention registry, finding that mask, runs the
  layer as an ordinary batch of B one-token sequences through the ``sdpa`` function it
  wraps: each request's query attends to its own keys only, and transformers groups
  the query heads of one key head (``pack_gqa``) instead of copying keys: B x L pairs.

Everything else (a prefill or mixed step, ``generate``, sliding-window or latent
caches, a device cache, a model whose attention is not ``sdpa``, a model the engine
did not :func:`enable`) takes transformers' path unchanged. The result is the same
attention up to float rounding: ``tests/unit/test_decode_attention.py`` compares the
two on batches of mixed lengths, and the engine's tokens with it on and off.

Device caches are left alone on purpose: a GPU step may be captured in a CUDA graph,
whose shapes a padded block would change from step to step, and a GPU deployment runs
a flash kernel where one is installed. ``RESQ_DECODE_ATTENTION=false`` keeps
transformers' path on a CPU too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from transformers import PretrainedConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators.full_attention import (
    FullAttentionCacheAllocator,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

AttentionFunction = Callable[..., tuple[torch.Tensor, Any]]
CacheUpdate = Callable[
    [PagedAttentionCache, torch.Tensor, torch.Tensor, int, dict[str, Any]], tuple[torch.Tensor, ...]
]

VALID_KEYS = "resq_decode_valid_keys"
"""Keyword argument of a layer whose keys and values come padded: ``[B, max_keys]``, True where real."""

_ATTENTION = "sdpa"
_MARK = "_resq_decode_attention"
_ENABLED = "_resq_decode_attention"
_PLAN = "_resq_decode_plan"


def install() -> None:
    """Wrap the cache's update and the registry's ``sdpa`` function, once per process."""
    attention: AttentionFunction = ALL_ATTENTION_FUNCTIONS[_ATTENTION]
    if not getattr(attention, _MARK, False):
        ALL_ATTENTION_FUNCTIONS[_ATTENTION] = wrap_attention(attention)
    update: CacheUpdate = PagedAttentionCache.update
    if not getattr(update, _MARK, False):
        PagedAttentionCache.update = wrap_update(update)  # type: ignore[method-assign]


def enable(config: PretrainedConfig, on: bool) -> None:
    """Turn the per-sequence decode path on or off for the caches built from ``config``.

    ``config`` is the model's text config, the one transformers builds its paged cache
    from. Off, the wrappers leave every step to transformers.
    """
    setattr(config, _ENABLED, on)


def wrap_attention(stock: AttentionFunction) -> AttentionFunction:
    """``stock``, with a layer whose cache read came padded run as a batch of one-token sequences.

    The padded layer is handed to ``stock`` itself in the layout of an ordinary batched
    call (``[B, heads, 1, head_dim]`` queries, ``[B, kv_heads, max_keys, head_dim]`` keys
    and values, a ``[B, 1, 1, max_keys]`` padding mask), so whatever ``stock`` does with a
    model's options still applies; for one query token transformers' ``sdpa`` groups the
    query heads of a key head instead of copying the keys (``pack_gqa``).
    """

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        valid_keys: torch.Tensor | None = kwargs.pop(VALID_KEYS, None)
        if valid_keys is None:
            return stock(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
        sequences, heads, head_dim = key.shape[0], query.shape[1], query.shape[3]
        # [1, heads, B, head_dim] (one token per sequence) -> [B, heads, 1, head_dim].
        batched = query[0].transpose(0, 1).unsqueeze(2)
        kwargs["is_causal"] = False
        attended, weights = stock(
            module,
            batched,
            key,
            value,
            valid_keys[:, None, None, :],
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
        # [B, 1, heads, head_dim] -> [1, B, heads, head_dim], the packed call's shape.
        return attended.reshape(1, sequences, heads, head_dim), weights

    setattr(attention, _MARK, True)
    return attention


def wrap_update(stock: CacheUpdate) -> CacheUpdate:
    """``stock``, with a decode step's cache read padded per sequence where :func:`enabled`."""

    def update(
        cache: PagedAttentionCache,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, ...]:
        allocator = cache.layer_to_allocator[layer_idx]
        if not _takes_padded_read(allocator, cache, kwargs):
            return stock(cache, key_states, value_states, layer_idx, kwargs)
        cu_seq_lens_k: torch.Tensor = kwargs["cu_seq_lens_k"][allocator.layer_type]
        max_length_k: int = kwargs["max_length_k"][allocator.layer_type]
        read_index: torch.Tensor = kwargs["read_index"][allocator.index]
        plan = _plan(cache, read_index, cu_seq_lens_k, max_length_k)
        if plan is None:
            return stock(cache, key_states, value_states, layer_idx, kwargs)
        slots, valid = plan
        # What transformers' update selects for the layer, as it would.
        kwargs["cu_seq_lens_k"] = cu_seq_lens_k.to(torch.int32)
        kwargs["max_length_k"] = max_length_k
        kwargs[VALID_KEYS] = valid
        write_index: torch.Tensor = kwargs["write_index"][allocator.index]
        k_cache, v_cache = allocator._kv_token_views[layer_idx]
        # [1, kv_heads, B, head_dim] -> [B, kv_heads, head_dim], the cache's layout.
        k_cache.index_copy_(0, write_index, key_states[0].transpose(0, 1))
        v_cache.index_copy_(0, write_index, value_states[0].transpose(0, 1))
        # [B, max_keys, kv_heads, head_dim] seen as [B, kv_heads, max_keys, head_dim]. A flat
        # index_select: indexing with the 2-D slots directly took 5x as long on a CPU.
        padded_shape = (*slots.shape, *k_cache.shape[1:])
        keys = torch.index_select(k_cache, 0, slots.view(-1)).view(padded_shape)
        values = torch.index_select(v_cache, 0, slots.view(-1)).view(padded_shape)
        return keys.transpose(1, 2), values.transpose(1, 2)

    setattr(update, _MARK, True)
    return update


def enabled(config: PretrainedConfig) -> bool:
    """Whether :func:`enable` turned the decode path on for caches built from ``config``."""
    return bool(getattr(config, _ENABLED, False))


def _takes_padded_read(
    allocator: object, cache: PagedAttentionCache, kwargs: dict[str, Any]
) -> TypeGuard[FullAttentionCacheAllocator]:
    if not enabled(cache.config) or torch.device(cache.device).type != "cpu":
        return False
    # Exactly full attention: sliding windows and latent caches read differently.
    if type(allocator) is not FullAttentionCacheAllocator or kwargs.get("block_table") is not None:
        return False
    if kwargs.get("max_length_q") != 1 or cache.config._attn_implementation != _ATTENTION:
        return False
    # Only the wrapped attention function knows what a padded read is.
    if not getattr(ALL_ATTENTION_FUNCTIONS[_ATTENTION], _MARK, False):
        return False
    read_index: list[torch.Tensor] | None = kwargs.get("read_index")
    return (
        read_index is not None
        and len(read_index) > allocator.index
        and read_index[allocator.index].numel() > 0
    )


def padding_pays(requests: int, longest: int, total_keys: int) -> bool:
    """Whether a padded read of ``requests`` rows of ``longest`` keys beats the packed call.

    The packed call scores every query against all ``total_keys`` keys; the padded one
    gathers and scores ``requests x longest`` keys, of which ``total_keys`` are real. With
    lengths alike the padding is small and the padded call wins by about the batch size;
    with one long request among short ones it gathers mostly padding and loses (10x slower
    for one request of 4,000 keys beside 31 of 30, on this project's 2-core CPU). Measured
    there, the padded call won while the padded keys stayed within ``1 + requests / 10``
    times the real ones (32 requests: up to 4.2x; 8 requests: 1.8x).
    """
    return 10 * requests * longest <= total_keys * (10 + requests)


def _plan(
    cache: PagedAttentionCache, read_index: torch.Tensor, cu_seq_lens_k: torch.Tensor, max_length_k: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The padded read's cache slots and mask for this step, or None where padding does not pay."""
    # The same for every layer of a step: computed by the first, kept for the others
    # (the step's index tensors are the same objects in every layer's arguments).
    kept: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None = getattr(
        cache, _PLAN, None
    )
    if kept is not None and kept[0] is read_index and kept[1] is cu_seq_lens_k:
        return kept[2]
    plan: tuple[torch.Tensor, torch.Tensor] | None = None
    requests = cu_seq_lens_k.shape[0] - 1
    if padding_pays(requests, max_length_k, read_index.numel()):
        starts = cu_seq_lens_k[:-1].to(torch.long)
        lengths = cu_seq_lens_k[1:].to(torch.long) - starts
        offsets = torch.arange(max_length_k, device=read_index.device)
        valid = offsets.unsqueeze(0) < lengths.unsqueeze(1)
        # Padding reads each request's first key again; the mask leaves it out.
        positions = torch.where(valid, starts.unsqueeze(1) + offsets.unsqueeze(0), starts.unsqueeze(1))
        plan = read_index[positions], valid
    setattr(cache, _PLAN, (read_index, cu_seq_lens_k, plan))
    return plan
