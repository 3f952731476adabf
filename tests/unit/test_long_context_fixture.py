"""The long-context fixture model answers from the end of a conversation, however long it is.

The first run builds it (about 1.5 minutes on two cores; the Codex test needs it anyway).
"""

from __future__ import annotations

import json
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import pytest

from tests.fixture_model.build import CHAT_TEMPLATE_PATH
from tests.fixture_model.long_context import (
    CALL_TEXT,
    COMMAND,
    COMMAND_OUTPUT,
    CONTEXT_LENGTH,
    DONE_TEXT,
    EXEC_COMMAND_TOOL,
    FAILED_TEXT,
    OTHER_TEXT,
    RUN_PROMPT,
    SLIDING_WINDOW,
    ensure_long_context_model,
    long_context_cache_key,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_long_context_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    loaded.eval()
    return loaded


def test_config_files(model_dir: Path) -> None:
    assert model_dir.name == long_context_cache_key()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "mistral"
    assert config["max_position_embeddings"] == CONTEXT_LENGTH
    assert config["sliding_window"] == SLIDING_WINDOW
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE_PATH.read_text()


def _call() -> dict[str, Any]:
    call = {"type": "function", "function": {"name": "exec_command", "arguments": {"cmd": COMMAND}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _output(text: str) -> dict[str, Any]:
    return {"role": "tool", "content": f"Process exited with code 0\nOutput:\n{text}\n"}


CASES = {
    "run": ([{"role": "user", "content": RUN_PROMPT}], CALL_TEXT),
    "ran": ([{"role": "user", "content": RUN_PROMPT}, _call(), _output(COMMAND_OUTPUT)], DONE_TEXT),
    "failed": ([{"role": "user", "content": RUN_PROMPT}, _call(), _output("No such file")], FAILED_TEXT),
    "other": ([{"role": "user", "content": "Say hello."}], OTHER_TEXT),
}


LONG_CASES = ("run", "ran")  # Codex's two requests of one task


def _prompt(tokenizer: Any, messages: list[dict[str, Any]], system: str | None) -> list[int]:
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    text = tokenizer.apply_chat_template(
        messages, tools=[EXEC_COMMAND_TOOL], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_continuous_batching_answers_the_same_after_16k_tokens(model: Any, tokenizer: Any) -> None:
    # The engine the GPU worker runs, on short prompts and on Codex's two behind a system
    # prompt of 16k+ tokens (Codex sends ~15k), all in one batch.
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    system = "\n\n".join(topics[key] for key in sorted(topics))[:60_000]
    prompts = {}
    for name, (messages, _) in CASES.items():
        prompts[f"{name}-short"] = _prompt(tokenizer, messages, None)
        if name in LONG_CASES:
            prompts[f"{name}-long"] = _prompt(tokenizer, messages, system)
    assert all(
        16_000 < len(ids) < CONTEXT_LENGTH - 64 for name, ids in prompts.items() if name.endswith("-long")
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=48, eos_token_id=im_end),  # type: ignore[no-untyped-call]
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=64, max_batch_tokens=1024, max_requests_per_batch=8, num_blocks=2048
        ),
    )
    answers: dict[str, str] = {}
    manager.start()
    try:
        for name, ids in prompts.items():
            manager.add_request(ids, request_id=name, max_new_tokens=48)
        for output in manager:
            if output.is_finished():
                answers[output.request_id] = tokenizer.decode(
                    output.generated_tokens, skip_special_tokens=True
                )
            if len(answers) == len(prompts):
                break
    finally:
        manager.stop(block=True)
    expected = {f"{name}-short": text for name, (_, text) in CASES.items()}
    expected |= {f"{name}-long": CASES[name][1] for name in LONG_CASES}
    assert answers == expected
