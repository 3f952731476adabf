"""Prompt pieces encoded before are reused: the same ids as the whole prompt's encode, by owner, bounded."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers

from api.generation_plan import GenerationPlan
from api.prompting import render_prompt
from resq.catalog import TextTokenizer
from resq.piece_cache import ENTRY_OVERHEAD_CHARS, PieceCache
from resq.prompt_tokens import PromptEncoder
from tests.support.tokenizer import tiny_tokenizer
from tests.unit.test_prompt_tokens import _metaspace_tokenizer, _stripping_tokenizer

# --- the cache itself --------------------------------------------------------------------------------


def test_the_least_recently_used_pieces_go_first_and_the_bound_holds() -> None:
    size = 10 + ENTRY_OVERHEAD_CHARS
    cache = PieceCache(max_chars=3 * size)
    for name in ("a", "b", "c"):
        cache.put("owner", name * 10, [1, 2])
    assert cache.get("owner", "a" * 10) is not None  # "a" is now the most recently used
    cache.put("owner", "d" * 10, [3])
    assert cache.get("owner", "b" * 10) is None  # the least recently used went
    assert [list(cache.get("owner", name * 10) or []) for name in "acd"] == [[1, 2], [1, 2], [3]]
    assert len(cache) == 3 and cache.chars == 3 * size


def test_a_piece_larger_than_the_bound_is_not_kept_and_evicts_nothing() -> None:
    cache = PieceCache(max_chars=1000)
    cache.put("owner", "kept", [1])
    cache.put("owner", "x" * 1000, [2])
    assert cache.get("owner", "x" * 1000) is None
    assert cache.get("owner", "kept") is not None


def test_pieces_are_kept_per_owner() -> None:
    cache = PieceCache(max_chars=10_000)
    cache.put("key-a", "the instructions", [7, 8])
    assert cache.get("key-b", "the instructions") is None
    assert list(cache.get("key-a", "the instructions") or []) == [7, 8]
    assert (cache.hits, cache.misses) == (1, 1)


# --- the same ids as the tokenizer's own -------------------------------------------------------------


def _nfc_tokenizer() -> TextTokenizer:
    """The tiny tokenizer behind an NFC normaliser (as Qwen's are)."""
    tiny = tiny_tokenizer()
    tokenizer = Tokenizer.from_str(tiny.tokenizer.to_str())
    tokenizer.normalizer = normalizers.NFC()
    return TextTokenizer(card=tiny.card, tokenizer=tokenizer)


def _prefix_space_tokenizer() -> TextTokenizer:
    """The tiny tokenizer whose byte-level pre-tokenizer adds a space before each stretch."""
    tiny = tiny_tokenizer()
    tokenizer = Tokenizer.from_str(tiny.tokenizer.to_str())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    return TextTokenizer(card=tiny.card, tokenizer=tokenizer)


def _raw_markup_tokenizer() -> TextTokenizer:
    """The tiny tokenizer with a non-special markup token matched in the raw text, whose text
    begins with another's (``<|im_end|>`` and ``<|im_end|>x``: the longest match wins)."""
    tiny = tiny_tokenizer()
    tokenizer = Tokenizer.from_str(tiny.tokenizer.to_str())
    tokenizer.add_tokens([AddedToken("<|im_end|>x", normalized=False, special=False)])
    return TextTokenizer(card=tiny.card, tokenizer=tokenizer)


SPLITTING = [tiny_tokenizer, _nfc_tokenizer, _prefix_space_tokenizer, _raw_markup_tokenizer]
FRAGMENTS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|im_end|>x",
    "<|endoftext|>",
    "<think>",
    "</tool_call>",
    "user\n",
    " ",
    "  ",
    "\n",
    "Hello",
    " world",
    "e\u0301",  # a base and a combining mark: NFC composes them
    "\u0301",
    "こんにちは",
    "😀",
    "22C",
    "'s",
]


@pytest.mark.parametrize("make", SPLITTING)
@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=40))
def test_pieces_cold_and_warm_give_the_tokenizers_own_ids(make: Any, parts: list[str]) -> None:
    tokenizer = make()
    encoder = PromptEncoder(tokenizer.tokenizer)
    assert encoder._piece_splitter is not None
    text = "".join(parts)
    expected = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    for owner in ("a", "a", "b"):  # cold, warm, and another owner's cold
        assert encoder.prompt_ids(lambda _messages, _tools: text, [], None, cache_owner=owner) == expected


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (_metaspace_tokenizer, "its first stretch is treated apart (prepend_scheme: first)"),
        (_stripping_tokenizer, "an added token strips the whitespace around it"),
    ],
)
def test_no_pieces_where_stretches_are_not_independent(make: Any, why: str) -> None:
    tokenizer = make()
    encoder = PromptEncoder(tokenizer.tokenizer)
    assert encoder._piece_splitter is None, why
    text = "<|im_start|>user\nsay hello<|im_end|>\n<|im_start|>assistant\n"
    assert encoder.prompt_ids(lambda _m, _t: text, [], None, cache_owner="a") == tokenizer.encode(text)
    assert len(encoder.pieces) == 0


def test_no_pieces_for_a_tokenizer_that_truncates() -> None:
    tokenizer = Tokenizer.from_str(tiny_tokenizer().tokenizer.to_str())
    tokenizer.enable_truncation(max_length=8)
    assert PromptEncoder(tokenizer)._piece_splitter is None


# --- an agent's resent history -------------------------------------------------------------------------


def _history(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 40}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}: what is in notes.txt? " * 5})
        messages.append({"role": "assistant", "content": f"It says {turn}."})
    return messages


def test_a_resent_history_is_encoded_once_and_only_the_new_turn_again() -> None:
    tokenizer = tiny_tokenizer()
    encoder = PromptEncoder(tokenizer.tokenizer)
    render = lambda messages, tools: tokenizer.render(messages, tools)  # noqa: E731
    for turns in range(1, 6):
        messages = _history(turns)
        misses = encoder.pieces.misses
        ids = encoder.prompt_ids(render, messages, None, cache_owner="agent")
        assert ids == tokenizer.encode(tokenizer.render(messages))
        if turns > 1:
            # The system prompt and every earlier message were found; only the new turn's pieces
            # (its user message, its answer, the generation prompt's stretch) were encoded.
            assert encoder.pieces.misses - misses <= 3
    assert encoder.pieces.hits > 0


def test_render_prompt_keeps_the_pieces_of_the_owner_it_is_given() -> None:
    tokenizer = TextTokenizer(card=tiny_tokenizer().card, tokenizer=tiny_tokenizer().tokenizer)
    pieces = tokenizer._prompt_encoder.pieces
    messages = _history(2)
    first = render_prompt(tokenizer, messages, GenerationPlan(), owner="key-a")
    hits = pieces.hits
    assert render_prompt(tokenizer, messages, GenerationPlan(), owner="key-a") == first
    assert pieces.hits > hits
    hits = pieces.hits
    assert render_prompt(tokenizer, messages, GenerationPlan(), owner="key-b") == first
    assert pieces.hits == hits  # another key finds none of them
    count = len(pieces)
    assert render_prompt(tokenizer, messages, GenerationPlan()) == first
    assert len(pieces) == count  # no owner: encoded whole, nothing kept
