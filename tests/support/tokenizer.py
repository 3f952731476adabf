"""A small real tokenizer for unit tests (trained in-process with the `tokenizers` library)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from resq.catalog import ModelCard, TextTokenizer, tokenizer_sha256

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "gpu_worker" / "builtin_model" / "chat_template.jinja"
CORPUS = [
    "Hello! How can I help you today? The answer is 4. Two plus two equals four.",
    "こんにちは、世界！ 😀 héllo wörld, naïve café — ça va?",
    "It is 22C and sunny in Paris. Let me check the weather in Oslo and Rome.",
]


@lru_cache(maxsize=1)
def tiny_tokenizer() -> TextTokenizer:
    """A byte-level BPE with ChatML specials and non-special markup tokens, wrapped as resq sees it."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer)
    bpe.add_tokens(
        [AddedToken(tag, special=False) for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>")]
    )
    tokenizer_json = bpe.to_str()
    card = ModelCard(
        name="tiny",
        context_length=256,
        chat_template=TEMPLATE_PATH.read_text(),
        special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        eos_token_ids=[bpe.token_to_id("<|im_end|>")],
        tokenizer_sha256=tokenizer_sha256(tokenizer_json),
        created=0,
        source="test",
    )
    return TextTokenizer(card=card, tokenizer=bpe)
