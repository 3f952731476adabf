"""The per-sequence decode attention (gpu_worker/decode_attention.py) is transformers' attention.

Against transformers' own packed ``sdpa`` call (every request's keys in one run, the
block-diagonal mask transformers builds) on batches of mixed lengths, and end to end:
the engine's greedy tokens and their logprobs on the fixture model are the same with
the padded path on and off, and the padded path did run when on.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.generation.continuous_batching.utils import build_attention_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gpu_worker import decode_attention
from gpu_worker.engine import Engine
from gpu_worker.model_loading import LoadedModel, load_model
from resq.settings import Settings
from tests.fixture_model import ensure_fixture_model
from tests.support.engine import chat_prompt_ids, greedy_job, run_batch


class _Attention(torch.nn.Module):
    """What transformers' ``sdpa_attention_forward`` reads of its module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _packed_and_padded(
    lengths: list[int], heads: int, kv_heads: int, head_dim: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' packed attention and the padded one, for one decode step over ``lengths`` keys."""
    generator = torch.Generator().manual_seed(len(lengths) * 31 + heads)
    sequences = len(lengths)
    cumulative = [0]
    for length in lengths:
        cumulative.append(cumulative[-1] + length)
    query = torch.randn(1, heads, sequences, head_dim, generator=generator)
    key = torch.randn(1, kv_heads, cumulative[-1], head_dim, generator=generator)
    value = torch.randn(1, kv_heads, cumulative[-1], head_dim, generator=generator)
    # As transformers prepares it: filled with the dtype's minimum, then the blocks opened.
    mask = torch.full((1, 1, sequences, cumulative[-1]), torch.finfo(torch.float32).min)
    build_attention_mask(mask, list(range(sequences + 1)), cumulative)
    packed, _ = sdpa_attention_forward(_Attention(heads // kv_heads), query, key, value, mask, scaling=0.25)

    longest = max(lengths)
    valid = torch.zeros(sequences, longest, dtype=torch.bool)
    padded_key = torch.zeros(sequences, kv_heads, longest, head_dim)
    padded_value = torch.zeros(sequences, kv_heads, longest, head_dim)
    for index, length in enumerate(lengths):
        start = cumulative[index]
        valid[index, :length] = True
        padded_key[index, :, :length] = key[0, :, start : start + length]
        padded_value[index, :, :length] = value[0, :, start : start + length]
    attention = decode_attention.wrap_attention(sdpa_attention_forward)
    padded, _ = attention(
        _Attention(heads // kv_heads),
        query,
        padded_key,
        padded_value,
        None,
        scaling=0.25,
        is_causal=False,
        **{decode_attention.VALID_KEYS: valid},
    )
    return packed, padded


@pytest.mark.parametrize(("sequences", "heads", "kv_heads"), [(1, 4, 4), (5, 4, 2), (32, 8, 2), (17, 6, 1)])
def test_padded_attention_is_the_packed_attention(sequences: int, heads: int, kv_heads: int) -> None:
    rng = random.Random(sequences)
    lengths = [rng.randint(1, 300) for _ in range(sequences)]
    packed, padded = _packed_and_padded(lengths, heads, kv_heads)
    assert padded.shape == packed.shape == (1, sequences, heads, 16)
    torch.testing.assert_close(padded, packed, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(Settings(model=str(ensure_fixture_model()), device="cpu"))


Generated = dict[str, tuple[list[int], list[float]]]
"""Each request's greedy tokens and their logprobs."""


def _started_engine(loaded: LoadedModel, on: bool) -> Engine:
    engine = Engine(
        loaded,
        Settings(
            model=str(ensure_fixture_model()),
            device="cpu",
            kv_cache_tokens=8192,
            kv_page_size=16,
            logprobs=True,
            decode_attention=on,
        ),
    )
    engine.start()
    return engine


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of ``decode_attention.<name>`` that return something (a one-item list)."""
    function = getattr(decode_attention, name)
    count = [0]

    def counting(*args: Any) -> Any:
        result = function(*args)
        count[0] += result is not None
        return result

    monkeypatch.setattr(decode_attention, name, counting)
    return count


def _generated(outputs: dict[str, Any]) -> Generated:
    return {
        request_id: (list(output.generated_tokens), [float(value) for value in output.logprobs or []])
        for request_id, output in outputs.items()
    }


def _assert_same(stock: Generated, other: Generated) -> None:
    assert set(other) == set(stock)
    for request_id, (tokens, logprobs) in stock.items():
        assert other[request_id][0] == tokens, request_id
        assert len(logprobs) == len(tokens) > 0
        assert other[request_id][1] == pytest.approx(logprobs, abs=1e-4), request_id


def _generate(loaded: LoadedModel, padded: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Generated, int]:
    """Greedy tokens and logprobs of a batch of alike prompts; how many steps read padded."""
    padded_steps = _counted(monkeypatch, "_plan")
    engine = _started_engine(loaded, padded)
    try:
        # Lengths alike, as padding pays only then; not equal, so that padding is masked.
        texts = [
            "What is the weather like in Paris today?",
            "What is the weather like in Rome, please?",
            "Tell me what the weather is in Oslo now.",
            "Weather in Lima?",
            "What will the weather be like in Madrid tomorrow morning, roughly?",
        ]
        jobs = [
            greedy_job(f"resp_{index}", chat_prompt_ids(loaded, text), 24) for index, text in enumerate(texts)
        ]
        outputs = run_batch(engine, jobs)
    finally:
        engine.stop()
        monkeypatch.undo()
    assert set(outputs) == {job.response_id for job in jobs}
    return _generated(outputs), padded_steps[0]


def test_padding_pays_for_alike_lengths_only() -> None:
    # 32 requests of 280 keys: no padding at all.
    assert decode_attention.padding_pays(32, 280, 32 * 280)
    # 32 requests of 1-300 keys: about half the padded keys are real.
    assert decode_attention.padding_pays(32, 300, 4_400)
    # One request of 4,000 keys beside 31 of 30: padding would gather 26x the real keys.
    assert not decode_attention.padding_pays(32, 4_000, 4_000 + 31 * 30)
    # Small batches allow less padding: 8 requests, one of 1,200 beside 300s.
    assert not decode_attention.padding_pays(8, 1_200, 2 * 1_200 + 6 * 300)
    assert decode_attention.padding_pays(4, 2_000, 4 * 2_000)


def _decode_step(**overrides: Any) -> tuple[Any, Any, dict[str, Any]]:
    """An allocator, a cache and a layer's arguments that take the padded read; ``overrides`` change one."""
    from types import SimpleNamespace

    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )

    config = SimpleNamespace(_attn_implementation="sdpa")
    decode_attention.enable(config, overrides.pop("enabled", True))  # type: ignore[arg-type]
    allocator = object.__new__(overrides.pop("allocator_class", FullAttentionCacheAllocator))
    allocator.index = 0
    cache = SimpleNamespace(config=config, device=torch.device(overrides.pop("device", "cpu")))
    config._attn_implementation = overrides.pop("attn_implementation", "sdpa")
    kwargs: dict[str, Any] = {
        "max_length_q": 1,
        "block_table": None,
        "read_index": [torch.arange(12)],
        **overrides,
    }
    return allocator, cache, kwargs


def test_the_padded_read_is_taken_only_by_cpu_decode_steps_of_full_attention() -> None:
    from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (
        SlidingAttentionCacheAllocator,
    )

    decode_attention.install()
    allocator, cache, kwargs = _decode_step()
    assert decode_attention._takes_padded_read(allocator, cache, kwargs)
    refused: list[dict[str, Any]] = [
        {"enabled": False},  # RESQ_DECODE_ATTENTION=false
        {"device": "meta"},  # a device cache: CUDA graphs, flash kernels
        {"max_length_q": 2},  # a prefill or mixed step
        {"allocator_class": SlidingAttentionCacheAllocator},  # reads a window, not the whole past
        {"attn_implementation": "paged|eager"},  # an attention that knows no padded read
        {"block_table": torch.zeros(1, 1)},  # the flash kernels' decode path
        {"read_index": [torch.arange(0)]},  # nothing cached to read
    ]
    for override in refused:
        allocator, cache, kwargs = _decode_step(**override)
        assert not decode_attention._takes_padded_read(allocator, cache, kwargs), override


def _mixed_step(
    query_lengths: list[int], key_lengths: list[int], heads: int = 4, kv_heads: int = 2
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]:
    """A packed prefill or mixed step as transformers hands it to ``sdpa``, on a module the engine enabled."""
    from types import SimpleNamespace

    generator = torch.Generator().manual_seed(sum(query_lengths))
    query_offsets, key_offsets = [0], [0]
    for queries, keys in zip(query_lengths, key_lengths, strict=True):
        query_offsets.append(query_offsets[-1] + queries)
        key_offsets.append(key_offsets[-1] + keys)
    query = torch.randn(1, heads, query_offsets[-1], 16, generator=generator)
    key = torch.randn(1, kv_heads, key_offsets[-1], 16, generator=generator)
    value = torch.randn(1, kv_heads, key_offsets[-1], 16, generator=generator)
    mask = torch.full((1, 1, query_offsets[-1], key_offsets[-1]), torch.finfo(torch.float32).min)
    build_attention_mask(mask, query_offsets, key_offsets)
    module = _Attention(heads // kv_heads)
    config = SimpleNamespace()
    decode_attention.enable(config, True)  # type: ignore[arg-type]
    module.__dict__["config"] = config  # as a decoder's attention holds its model's text config
    kwargs = {
        "cu_seq_lens_q": torch.tensor(query_offsets, dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor(key_offsets, dtype=torch.int32),
        "max_length_q": max(query_lengths),
        "max_length_k": max(key_lengths),
        "is_causal": False,
    }
    return module, (query, key, value, mask), kwargs


@pytest.mark.parametrize(
    ("query_lengths", "key_lengths"),
    [
        # An agent's next turn (200 new tokens over its cached history) beside 15 decoding agents.
        ([1] * 15 + [200], [900] * 15 + [1_100]),
        # Prefill chunks of 16 requests with cached prefixes, no decoding row.
        ([16] * 16, [300] * 16),
        # Decoding rows of unequal lengths beside two prefills.
        ([1, 1, 120, 1, 40], [300, 20, 900, 600, 40]),
    ],
)
def test_a_mixed_step_attended_per_request_is_the_packed_attention(
    query_lengths: list[int], key_lengths: list[int]
) -> None:
    module, (query, key, value, mask), kwargs = _mixed_step(query_lengths, key_lengths)
    assert decode_attention._mixed_step_requests(module, query, mask, dict(kwargs)) is not None
    packed, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25, **kwargs)
    attention = decode_attention.wrap_attention(sdpa_attention_forward)
    split, _ = attention(module, query, key, value, mask, scaling=0.25, **kwargs)
    torch.testing.assert_close(split, packed, rtol=1e-5, atol=1e-5)


def test_small_or_disabled_steps_keep_the_packed_call() -> None:
    # 64 prefills of 8 tokens: 64 calls cost more than the one packed call's few pairs.
    module, (query, _, _, mask), kwargs = _mixed_step([8] * 64, [8] * 64)
    assert decode_attention._mixed_step_requests(module, query, mask, kwargs) is None
    module, (query, _, _, mask), kwargs = _mixed_step([1] * 15 + [200], [900] * 15 + [1_100])
    # A model with several layer types hands a dict of masks: the packed call handles it.
    assert decode_attention._mixed_step_requests(module, query, {"full_attention": mask}, kwargs) is None  # type: ignore[arg-type]
    decode_attention.enable(module.config, False)  # type: ignore[arg-type]
    assert decode_attention._mixed_step_requests(module, query, mask, kwargs) is None


def _staggered(loaded: LoadedModel, on: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Generated, int]:
    """Four long requests decoding when a fifth arrives (mixed steps); tokens, logprobs, split steps."""
    split_calls = _counted(monkeypatch, "_attend_per_request")
    engine = _started_engine(loaded, on)
    outputs: dict[str, Any] = {}
    try:
        history = " ".join(f"note{index}" for index in range(120))
        first = [
            greedy_job(f"resp_long_{index}", chat_prompt_ids(loaded, f"{history} Question {index}?"), 32)
            for index in range(4)
        ]
        late = greedy_job("resp_late", chat_prompt_ids(loaded, "Tell me a story " * 20), 8)
        started: set[str] = set()
        for job in first:
            assert engine.acquire_slot(5)
            engine.add(job)
        deadline = time.monotonic() + 120
        while len(outputs) < 5 and time.monotonic() < deadline:
            for output in engine.next_outputs(0.5):
                started.add(output.request_id)
                if output.is_finished():
                    outputs[output.request_id] = output
                    engine.forget(output.request_id)
                    engine.release_slot()
            if late.response_id not in started and started >= {job.response_id for job in first}:
                # Every long request is decoding: the late prompt's prefill shares their steps.
                assert engine.acquire_slot(5)
                engine.add(late)
                started.add(late.response_id)
    finally:
        engine.stop()
        monkeypatch.undo()
    assert len(outputs) == 5
    return _generated(outputs), split_calls[0]


@pytest.mark.parametrize(
    "workload",
    [
        pytest.param(_generate, id="decode steps read padded"),
        pytest.param(_staggered, id="mixed steps attended per request"),
    ],
)
def test_the_engine_decodes_the_same_with_attention_per_request(
    loaded: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
    workload: Callable[[LoadedModel, bool, pytest.MonkeyPatch], tuple[Generated, int]],
) -> None:
    stock, stock_steps = workload(loaded, False, monkeypatch)
    per_request, per_request_steps = workload(loaded, True, monkeypatch)
    # The path under test ran, and only with the setting on.
    assert stock_steps == 0 and per_request_steps > 0
    _assert_same(stock, per_request)
