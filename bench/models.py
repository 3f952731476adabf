"""The models the bench serves: built locally from random weights, EOS made unreachable.

- ``tiny``: the built-in model (2 layers, hidden 64, ~0.4M parameters): an engine
  step costs a few milliseconds, so what the queue costs shows plainly.
- ``bench``: the same tokenizer and chat template on a Llama of 6 layers, hidden
  384 (~10M parameters). With one torch thread on this CPU a decode step costs
  ~9 ms for one sequence and ~25-30 ms for 32, about what a 7-8B model's step
  costs on one data-centre GPU (memory-bound decoding, 15-30 ms per step): the
  queue's overhead is then weighed against a realistic step.

Both rows of the end-of-sequence tokens in the (tied) embedding are zeroed, so
their logit is exactly 0 while the largest of the ~2,000 other random logits is
positive: greedy decoding never ends early and every request generates exactly
``max_output_tokens`` (the bench checks the count of each request).
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BUILD_VERSION = "1"


@dataclass(frozen=True)
class ModelSize:
    """The shape of a bench model."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


BENCH_SIZE = ModelSize(
    hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2
)


@dataclass(frozen=True)
class BenchModel:
    """A model directory the bench serves, with its short name and what it stands for."""

    key: str
    path: Path
    description: str

    @property
    def served_name(self) -> str:
        """The ``model`` clients of resq send."""
        return f"bench-{self.key}"


def _build_locked(target: Path, build: Callable[[Path], None]) -> Path:
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".bench-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
        try:
            build(staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _copy_tokenizer(source: Path, target: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy2(source / name, target / name)


def _silence_eos(model: object, eos_ids: list[int]) -> None:
    import torch

    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight  # type: ignore[attr-defined]
        embeddings[eos_ids] = 0.0
        head = model.get_output_embeddings().weight  # type: ignore[attr-defined]
        head[eos_ids] = 0.0


def _eos_ids(builtin: Path) -> list[int]:
    from transformers import GenerationConfig

    configured = GenerationConfig.from_pretrained(builtin).eos_token_id
    return [configured] if isinstance(configured, int) else list(configured or [])


def ensure_tiny(cache_dir: Path) -> BenchModel:
    """The built-in model with EOS made unreachable."""
    from gpu_worker.builtin_model import ensure_builtin_model

    builtin = ensure_builtin_model()

    def build(out: Path) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(builtin)
        _silence_eos(model, _eos_ids(builtin))
        model.save_pretrained(out)
        _copy_tokenizer(builtin, out)

    path = _build_locked(cache_dir / f"bench-tiny-{BUILD_VERSION}-{builtin.name}", build)
    return BenchModel("tiny", path, "built-in tiny Llama (2 layers, hidden 64, ~0.4M parameters)")


def ensure_bench(cache_dir: Path, size: ModelSize = BENCH_SIZE) -> BenchModel:
    """A Llama of ``size`` with random weights (seed 0) and the built-in tokenizer."""
    from gpu_worker.builtin_model import CONTEXT_LENGTH, ensure_builtin_model

    builtin = ensure_builtin_model()
    tag = f"h{size.hidden_size}-l{size.num_hidden_layers}-i{size.intermediate_size}"

    def build(out: Path) -> None:
        import torch
        from transformers import AutoConfig, GenerationConfig, LlamaForCausalLM

        base = AutoConfig.from_pretrained(builtin)
        config = base.__class__(
            **{
                **base.to_dict(),
                "hidden_size": size.hidden_size,
                "intermediate_size": size.intermediate_size,
                "num_hidden_layers": size.num_hidden_layers,
                "num_attention_heads": size.num_attention_heads,
                "num_key_value_heads": size.num_key_value_heads,
                "head_dim": size.hidden_size // size.num_attention_heads,
                "max_position_embeddings": CONTEXT_LENGTH,
            }
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.generation_config = GenerationConfig.from_pretrained(builtin)
        _silence_eos(model, _eos_ids(builtin))
        model.save_pretrained(out)
        _copy_tokenizer(builtin, out)

    path = _build_locked(cache_dir / f"bench-{tag}-{BUILD_VERSION}-{builtin.name}", build)
    parameters = _parameter_count(size)
    return BenchModel(
        "bench",
        path,
        f"Llama, {size.num_hidden_layers} layers, hidden {size.hidden_size}, "
        f"~{parameters / 1e6:.0f}M parameters, random weights",
    )


def _parameter_count(size: ModelSize, vocab: int = 2057) -> int:
    head_dim = size.hidden_size // size.num_attention_heads
    attention = size.hidden_size * head_dim * (2 * size.num_attention_heads + 2 * size.num_key_value_heads)
    mlp = 3 * size.hidden_size * size.intermediate_size
    return vocab * size.hidden_size + size.num_hidden_layers * (attention + mlp)
