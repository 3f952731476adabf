"""The built-in tiny model: for smoke runs and tests, never for real answers.

On first use it builds a Llama-style model with random weights (fixed seed) and
a byte-level BPE tokenizer trained with ``tokenizers`` on text that ships with
Python itself (the ``pydoc`` topics), with a ChatML chat template, and caches
it under the user's cache dir. It loads through the same ``from_pretrained``
path as any real model.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

BUILD_VERSION = "1"
"""Bump when the recipe changes, so cached copies are rebuilt."""

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not special (kept by skip_special_tokens decoding), exactly as in Qwen3.
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 2048
CONTEXT_LENGTH = 4096


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/resq`` (or ``~/.cache/resq``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "resq"


def _recipe_hash() -> str:
    digest = hashlib.sha256()
    digest.update(BUILD_VERSION.encode())
    digest.update(CHAT_TEMPLATE_PATH.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:12]


def ensure_builtin_model(cache_dir: Path | None = None) -> Path:
    """The directory of the built-in model, building it on first use (once, under a file lock)."""
    root = cache_dir or default_cache_dir()
    target = root / f"builtin-model-{_recipe_hash()}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".builtin-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        log.info("building the built-in tiny model in %s (first use only)", target)
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        try:
            _build(staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _training_text() -> list[str]:
    from pydoc_data.topics import topics

    return list(topics.values())


def _build(out_dir: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_text(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[],
    )
    tokenizer.add_tokens(MARKUP_TOKENS, special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE_PATH.read_text()

    im_end = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))  # type: ignore[arg-type]
    endoftext = int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))  # type: ignore[arg-type]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT_LENGTH,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=endoftext)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
