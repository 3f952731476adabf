"""Attention per request on a CPU, instead of over the whole batch's keys.

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

A prefill or mixed step (a new prompt's tokens beside requests that decode: an agent's next
turn while other agents generate) pays the same square: every query token is scored against
every request's keys. There the ``sdpa`` wrapper, given transformers' packed call, attends
each prefilling request to its own keys under its own block of transformers' mask, and the
one-token requests as one padded batch, where the per-request pairs plus a cost per call
(:data:`MIXED_STEP_CALL_COST`) come to less than the packed call's; otherwise it makes the
packed call. On a 16-loop agent workload this cut the turn-10 time to first token by 3x.

Everything else (``generate``, sliding-window or latent caches, sinks or soft caps, a device
cache, a model whose attention is not ``sdpa``, a model the engine did not :func:`enable`)
takes transformers' path unchanged. The result is the same attention up to float rounding:
``tests/unit/test_decode_attention.py`` compares the two on batches of mixed lengths, and the
engine's tokens with it on and off, decode-only and mixed steps both.

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
    """Turn attention per request on or off for the model whose text config is ``config``.

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
            requests = _mixed_step_requests(module, query, attention_mask, kwargs)
            if requests is None:
                return stock(
                    module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
                )
            assert attention_mask is not None
            kwargs["is_causal"] = False
            return _attend_per_request(
                stock, module, query, key, value, attention_mask, requests, dropout, scaling, kwargs
            ), None
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


MIXED_STEP_CALL_COST = 10_000
"""What one more ``sdpa`` call costs, in scored pairs: ~54 us against ~5.5 ns a pair, on this
project's 2-core CPU (64 prefills of 8 tokens, one call each against one packed call)."""


def _mixed_step_requests(
    module: torch.nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[list[int], list[int]] | None:
    """The step's query and key offsets per request where attending each on its own pays, else None.

    A prefill or mixed step (some request with more than one query token) on a CPU, packed
    against a block-diagonal mask: the packed call scores every query token against every
    request's keys. Attended per request instead, each prefill scores its own block and the
    one-token requests go as one padded batch; that pays when the packed call's pairs exceed
    the per-request ones by a quarter, each ``sdpa`` call counted as :data:`MIXED_STEP_CALL_COST`
    pairs.
    """
    config = getattr(module, "config", None)
    if config is None or not enabled(config) or query.device.type != "cpu" or query.shape[0] != 1:
        return None
    cu_seq_lens_q, cu_seq_lens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if not isinstance(cu_seq_lens_q, torch.Tensor) or not isinstance(cu_seq_lens_k, torch.Tensor):
        return None
    if not isinstance(kwargs.get("max_length_q"), int) or kwargs["max_length_q"] <= 1:
        return None
    # A window or sinks change which keys count: left to the packed call, which knows them.
    # (A model with several layer types hands a dict of masks: left to the packed call too.)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return None
    if getattr(module, "sliding_window", None) is not None:
        return None
    if any(kwargs.get(name) is not None for name in ("s_aux", "sinks", "softcap", "position_bias")):
        return None
    query_offsets: list[int] = cu_seq_lens_q.tolist()
    key_offsets: list[int] = cu_seq_lens_k.tolist()
    requests = len(query_offsets) - 1
    if requests < 2 or query_offsets[-1] != query.shape[2] or len(key_offsets) != requests + 1:
        return None
    packed_pairs = query_offsets[-1] * key_offsets[-1]
    split_pairs = 0
    decoding, longest_decoding = 0, 0
    for index in range(requests):
        queries = query_offsets[index + 1] - query_offsets[index]
        keys = key_offsets[index + 1] - key_offsets[index]
        if queries == 1:
            decoding += 1
            longest_decoding = max(longest_decoding, keys)
        else:
            split_pairs += queries * keys + MIXED_STEP_CALL_COST
    if decoding:
        split_pairs += decoding * longest_decoding + MIXED_STEP_CALL_COST
    return (query_offsets, key_offsets) if 4 * packed_pairs > 5 * split_pairs else None


def _attend_per_request(
    stock: AttentionFunction,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    offsets: tuple[list[int], list[int]],
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """``stock`` per prefilling request on its own block of the mask, the one-token ones padded."""
    query_offsets, key_offsets = offsets
    heads, head_dim = query.shape[1], query.shape[3]
    attended = query.new_empty(1, query.shape[2], heads, head_dim)
    decoding: list[int] = []
    for index in range(len(query_offsets) - 1):
        q_start, q_end = query_offsets[index], query_offsets[index + 1]
        k_start, k_end = key_offsets[index], key_offsets[index + 1]
        if q_end - q_start == 1:
            decoding.append(index)
            continue
        # The request's own block of transformers' mask: its causal (or windowed) part.
        block, _ = stock(
            module,
            query[:, :, q_start:q_end],
            key[:, :, k_start:k_end],
            value[:, :, k_start:k_end],
            attention_mask[..., q_start:q_end, k_start:k_end],
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
        attended[:, q_start:q_end] = block
    if decoding:
        rows = torch.tensor([query_offsets[index] for index in decoding])
        starts = torch.tensor([key_offsets[index] for index in decoding])
        lengths = torch.tensor([key_offsets[index + 1] - key_offsets[index] for index in decoding])
        offsets_k = torch.arange(int(lengths.max()))
        valid = offsets_k.unsqueeze(0) < lengths.unsqueeze(1)
        positions = torch.where(valid, starts.unsqueeze(1) + offsets_k.unsqueeze(0), starts.unsqueeze(1))
        padded_shape = (*positions.shape, key.shape[1], head_dim)
        # [1, kv_heads, K, d] -> [K, kv_heads, d] -> [B, max_keys, kv_heads, d] -> [B, kv_heads, max_keys, d].
        keys = key[0].transpose(0, 1).index_select(0, positions.view(-1)).view(padded_shape).transpose(1, 2)
        values = (
            value[0].transpose(0, 1).index_select(0, positions.view(-1)).view(padded_shape).transpose(1, 2)
        )
        batched = query[0].index_select(1, rows).transpose(0, 1).unsqueeze(2)
        rows_attended, _ = stock(
            module, batched, keys, values, valid[:, None, None, :], dropout=dropout, scaling=scaling, **kwargs
        )
        attended[0].index_copy_(0, rows, rows_attended[:, 0])
    return attended


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
