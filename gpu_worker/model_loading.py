"""Finding and loading the served model: a local directory, a hub id in the local HF cache, or the built-in one."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from gpu_worker.builtin_model import ensure_builtin_model
from gpu_worker.sampling_defaults import recommended_sampling
from resq.catalog import ModelCard, tokenizer_sha256
from resq.settings import BUILTIN_MODEL, Settings

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The configured model cannot be found or used; the message says what to do."""


@dataclass
class LoadedModel:
    """A model ready for the engine, with what the other roles need to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    card: ModelCard
    tokenizer_json: str
    device: torch.device


def resolve_model_dir(settings: Settings) -> Path:
    """The local directory of ``RESQ_MODEL`` (built on first use for the built-in model)."""
    if settings.model == BUILTIN_MODEL:
        return ensure_builtin_model(settings.builtin_model_dir)
    path = Path(settings.model).expanduser()
    if path.is_dir():
        return path.resolve()
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        return Path(snapshot_download(settings.model, local_files_only=True))
    except Exception as exc:
        raise ModelLoadError(
            f"RESQ_MODEL={settings.model!r} is neither a directory nor a model in the local Hugging Face "
            f"cache ({HF_HUB_CACHE}). Download it first, e.g. `hf download {settings.model}`, or point "
            "RESQ_MODEL at a directory holding config.json, the weights and tokenizer.json."
        ) from exc


def pick_device(setting: str) -> torch.device:
    """The device for ``RESQ_DEVICE`` (``auto`` prefers CUDA)."""
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ModelLoadError("RESQ_DEVICE=cuda but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The weights dtype for ``RESQ_DTYPE`` (``auto``: bfloat16 on CUDA, float32 on CPU)."""
    if setting != "auto":
        dtype: torch.dtype = getattr(torch, setting)
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    found: set[int] = set()
    configured: Any = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        found.add(configured)
    elif isinstance(configured, list):
        found.update(int(token) for token in configured)
    if tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    return sorted(token for token in found if token >= 0)


def _chat_template(tokenizer: PreTrainedTokenizerBase, path: Path) -> str:
    template: Any = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    if not isinstance(template, str) or not template:
        raise ModelLoadError(
            f"the tokenizer in {path} has no chat template; resq renders every conversation with the "
            "model's own template, so use an instruct/chat checkpoint"
        )
    return template


def load_model(settings: Settings) -> LoadedModel:
    """Load ``RESQ_MODEL`` onto ``RESQ_DEVICE`` and describe it as a model card."""
    started = time.monotonic()
    path = resolve_model_dir(settings)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    log.info("loading model from %s on %s as %s", path, device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.is_fast:
        raise ModelLoadError(f"{path} has no fast tokenizer (tokenizer.json); resq needs one")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()  # type: ignore[arg-type]
    text_config = model.config.get_text_config()
    context_length = int(getattr(text_config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    special_tokens = {
        name: str(value) for name, value in tokenizer.special_tokens_map.items() if isinstance(value, str)
    }
    tokenizer_json = tokenizer.backend_tokenizer.to_str()
    sampling = recommended_sampling(getattr(model, "generation_config", None), settings.sampling_defaults)
    card = ModelCard(
        name=settings.served_model_name,
        context_length=context_length,
        chat_template=_chat_template(tokenizer, path),
        special_tokens=special_tokens,
        eos_token_ids=_eos_token_ids(model, tokenizer),
        tokenizer_sha256=tokenizer_sha256(tokenizer_json),
        created=int(time.time()),
        source=str(path),
        logprobs=settings.logprobs,
        structured_outputs=settings.structured_outputs,
        default_temperature=sampling.temperature,
        default_top_p=sampling.top_p,
    )
    log.info(
        "model %r ready in %.1fs: %d parameters, context %d tokens, requests that set none sampled at "
        "temperature %s, top_p %s",
        card.name,
        time.monotonic() - started,
        sum(p.numel() for p in model.parameters()),
        context_length,
        _or_openai(sampling.temperature),
        _or_openai(sampling.top_p),
    )
    return LoadedModel(
        model=model, tokenizer=tokenizer, card=card, tokenizer_json=tokenizer_json, device=device
    )


def _or_openai(value: float | None) -> str:
    return "1.0 (OpenAI's default)" if value is None else f"{value} (the model's generation_config)"
