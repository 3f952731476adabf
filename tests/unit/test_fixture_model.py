"""The fixture model reproduces every scenario under plain greedy ``generate``.

The first run builds the model (about 15 s on two cores); later runs load it from the cache.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

# The fixture package itself imports no torch; the checks below need it (the gpu extra).
from tests.fixture_model import (
    ADDED_TOKENS,
    ENDLESS_MIN_TOKENS,
    SCENARIOS,
    SPECIAL_TOKENS,
    Scenario,
    ensure_fixture_model,
    scenario,
    variants,
)
from tests.fixture_model import build as build_module
from tests.fixture_model.build import CHAT_TEMPLATE_PATH

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_fixture_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    loaded.eval()
    return loaded


def _prompt_ids(tokenizer: Any, item: Scenario) -> list[int]:
    text = tokenizer.apply_chat_template(
        item.messages, tools=item.tools, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


ALL_VARIANTS = [variant for item in SCENARIOS for variant in variants(item)]


@pytest.mark.parametrize("item", ALL_VARIANTS, ids=[s.name for s in ALL_VARIANTS])
def test_greedy_generate_reproduces_scenario(model: Any, tokenizer: Any, item: Scenario) -> None:
    prompt = torch.tensor([_prompt_ids(tokenizer, item)])
    max_new = 200 if item.ends else ENDLESS_MIN_TOKENS
    with torch.no_grad():
        output = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new, do_sample=False
        )
    generated = output[0, prompt.shape[1] :].tolist()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if item.ends:
        # generate stops at the end token (generation_config's eos) and keeps it.
        assert generated[-1] == im_end
        assert tokenizer.decode(generated[:-1]) == item.completion
        assert tokenizer.decode(generated, skip_special_tokens=True) == item.completion
    else:
        assert len(generated) == ENDLESS_MIN_TOKENS
        assert im_end not in generated
        assert tokenizer.decode(generated).startswith(item.completion)


def test_token_flags(tokenizer: Any) -> None:
    by_content = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    for content in SPECIAL_TOKENS:
        assert by_content[content].special, content
    for content in ADDED_TOKENS:
        assert not by_content[content].special, content
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    ids = tokenizer("<|im_start|><think>x</think><tool_call><|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    # Added tokens survive skip_special_tokens, special tokens do not (as with Qwen3).
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think><tool_call>"


def test_raw_tokenizer_json_flags(model_dir: Path) -> None:
    # What a tokenizers-only reader (the slim API install) sees.
    raw = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    flags = {t.content: t.special for t in raw.get_added_tokens_decoder().values()}
    assert flags == {**dict.fromkeys(SPECIAL_TOKENS, True), **dict.fromkeys(ADDED_TOKENS, False)}
    assert 1000 <= raw.get_vocab_size() <= 2000


def test_config_files(model_dir: Path, tokenizer: Any) -> None:
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE_PATH.read_text()
    assert (model_dir / "model.safetensors").is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["max_position_embeddings"] == 1024


def test_unicode_completion_splits_characters_across_tokens(tokenizer: Any) -> None:
    ids = tokenizer(scenario("unicode").completion, add_special_tokens=False)["input_ids"]
    # A token that alone is not valid UTF-8 decodes to U+FFFD: streaming must buffer it.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_scenario_lookup() -> None:
    assert scenario("hello").completion == "Hello! How can I help you today?"
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)
    assert [s.name for s in variants(scenario("tool_call"))] == [
        "tool_call",
        "tool_call[strict=true]",
        "tool_call[strict=false]",
    ]
    with pytest.raises(KeyError, match="no fixture scenario"):
        scenario("missing")


def test_cache_hit_returns_same_dir(model_dir: Path) -> None:
    assert ensure_fixture_model(model_dir.parent) == model_dir
    assert model_dir.name == build_module.cache_key()


def test_concurrent_callers_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    barrier = threading.Barrier(4)

    def fake_build(out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(0.3)  # hold the lock while the other callers queue up on it
        (out_dir / "config.json").write_text("{}")

    def call() -> None:
        barrier.wait(timeout=10)  # all four start together
        results.append(ensure_fixture_model(tmp_path))

    monkeypatch.setattr(build_module, "build_fixture_model", fake_build)
    results: list[Path] = []
    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(calls) == 1
    assert len(results) == 4
    assert len(set(results)) == 1
    assert (results[0] / "config.json").is_file()
    # Only the finished folder and its lock file remain: no staging leftovers.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([results[0].name, f"{results[0].name}.lock"])
