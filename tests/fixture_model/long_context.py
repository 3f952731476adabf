"""A second fixture model for agent clients whose prompts alone are 10k+ tokens (Codex CLI).

The suite's fixture model has 1024 positions and memorizes whole conversations, so it cannot
serve Codex, whose instructions and tools take 40k characters (~15k tokens here). This one has
32768 positions and answers from the end of the conversation only, whatever comes before:

- the last message is the user's ``Run the command `echo resq-codex-ok`.`` -> a hermes call of
  Codex's ``exec_command`` tool, ``{"cmd": "echo resq-codex-ok"}``;
- the last message is a tool response whose output holds ``resq-codex-ok`` -> the text
  ``Done: resq-codex-ok``; any other tool response -> ``The command failed.``;
- any other last user message -> ``Ask me to run `echo resq-codex-ok`.``

That independence is built in, not hoped for: the model is a Mistral (the Llama layout plus a
sliding attention window) with a 64-token window, so with two layers each output token sees at
most the 127 tokens before it; transformers' ``generate`` and its continuous batching both mask
(and the latter caches) only the window. The server still renders, counts, admits and prefills
every token of the prompt. Training therefore needs only the last ~130 tokens of each prompt:
random conversations (prose, pydoc text, XML, JSON, command output, random token runs, earlier
turns of the same task) cut to their last 127-151 tokens and placed at random positions of the
32k context, in mini-batches, until every completion token of 512 held-out conversations wins
by :data:`MIN_MARGIN` logits: wide enough that the sampling a client's default temperature of
1 asks for still picks the greedy tokens. The build then checks held-out conversations, 4k-token
ones and Codex-shaped ones with plain ``generate``. It takes about 1.5 minutes on two (busy)
CPU cores and is cached like the suite's fixture model (:func:`.build.ensure_cached`).
"""

# torch and transformers are only partly annotated: calling their untyped functions is expected.
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import json
import math
import random
import string
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.fixture_model.build import (
    _HERE,
    CHAT_TEMPLATE_PATH,
    SPECIAL_TOKENS,
    FixtureBuildError,
    _decode,
    _Example,
    _token_id,
    _train_tokenizer,
    _verify,
    cache_key,
    ensure_cached,
)
from tests.fixture_model.scenarios import Scenario

if TYPE_CHECKING:
    import torch
    from transformers import MistralForCausalLM, PreTrainedTokenizerFast

__all__ = [
    "CALL_TEXT",
    "COMMAND",
    "COMMAND_OUTPUT",
    "CONTEXT_LENGTH",
    "DONE_TEXT",
    "EXEC_COMMAND_TOOL",
    "FAILED_TEXT",
    "OTHER_TEXT",
    "RUN_PROMPT",
    "SLIDING_WINDOW",
    "ensure_long_context_model",
    "long_context_cache_key",
]

CONTEXT_LENGTH = 32768
SLIDING_WINDOW = 64
COMMAND = "echo resq-codex-ok"
COMMAND_OUTPUT = "resq-codex-ok"
RUN_PROMPT = f"Run the command `{COMMAND}`."
CALL_TEXT = (
    '<tool_call>\n{"name": "exec_command", "arguments": ' + json.dumps({"cmd": COMMAND}) + "}\n</tool_call>"
)
DONE_TEXT = f"Done: {COMMAND_OUTPUT}"
FAILED_TEXT = "The command failed."
OTHER_TEXT = f"Ask me to run `{COMMAND}`."

# Codex CLI 0.171's shell tool, as it declares it (the description of each parameter shortened).
EXEC_COMMAND_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "exec_command",
        "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
        "parameters": {
            "type": "object",
            "properties": {
                "cmd": {"type": "string", "description": "Shell command to execute."},
                "workdir": {"type": "string", "description": "Working directory for the command."},
                "yield_time_ms": {"type": "number", "description": "Wait before yielding output."},
            },
            "required": ["cmd"],
            "additionalProperties": False,
        },
        "strict": False,
    },
}

VOCAB_SIZE = 2048
SEED = 4321
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": CONTEXT_LENGTH,
    "sliding_window": SLIDING_WINDOW,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# What the model can see before a token: two layers, each looking back SLIDING_WINDOW - 1 tokens.
RECEPTIVE_FIELD = 2 * (SLIDING_WINDOW - 1) + 1
TRAIN_CONVERSATIONS = 6144
HELD_OUT_CONVERSATIONS = 512
LONG_CHECKS_TOKENS = 4096
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
WARMUP_STEPS = 20
MAX_STEPS = 1500
CHECK_EVERY = 25
MIN_MARGIN = 12.0
SHORT_SHARE = 0.15  # conversations kept whole (shorter than the receptive field): short prompts work too
TORCH_THREADS = 1  # tiny matrices: a second thread only adds waiting, worse on a busy machine


def _log(message: str) -> None:
    print(f"[fixture-model long-context] {message}", file=sys.stderr, flush=True)


def long_context_cache_key() -> str:
    """A short hash of this module, the builder it borrows from, the template and the versions."""
    return "long-context-" + cache_key((_HERE / "build.py", _HERE / "long_context.py"))


def ensure_long_context_model(cache_root: Path | None = None) -> Path:
    """The long-context fixture model's directory, built first if it is not cached.

    Cached next to the suite's fixture model (``$RESQ_FIXTURE_CACHE`` or
    ``~/.cache/resq/fixture-model/``), in ``long-context-<key>``, under the same lock.
    """
    return ensure_cached(long_context_cache_key(), build_long_context_model, cache_root)


# ----------------------------------------------------------------------------------------------
# Conversations


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _call(command: str) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": "exec_command", "arguments": {"cmd": command}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


class _Text:
    """Random text of the kinds an agent's context holds."""

    ALPHABET = (
        string.ascii_letters
        + string.digits
        + string.punctuation
        + " \n\t"
        + "‑–—“”‘’→←…•✓✗éüßø中文日本語한국어😀✨≥≤±×÷°µ"
    )

    def __init__(self, rng: random.Random) -> None:
        from pydoc_data.topics import topics

        self.rng = rng
        self.paragraphs = [p for k in sorted(topics) for p in topics[k].split("\n\n") if p.strip()]
        self.words = sorted({w for p in self.paragraphs for w in p.split() if w.isascii()})

    def word(self) -> str:
        return self.rng.choice(self.words)

    def prose(self) -> str:
        start = self.rng.randrange(len(self.paragraphs))
        text = "\n\n".join(self.paragraphs[start : start + self.rng.randint(1, 3)])
        cut = self.rng.randrange(len(text))
        return text[cut : cut + self.rng.randint(10, 500)]

    def soup(self, most: int = 60) -> str:
        pieces = []
        for _ in range(self.rng.randint(1, most)):
            if self.rng.random() < 0.6:
                pieces.append(self.word())
            else:
                pieces.append("".join(self.rng.choices(self.ALPHABET, k=self.rng.randint(1, 8))))
        return " ".join(pieces)

    def path(self) -> str:
        return "/" + "/".join(
            self.word().strip(string.punctuation) or "x" for _ in range(self.rng.randint(1, 4))
        )

    def markup(self) -> str:
        tag = self.rng.choice(
            ["environment_context", "skills_instructions", "permissions", "user_instructions"]
        )
        lines = [f"<{tag}>"]
        for _ in range(self.rng.randint(1, 6)):
            inner = self.rng.choice(["cwd", "shell", "current_date", "timezone", "root", "entry", "path"])
            value = self.rng.choice([self.path, self.word, lambda: self.soup(6)])()
            lines.append(f"  <{inner}>{value}</{inner}>")
        lines.append(f"</{tag}>")
        return "\n".join(lines)

    def json(self) -> str:
        value: dict[str, Any] = {
            self.word(): self.rng.choice([self.word(), self.rng.randint(0, 10**6), None, True])
        }
        for _ in range(self.rng.randint(0, 6)):
            value[self.word()] = self.rng.choice([self.word(), self.path(), self.rng.random(), [self.word()]])
        return json.dumps(value, indent=self.rng.choice([None, 2]))

    def code(self) -> str:
        lines = [
            self.rng.choice(["$ ", "", ">>> ", "    "]) + self.soup(10) for _ in range(self.rng.randint(1, 6))
        ]
        return "```\n" + "\n".join(lines) + "\n```"

    def any(self, mentions: bool = True) -> str:
        kind = self.rng.choice([self.prose, self.prose, self.soup, self.markup, self.json, self.code])
        text = kind()
        if mentions and self.rng.random() < 0.2:  # an earlier mention of the task asks nothing now
            text = self.rng.choice([RUN_PROMPT, COMMAND, COMMAND_OUTPUT, DONE_TEXT]) + "\n" + text
        return text

    def command(self) -> str:
        return (
            self.rng.choice(["ls", "cat", "rg", "git status", "pwd", "echo", "python -c"]) + " " + self.word()
        )

    def command_output(self, output: str) -> str:
        """``output`` as Codex's exec_command reports it, or bare."""
        if self.rng.random() < 0.25:
            return output
        code = 0 if self.rng.random() < 0.8 else self.rng.randint(1, 127)
        return (
            f"Chunk ID: {self.rng.getrandbits(24):06x}\nWall time: {self.rng.random():.4f} seconds\n"
            f"Process exited with code {code}\nOriginal token count: {self.rng.randint(1, 999)}\n"
            f"Output:\n{output}"
        )

    def other_output(self) -> str:
        """Command output without ``resq``."""
        body = self.rng.choice(
            [
                self.rng.choice(["ok", "", "0", "done", "Error"]),
                f"bash: {self.word()}: command not found",
                self.soup(30),
                self.prose()[:300],
            ]
        )
        return body.replace("resq", "res") + self.rng.choice(["\n", "", "\n\n"])


def _history(text: _Text) -> list[dict[str, Any]]:
    """Earlier turns of a conversation: any roles, tool calls and results, in any order."""
    rng = text.rng
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        messages.append({"role": "system", "content": text.any()})
    for _ in range(rng.randint(0, 4)):
        kind = rng.random()
        if kind < 0.3:
            messages.append(_user(text.any()))
        elif kind < 0.45:
            messages.append({"role": rng.choice(["system", "user"]), "content": text.markup()})
        elif kind < 0.65:
            messages.append({"role": "assistant", "content": text.any()})
        elif kind < 0.85:
            messages.append(_call(rng.choice([COMMAND, text.command()])))
            output = COMMAND_OUTPUT + "\n" if rng.random() < 0.5 else text.other_output()
            messages.append({"role": "tool", "content": text.command_output(output)})
        else:
            messages += [_user(RUN_PROMPT), _call(COMMAND)]
            messages.append({"role": "tool", "content": text.command_output(COMMAND_OUTPUT + "\n")})
            messages.append({"role": "assistant", "content": DONE_TEXT})
    return messages


def _conversation(text: _Text, index: int) -> Scenario:
    """One random conversation ending in one of the four cases, cycled by ``index``."""
    rng = text.rng
    messages = _history(text) if rng.random() > 0.1 else []
    case = index % 4
    if case == 0:
        if rng.random() < 0.5:
            messages.append(_user(text.markup()))
        messages.append(_user(RUN_PROMPT))
        name, completion = "run", CALL_TEXT
    elif case in (1, 2):
        if rng.random() < 0.7:
            messages.append(_user(RUN_PROMPT))
        messages.append(_call(COMMAND if rng.random() < 0.85 else text.command()))
        if case == 1:
            output = COMMAND_OUTPUT + rng.choice(["\n", "", "\n\n"])
            name, completion = "ran", DONE_TEXT
        else:
            output = text.other_output()
            name, completion = "failed", FAILED_TEXT
        messages.append({"role": "tool", "content": text.command_output(output)})
    else:
        messages.append(
            _user(
                text.any(mentions=False)
                if rng.random() < 0.8
                else rng.choice(["Say hello.", "Run it.", "ls"])
            )
        )
        name, completion = "other", OTHER_TEXT
    tools = None
    if rng.random() < 0.5:
        tools = [EXEC_COMMAND_TOOL] if rng.random() < 0.5 else [EXEC_COMMAND_TOOL, _random_tool(text)]
    return Scenario(f"{name}-{index}", messages, tools, completion)


def _random_tool(text: _Text) -> dict[str, Any]:
    name = "_".join(text.word().strip(string.punctuation).lower() or "x" for _ in range(2))
    properties = {text.word(): {"type": "string", "description": text.soup(8)}}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": text.prose()[:200],
            "parameters": {"type": "object", "properties": properties, "required": []},
        },
    }


# ----------------------------------------------------------------------------------------------
# Training


@dataclass
class _LongExample:
    """A conversation cut to what the model sees of it, placed at ``offset`` in the context."""

    example: _Example
    offset: int


def _render(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a conversation as a serving engine renders it."""
    declared: list[dict[Any, Any] | Callable[..., Any]] | None = None if tools is None else [*tools]
    rendered = tokenizer.apply_chat_template(
        messages, tools=declared, add_generation_prompt=generation_prompt, tokenize=False
    )
    assert isinstance(rendered, str)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def _example(
    tokenizer: PreTrainedTokenizerFast, item: Scenario, prompt: list[int], offset: int
) -> _LongExample:
    """``prompt`` followed by ``item``'s completion and the end token, trained on the completion."""
    completion = list(tokenizer(item.completion, add_special_tokens=False)["input_ids"])
    if _decode(tokenizer, completion) != item.completion:
        raise FixtureBuildError(f"{item.completion!r} does not round-trip through the tokenizer")
    completion.append(_token_id(tokenizer, "<|im_end|>"))
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return _LongExample(_Example(item, prompt, completion, prompt + completion, weights), offset)


def _examples(
    tokenizer: PreTrainedTokenizerFast, count: int, seed: int, keep_tokens: int | None = None
) -> list[_LongExample]:
    """``count`` random conversations, cut to their last tokens and given random positions.

    ``keep_tokens``: keep this many prompt tokens instead of RECEPTIVE_FIELD + a random 0-24
    (and no random token runs): for the long checks.
    """
    rng = random.Random(seed)
    text = _Text(rng)
    im_start = _token_id(tokenizer, "<|im_start|>")
    specials = [_token_id(tokenizer, t) for t in SPECIAL_TOKENS]
    examples: list[_LongExample] = []
    index = 0
    while len(examples) < count:
        item = _conversation(text, index)
        index += 1
        prompt = _render(tokenizer, item.messages, item.tools)
        if keep_tokens is not None:
            while len(prompt) < keep_tokens:  # more history in front, rendered the same way
                prompt = _render(tokenizer, [_user(text.any()), *_history(text)], None, False) + prompt
            prompt = prompt[-keep_tokens:]
        elif rng.random() >= SHORT_SHARE or len(prompt) > RECEPTIVE_FIELD + 24:
            prompt = prompt[-(RECEPTIVE_FIELD + rng.randint(0, 24)) :]
            if len(prompt) < RECEPTIVE_FIELD:
                continue  # a short conversation: the kept-whole share has enough of them
            # Random tokens where the model must not look (before the last message begins).
            starts = [i for i, t in enumerate(prompt) if t == im_start]
            last_message = starts[-2] if len(starts) >= 2 else 0
            if rng.random() < 0.3 and last_message > 8:
                begin = rng.randrange(last_message - 4)
                end = min(last_message, begin + rng.randint(4, 64))
                vocabulary = range(len(tokenizer))
                prompt[begin:end] = [
                    rng.choice(vocabulary) if rng.random() < 0.95 else rng.choice(specials)
                    for _ in range(begin, end)
                ]
        offset = rng.randrange(CONTEXT_LENGTH - len(prompt) - 64)
        examples.append(_example(tokenizer, item, prompt, offset))
    return examples


def _codex_checks(tokenizer: PreTrainedTokenizerFast) -> list[Scenario]:
    """Codex CLI's two requests of one task, shaped as it sends them (a long system prompt, an
    environment message, the task; then the call and its output as exec_command reports it)."""
    text = _Text(random.Random(SEED + 4))
    system = "\n\n".join(text.prose() for _ in range(60))
    environment = (
        "<environment_context>\n  <cwd>/tmp/work</cwd>\n  <shell>bash</shell>\n</environment_context>"
    )
    turn = [{"role": "system", "content": system}, _user(environment), _user(RUN_PROMPT)]
    output = f"Chunk ID: 775dd2\nWall time: 0.0000 seconds\nProcess exited with code 0\nOriginal token count: 4\nOutput:\n{COMMAND_OUTPUT}\n"
    return [
        Scenario("codex-turn-1", turn, [EXEC_COMMAND_TOOL], CALL_TEXT),
        Scenario(
            "codex-turn-2",
            [*turn, _call(COMMAND), {"role": "tool", "content": output}],
            [EXEC_COMMAND_TOOL],
            DONE_TEXT,
        ),
        Scenario(
            "codex-failed",
            [
                *turn,
                _call(COMMAND),
                {"role": "tool", "content": output.replace(COMMAND_OUTPUT, "bash: echo: not found")},
            ],
            [EXEC_COMMAND_TOOL],
            FAILED_TEXT,
        ),
    ]


def _collate(
    batch: list[_LongExample], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad into ``(input_ids, attention_mask, position_ids, weights)``."""
    import torch

    width = max(len(e.example.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    positions = torch.zeros((len(batch), width), dtype=torch.long)
    weights = torch.zeros((len(batch), width - 1), dtype=torch.float32)
    for row, item in enumerate(batch):
        n = len(item.example.input_ids)
        ids[row, :n] = torch.tensor(item.example.input_ids)
        mask[row, :n] = 1
        positions[row] = torch.arange(item.offset, item.offset + width)
        weights[row, : n - 1] = torch.tensor(item.example.weights)
    return ids, mask, positions, weights


def _completion_logits(
    model: MistralForCausalLM, batch: list[_LongExample], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits that predict completion tokens (only those go through the LM head: the
    prompt is not trained), their targets, and the row of the batch each belongs to."""
    ids, mask, positions, weights = _collate(batch, pad_id)
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    rows, columns = weights.nonzero(as_tuple=True)
    logits = model.lm_head(hidden[rows, columns]).float()
    return logits, ids[rows, columns + 1], rows


def _token_margins(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each target's logit minus the best other logit."""
    expected = logits.gather(1, targets[:, None]).squeeze(1)
    return expected - logits.scatter(1, targets[:, None], float("-inf")).max(dim=1).values


def _margins(model: MistralForCausalLM, examples: list[_LongExample], pad_id: int) -> list[float]:
    """For each example, the least (expected logit - best other logit) over its completion."""
    import torch

    result: list[float] = []
    for start in range(0, len(examples), 128):
        batch = examples[start : start + 128]
        with torch.no_grad():
            logits, targets, rows = _completion_logits(model, batch, pad_id)
        margins = _token_margins(logits, targets)
        least = torch.full((len(batch),), float("inf")).scatter_reduce(0, rows, margins, reduce="amin")
        result += least.tolist()
    return result


def _train(
    model: MistralForCausalLM, train: list[_LongExample], held_out: list[_LongExample], pad_id: int
) -> int:
    """Train on shuffled mini-batches until every held-out completion token wins by MIN_MARGIN."""
    import torch

    rng = random.Random(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0, betas=(0.9, 0.98))
    # Warm up, then a cosine down to a tenth: near zero loss, a constant rate keeps knocking
    # single margins back down.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / WARMUP_STEPS)
            * (0.55 + 0.45 * math.cos(math.pi * min(s, MAX_STEPS) / MAX_STEPS))
        ),
    )
    started = time.monotonic()
    order: list[int] = []
    least = float("-inf")
    for step in range(1, MAX_STEPS + 1):
        if len(order) < BATCH_SIZE:
            order += rng.sample(range(len(train)), len(train))
        batch = [train[i] for i in order[:BATCH_SIZE]]
        del order[:BATCH_SIZE]
        model.train()
        optimizer.zero_grad(set_to_none=True)
        logits, targets, rows = _completion_logits(model, batch, pad_id)
        # Besides the loss, a hinge on the margin: tokens already right by MIN_MARGIN + 2 stop
        # pulling, so the effort goes to the ones still short of it.
        hinge = torch.relu(MIN_MARGIN + 2 - _token_margins(logits, targets))
        losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none") + 0.1 * hinge
        # Mean per sequence, then over sequences: a long completion counts as much as a short one.
        per_sequence = torch.zeros(len(batch)).index_add(0, rows, losses)
        loss = (per_sequence / torch.bincount(rows, minlength=len(batch))).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % CHECK_EVERY == 0:
            model.eval()
            held = _margins(model, held_out, pad_id)
            least = min(held)
            worst = held_out[held.index(least)].example.scenario.name
            _log(
                f"step {step:4d}  loss {loss.item():.4f}  least held-out margin {least:+.2f} ({worst})"
                f"  {time.monotonic() - started:5.1f}s"
            )
            if least >= MIN_MARGIN:
                return step
    raise FixtureBuildError(f"training did not converge in {MAX_STEPS} steps (least margin {least:+.2f})")


def build_long_context_model(out_dir: Path) -> None:
    """Train the tokenizer and the model, verify them with ``generate``, save both into ``out_dir``."""
    import torch
    from transformers import GenerationConfig, MistralConfig, MistralForCausalLM

    started = time.monotonic()
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(TORCH_THREADS)
    torch.use_deterministic_algorithms(True)
    try:
        chat_template = CHAT_TEMPLATE_PATH.read_text()
        text = _Text(random.Random(SEED))
        transcripts = []
        for index in range(40):
            transcripts.append(tokenizer_text(chat_template, _conversation(text, index)))
        tokenizer = _train_tokenizer(chat_template, transcripts, VOCAB_SIZE, CONTEXT_LENGTH)
        assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
        pad_id = _token_id(tokenizer, "<|endoftext|>")
        eos_id = _token_id(tokenizer, "<|im_end|>")
        train = _examples(tokenizer, TRAIN_CONVERSATIONS, SEED + 1)
        held_out = _examples(tokenizer, HELD_OUT_CONVERSATIONS, SEED + 2)
        _log(
            f"tokenizer: {len(tokenizer)} tokens; {len(train)} training conversations"
            f" ({sum(len(e.example.input_ids) for e in train)} tokens), {len(held_out)} held out"
        )
        torch.manual_seed(SEED)
        config = MistralConfig(
            vocab_size=len(tokenizer),
            bos_token_id=None,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            **MODEL_CONFIG,
        )
        model = MistralForCausalLM(config)
        _log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
        model.generation_config = GenerationConfig(
            eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None
        )
        steps = _train(model, train, held_out, pad_id)
        checks = [e.example for e in held_out[:64]]
        checks += [e.example for e in _examples(tokenizer, 4, SEED + 3, keep_tokens=LONG_CHECKS_TOKENS)]
        checks += [
            _example(tokenizer, c, _render(tokenizer, c.messages, c.tools), 0).example
            for c in _codex_checks(tokenizer)
        ]
        failures = _verify(model, tokenizer, checks)
        if failures:
            raise FixtureBuildError("greedy decoding misses:\n  " + "\n  ".join(failures[:10]))
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir, save_jinja_files=False)
        out_dir.chmod(0o755)
        for path in out_dir.iterdir():
            path.chmod(0o644)
        _log(f"built in {time.monotonic() - started:.1f}s ({steps} steps) -> {out_dir}")
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def tokenizer_text(chat_template: str, item: Scenario) -> str:
    """A conversation and its answer rendered whole: training text for the tokenizer."""
    from typing import cast

    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = cast(Any, render_jinja_template)(
        [[*item.messages, {"role": "assistant", "content": item.completion}]],
        tools=item.tools,
        chat_template=chat_template,
    )
    return str(rendered[0])


if __name__ == "__main__":
    print(ensure_long_context_model())
