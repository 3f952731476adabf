"""Realistic token streams for B3: real English text through the served tokenizer.

Each stream is a window of the Python documentation (the ``pydoc`` topics that
ship with Python, the built-in model's training text) tokenized by the model's
own tokenizer, so tokens split words, punctuation and whitespace the way a real
model's output does. Every third stream is a reasoning answer
(``<think>...</think>`` then the answer) post-processed with the ``qwen3``
reasoning parser, which walks the text token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

REASONING_EVERY = 3


@dataclass(frozen=True)
class SyntheticStream:
    """The token ids of one response, and whether it carries reasoning."""

    token_ids: list[int]
    reasoning: bool


def _corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def make_streams(tokenizer: Tokenizer, count: int, tokens: int) -> list[SyntheticStream]:
    """``count`` streams of exactly ``tokens`` token ids each, from different places of the corpus."""
    ids = tokenizer.encode(_corpus(), add_special_tokens=False).ids
    think_open = tokenizer.encode("<think>\n", add_special_tokens=False).ids
    think_close = tokenizer.encode("\n</think>\n\n", add_special_tokens=False).ids
    stride = max(1, (len(ids) - tokens) // max(1, count))
    streams = []
    for index in range(count):
        window = ids[index * stride : index * stride + tokens]
        if index % REASONING_EVERY == REASONING_EVERY - 1:
            half = (tokens - len(think_open) - len(think_close)) // 2
            body = window[: tokens - len(think_open) - len(think_close)]
            window = think_open + body[:half] + think_close + body[half:]
            streams.append(SyntheticStream(window[:tokens], True))
        else:
            streams.append(SyntheticStream(window, False))
    return streams
