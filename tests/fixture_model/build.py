"""Build, verify and cache the tiny fixture causal LM that the test suite decodes exactly.

The model is a ~0.6M-parameter Llama trained for about 20 s on CPU to memorize every scenario in
:mod:`tests.fixture_model.scenarios`, so that greedy decoding through any correct engine yields the
scenario's completion token for token. Training stops only once every completion token is the
argmax by a wide logit margin, which keeps the outputs stable under other attention kernels,
batching and padding; the build then checks each scenario with plain ``generate``.

torch and transformers are imported lazily: a cache hit needs neither, and the scenarios stay
importable in the slim (no-torch) install.
"""

# torch and transformers are only partly annotated: calling their untyped functions is expected.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from tests.fixture_model.scenarios import ENDLESS_MIN_TOKENS, SCENARIOS, Scenario, variants

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, MistralForCausalLM, PreTrainedTokenizerFast

__all__ = [
    "ADDED_TOKENS",
    "SPECIAL_TOKENS",
    "FixtureBuildError",
    "build_fixture_model",
    "cache_key",
    "ensure_cached",
    "ensure_fixture_model",
]

_HERE = Path(__file__).resolve().parent
_REPO_ROOT = _HERE.parents[1]
CHAT_TEMPLATE_PATH = _REPO_ROOT / "gpu_worker" / "builtin_model" / "chat_template.jinja"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Not special, exactly like Qwen3: skip_special_tokens=True decoding keeps them in the text.
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
VOCAB_SIZE = 1536  # total, special and added tokens included (a multiple of 64 suits GPU kernels)

SEED = 1234
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
LEARNING_RATE = 4e-3
WARMUP_STEPS = 20
MAX_STEPS = 1500
CHECK_EVERY = 10
# The least logit gap between each expected token and its runner-up before training stops: wide
# enough that bf16 weights, paged attention or padding cannot flip a greedy choice.
MIN_MARGIN = 6.0
# Should plain generate still disagree (never seen so far), train on to a margin this much wider.
RETRY_MARGINS = (MIN_MARGIN + 3.0, MIN_MARGIN + 6.0)
PROMPT_LOSS_WEIGHT = 0.05  # a little prompt loss trains embeddings of prompt-only tokens
TORCH_THREADS = 2

_DONE_MARKER = "fixture.json"


class FixtureBuildError(RuntimeError):
    """The trained model does not reproduce a scenario under greedy decoding."""


def _log(message: str) -> None:
    print(f"[fixture-model] {message}", file=sys.stderr, flush=True)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_key(sources: tuple[Path, ...] = (_HERE / "build.py", _HERE / "scenarios.py")) -> str:
    """Return a short hash of everything the built model depends on.

    That is the source of its builder and scenarios (``sources``), the chat template, and the
    torch, transformers and tokenizers versions (their numerics and file formats shape the result).
    """
    digest = hashlib.sha256()
    for path in (*sources, CHAT_TEMPLATE_PATH):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for package in ("torch", "transformers", "tokenizers"):
        digest.update(f"{package}={_version(package)}\0".encode())
    return digest.hexdigest()[:12]


def _default_cache_root() -> Path:
    env = os.environ.get("RESQ_FIXTURE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "resq" / "fixture-model"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if missing) for the block."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process to finish building ({path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_fixture_model(cache_root: Path | None = None) -> Path:
    """Return the directory of the fixture model, building it first if it is not cached.

    The cache lives under ``cache_root``, else ``$RESQ_FIXTURE_CACHE``, else
    ``~/.cache/resq/fixture-model/``, in a subfolder named by :func:`cache_key`. The directory
    loads with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    return ensure_cached(cache_key(), build_fixture_model, cache_root)


def ensure_cached(key: str, build: Callable[[Path], None], cache_root: Path | None = None) -> Path:
    """Return ``<cache root>/<key>``, running ``build(staging_dir)`` first if it is not there.

    Concurrent callers (several pytest workers) wait on a file lock so that it is built only
    once, and a build lands by an atomic rename, so a half-written model is never seen.
    """
    root = (cache_root if cache_root is not None else _default_cache_root()).expanduser()
    final = root / key
    if (final / _DONE_MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{key}.lock"):
        if (final / _DONE_MARKER).is_file():  # another process built it while we waited
            return final
        if final.exists():  # a leftover without the marker: not ours to trust
            shutil.rmtree(final)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            build(staging)
            (staging / _DONE_MARKER).write_text(json.dumps({"cache_key": key}, indent=2) + "\n")
            staging.rename(final)
            _log(f"cached at {final}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------
# Building


@dataclass
class _Example:
    """One scenario as token ids, with the loss weight of predicting each next token."""

    scenario: Scenario
    prompt_ids: list[int]
    completion_ids: list[int]  # the tokens greedy decoding must produce, end token included
    input_ids: list[int]
    weights: list[float]  # weights[i] weighs predicting input_ids[i + 1]


def _trained_scenarios() -> list[Scenario]:
    """Every scenario and its tool variants: all are trained and all are verified."""
    return [variant for item in SCENARIOS for variant in variants(item)]


def _scenario_transcripts(chat_template: str) -> list[str]:
    """Every trained scenario rendered whole by the chat template (the tokenizer's training text)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    transcripts: list[str] = []
    for item in _trained_scenarios():
        assistant = {"role": "assistant", "content": item.completion if item.ends else "ha ha ha"}
        if item.name == "unicode":
            # Left out so that its characters stay split across byte tokens: that exercises
            # incremental detokenization of partial UTF-8 sequences.
            assistant["content"] = ""
        # Annotated as returning str, it returns (rendered texts, generation indices).
        rendered, _ = cast(Any, render_jinja_template)(
            [[*item.messages, assistant]], tools=item.tools, chat_template=chat_template
        )
        transcripts.append(rendered[0])
    return transcripts


def _train_tokenizer(
    chat_template: str,
    transcripts: list[str],
    vocab_size: int = VOCAB_SIZE,
    model_max_length: int = MODEL_CONFIG["max_position_embeddings"],
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``transcripts`` and the stdlib's pydoc text."""
    from pydoc_data.topics import topics

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    markers = SPECIAL_TOKENS + ADDED_TOKENS

    def strip_markers(text: str) -> str:
        # Markers become single added tokens; keep their pieces from using up merges. A newline
        # (never merged with a following word) keeps "<|im_start|>user" training "user", not " user".
        for marker in markers:
            text = text.replace(marker, "\n")
        return text

    # The transcripts repeated so their words become whole tokens: shorter sequences train faster.
    corpus = [strip_markers(t) for t in transcripts] * 20 + [topics[k] for k in sorted(topics)]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
    )
    wrapped.chat_template = chat_template
    return wrapped


def _tools(item: Scenario) -> list[dict[Any, Any] | Callable[..., Any]] | None:
    """The scenario's tools, typed the way ``apply_chat_template`` declares them."""
    return None if item.tools is None else [*item.tools]


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one token of the vocabulary."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int)
    return token_id


def _decode(tokenizer: PreTrainedTokenizerFast, ids: list[int], skip_special_tokens: bool = False) -> str:
    """Decode one sequence of ids to text."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)
    return text


def _prompt_ids(tokenizer: PreTrainedTokenizerFast, item: Scenario) -> list[int]:
    """Token ids of a scenario's prompt, exactly as a serving engine would render them."""
    text = tokenizer.apply_chat_template(
        item.messages, tools=_tools(item), add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode(tokenizer: PreTrainedTokenizerFast) -> list[_Example]:
    """Turn every scenario into prompt + completion (+ ``<|im_end|>``) training ids."""
    im_end = _token_id(tokenizer, "<|im_end|>")
    examples = []
    for item in _trained_scenarios():
        prompt = _prompt_ids(tokenizer, item)
        if item.ends:
            # Tokenized on its own: generation sees the prompt ids, then these.
            completion = list(tokenizer(item.completion, add_special_tokens=False)["input_ids"])
            if _decode(tokenizer, completion) != item.completion:
                raise FixtureBuildError(f"{item.name}: completion does not round-trip through the tokenizer")
            completion.append(im_end)
        else:
            # "ha" then " ha" until the context is full: every position a caller can reach was
            # trained, as a tiny model need not extrapolate the repetition.
            room = MODEL_CONFIG["max_position_embeddings"] - len(prompt)
            completion = list(tokenizer(" ".join(["ha"] * room), add_special_tokens=False)["input_ids"])
            if len(completion) != room or room < ENDLESS_MIN_TOKENS:
                raise FixtureBuildError(f"{item.name}: {len(completion)} tokens for {room} positions")
        ids = prompt + completion
        weights = [PROMPT_LOSS_WEIGHT] * (len(prompt) - 1) + [1.0] * len(completion)
        examples.append(_Example(item, prompt, completion, ids, weights))
    return examples


def _batches(examples: list[_Example]) -> list[list[_Example]]:
    """Group examples of similar length so that padding wastes little compute."""
    ordered = sorted(examples, key=lambda e: len(e.input_ids))
    groups: list[list[_Example]] = []
    for example in ordered:
        if groups and len(example.input_ids) <= 2 * len(groups[-1][0].input_ids):
            groups[-1].append(example)
        else:
            groups.append([example])
    return groups


def _collate(group: list[_Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad a group into ``(input_ids, attention_mask, weights)``; weights are 0 on padding."""
    import torch

    width = max(len(e.input_ids) for e in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    weights = torch.zeros((len(group), width - 1), dtype=torch.float32)
    for row, example in enumerate(group):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        mask[row, :n] = 1
        weights[row, : n - 1] = torch.tensor(example.weights)
    return ids, mask, weights


def _completion_margins(
    model: LlamaForCausalLM, group: list[_Example], batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> list[tuple[Scenario, float]]:
    """For each example, the least (expected logit - best other logit) over its completion."""
    import torch

    ids, mask, _ = batch
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    result = []
    for row, example in enumerate(group):
        start = len(example.prompt_ids) - 1  # the logits at position i predict token i + 1
        targets = torch.tensor(example.completion_ids)
        rows = logits[row, start : start + len(targets)]
        expected = rows.gather(1, targets[:, None]).squeeze(1)
        others = rows.scatter(1, targets[:, None], float("-inf")).max(dim=1).values
        result.append((example.scenario, float((expected - others).min())))
    return result


def _train(model: LlamaForCausalLM, examples: list[_Example], pad_id: int, min_margin: float) -> int:
    """Train until every completion token wins by ``min_margin``; return the number of steps."""
    import torch

    groups = _batches(examples)
    batches = [_collate(g, pad_id) for g in groups]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    started = time.monotonic()
    worst: list[tuple[Scenario, float]] = []
    for step in range(1, MAX_STEPS + 1):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for ids, mask, weights in batches:
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            losses = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            ).view_as(weights)
            # Mean per sequence, then each sequence counts the same: the 1000-token endless run
            # would otherwise drown out the short answers.
            per_sequence = (losses * weights).sum(dim=1) / weights.sum(dim=1)
            loss = per_sequence.sum() / len(examples)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % CHECK_EVERY == 0:
            model.eval()
            worst = []
            for group, batch in zip(groups, batches, strict=True):
                worst.extend(_completion_margins(model, group, batch))
            least = min(worst, key=lambda pair: pair[1])
            _log(
                f"step {step:4d}  loss {total:.4f}  least margin {least[1]:+.2f} ({least[0].name})"
                f"  {time.monotonic() - started:5.1f}s"
            )
            if least[1] >= min_margin:
                return step
    failing = ", ".join(f"{s.name} ({m:+.2f})" for s, m in worst if m < min_margin)
    raise FixtureBuildError(f"training did not converge in {MAX_STEPS} steps; short of margin: {failing}")


def _verify(
    model: LlamaForCausalLM | MistralForCausalLM, tokenizer: PreTrainedTokenizerFast, examples: list[_Example]
) -> list[str]:
    """Check every scenario with plain greedy ``generate``; return a line for each that fails."""
    import torch

    im_end = _token_id(tokenizer, "<|im_end|>")
    model.eval()
    failures = []
    for example in examples:
        item = example.scenario
        prompt = torch.tensor([example.prompt_ids])
        new_tokens = len(example.completion_ids)  # for the endless one: until the context is full
        with torch.no_grad():
            output = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                min_new_tokens=0,
                do_sample=False,
            )
        generated = output[0, prompt.shape[1] :].tolist()
        text = _decode(tokenizer, generated, skip_special_tokens=True)
        if item.ends:
            ok = generated == example.completion_ids and text == item.completion
        else:
            ok = len(generated) == new_tokens and im_end not in generated and text.startswith(item.completion)
        if not ok:
            failures.append(
                f"{item.name}: expected {item.completion!r}, got {text[:200]!r} ({generated[:40]})"
            )
    return failures


def build_fixture_model(out_dir: Path) -> None:
    """Train the tokenizer and the model from scratch, verify them, and save both into ``out_dir``.

    Deterministic for a given torch/transformers/tokenizers version. Takes 15-30 s on two CPU
    cores and prints its progress to stderr; raises :class:`FixtureBuildError` if greedy decoding
    still misses a scenario after extra training.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    started = time.monotonic()
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(TORCH_THREADS)  # the CPU count the build is sized for, and reproducible
    torch.use_deterministic_algorithms(True)
    try:
        chat_template = CHAT_TEMPLATE_PATH.read_text()
        tokenizer = _train_tokenizer(chat_template, _scenario_transcripts(chat_template))
        assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
        examples = _encode(tokenizer)
        pad_id = _token_id(tokenizer, "<|endoftext|>")
        eos_id = _token_id(tokenizer, "<|im_end|>")
        _log(
            f"tokenizer: {len(tokenizer)} tokens; training on {sum(len(e.input_ids) for e in examples)}"
            f" tokens in {len(examples)} sequences"
        )
        torch.manual_seed(SEED)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            bos_token_id=None,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            attention_bias=False,
            mlp_bias=False,
            **MODEL_CONFIG,
        )
        model = LlamaForCausalLM(config)
        n_params = sum(p.numel() for p in model.parameters())
        _log(f"model: {n_params / 1e6:.2f}M parameters")
        model.generation_config = GenerationConfig(
            eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None
        )
        steps = _train(model, examples, pad_id, MIN_MARGIN)
        failures = _verify(model, tokenizer, examples)
        for margin in RETRY_MARGINS:
            if not failures:
                break
            _log(f"{len(failures)} scenario(s) fail under generate; training on to margin {margin}")
            steps += _train(model, examples, pad_id, margin)
            failures = _verify(model, tokenizer, examples)
        if failures:
            raise FixtureBuildError(
                "greedy decoding does not reproduce the scenarios:\n  " + "\n  ".join(failures)
            )
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        # The template goes into tokenizer_config.json, where jinja-only readers look for it too.
        tokenizer.save_pretrained(out_dir, save_jinja_files=False)
        # Readable by every user (a worker in a container may run under another uid).
        out_dir.chmod(0o755)
        for path in out_dir.iterdir():
            path.chmod(0o644)
        _log(f"built in {time.monotonic() - started:.1f}s ({steps} steps) -> {out_dir}")
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
