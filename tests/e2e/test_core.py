"""The core pipeline end to end: SDK -> API -> Celery -> GPU worker -> Redis -> post-processor -> SSE.

Every test runs against both post-processing modes (inline and two workers), with
the official SDK in strict validation mode.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
import redis
from openai import NotFoundError, OpenAI

from tests.e2e.conftest import MODEL, Stack
from tests.fixture_model import ENDLESS_MIN_TOKENS, scenario
from tests.support.invariants import as_dict, check_stream, output_text
from tests.support.scenarios import scenario_input

pytestmark = pytest.mark.e2e


def stream(client: OpenAI, **request: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Stream a response; check the invariants; return the events and the final Response."""
    with client.responses.create(model=MODEL, stream=True, **request) as events:
        collected = [as_dict(event) for event in events]
    final = check_stream(collected, background=bool(request.get("background")))
    return collected, final


def test_non_streaming_answer(client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
    assert response.status == "completed"
    assert response.output_text == scenario("hello").completion
    assert response.id.startswith("resp_") and len(response.id) == len("resp_") + 32
    assert response.model == MODEL
    assert response.completed_at is not None
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_streaming_answer_keeps_the_invariants(client: OpenAI) -> None:
    events, final = stream(client, input="Say hello.", temperature=0)
    assert final["status"] == "completed"
    assert output_text(final) == scenario("hello").completion
    kinds = [event["type"] for event in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final["usage"]["output_tokens"] >= kinds.count("response.output_text.delta")


def test_stream_and_non_stream_give_the_same_answer(client: OpenAI) -> None:
    _, streamed = stream(client, input="Count to twenty.", temperature=0)
    plain = client.responses.create(model=MODEL, input="Count to twenty.", temperature=0)
    assert output_text(streamed) == plain.output_text == scenario("count").completion


def test_multibyte_characters_survive_token_splits(client: OpenAI) -> None:
    _, final = stream(client, input="Say something in Japanese.", temperature=0)
    assert output_text(final) == scenario("unicode").completion


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "plain"])
def test_max_output_tokens_gives_incomplete(client: OpenAI, streaming: bool) -> None:
    if streaming:
        events, final = stream(client, input="Count to twenty.", temperature=0, max_output_tokens=5)
        assert events[-1]["type"] == "response.incomplete"
    else:
        final = client.responses.create(
            model=MODEL, input="Count to twenty.", temperature=0, max_output_tokens=5
        ).model_dump(mode="json")
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 5
    assert final["output"][0]["status"] == "incomplete"
    assert scenario("count").completion.startswith(output_text(final))
    assert output_text(final)


def test_temperature_zero_is_deterministic_and_sampling_is_not(client: OpenAI) -> None:
    prompt = "Describe a zebra in many words."  # not a trained scenario: a free continuation
    greedy = [
        client.responses.create(model=MODEL, input=prompt, temperature=0, max_output_tokens=40).output_text
        for _ in range(2)
    ]
    assert greedy[0] == greedy[1] and greedy[0]
    sampled = {
        client.responses.create(model=MODEL, input=prompt, temperature=2.0, max_output_tokens=40).output_text
        for _ in range(3)
    }
    assert len(sampled) > 1, "temperature=2 gave the same text three times: sampling is not per request"


def test_sixteen_concurrent_streams_do_not_mix(client: OpenAI) -> None:
    names = ["hello", "count", "unicode", "multi_turn"] * 4
    results: dict[int, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            chosen = scenario(names[index])
            results[index] = stream(client, input=scenario_input(chosen), temperature=0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(names))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert len(results) == len(names)
    response_ids = set()
    for index, (events, final) in results.items():
        assert output_text(final) == scenario(names[index]).completion
        own_items = {item["id"] for item in final["output"]}
        for event in events:
            if "item_id" in event:
                assert event["item_id"] in own_items, "an event names another response's item"
            if "response" in event:
                assert event["response"]["id"] == final["id"]
        response_ids.add(final["id"])
    assert len(response_ids) == len(names)


def test_message_list_input_with_every_role(client: OpenAI) -> None:
    answer = client.responses.create(
        model=MODEL,
        temperature=0,
        input=[
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": "Nice to meet you, Ada."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "What is my name?"}],
            },
        ],
    )
    assert answer.output_text == scenario("multi_turn").completion

    developer = client.responses.create(
        model=MODEL,
        temperature=0,
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Say hello."},
        ],
    )
    assert developer.output_text == scenario("developer_role").completion

    system = client.responses.create(
        model=MODEL,
        temperature=0,
        input=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
    )
    instructions = client.responses.create(
        model=MODEL, temperature=0, instructions="You are terse.", input="Say hello."
    )
    assert system.output_text == instructions.output_text == scenario("terse_system").completion
    assert instructions.instructions == "You are terse."


def _record_status(client: redis.Redis, response_id: str) -> str | None:
    status = client.hget(f"resq:{{{response_id}}}:response", "status")
    return status.decode() if status is not None else None


STEPS_AFTER_CANCEL = 8
"""Tokens the GPU worker may still generate once the cancel flag is set: the publisher asks for the
flag in every step's round trip, so the engine stops within a step or two (each adds one token)."""


class FlagWatcher:
    """Polls a response's cancel flag (every 0.5 ms) and records how many tokens were published when
    it first appeared: an upper bound, since the count is read in the same round trip."""

    def __init__(self, client: redis.Redis) -> None:
        self.generated_at_flag: int | None = None
        self.response_id: str | None = None
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            response_id = self.response_id
            if response_id is not None:
                pipe = self._client.pipeline(transaction=False)
                pipe.exists(f"resq:{{{response_id}}}:cancel")
                pipe.hget(f"resq:{{{response_id}}}:generation", "generated")
                flagged, generated = pipe.execute()
                if flagged:
                    self.generated_at_flag = int(generated or 0)
                    return
            time.sleep(0.0005)

    def wait_seen(self, timeout_s: float) -> None:
        """Wait until it has seen the flag (which outlives the response): on a loaded machine its
        thread may not have run between the flag and the response's end."""
        self._thread.join(timeout=timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_disconnected_stream_stops_generation(stack: Stack, redis_client: redis.Redis) -> None:
    body = {
        "model": MODEL,
        "input": "Repeat forever.",
        "temperature": 0,
        "max_output_tokens": 900,
        "stream": True,
    }
    watcher = FlagWatcher(redis_client)
    try:
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{stack.base_url}/v1/responses", json=body) as reply,
        ):
            response_id = None
            deltas = 0
            for line in reply.iter_lines():
                if line.startswith("data: ") and response_id is None:
                    response_id = line.split('"id":"', 1)[1].split('"', 1)[0]
                    watcher.response_id = response_id
                if line.startswith("event: response.output_text.delta"):
                    deltas += 1
                    if deltas >= 3:
                        break
        assert response_id is not None
        # The client is gone: the API flags the response, the GPU worker stops within a step or two.
        deadline = time.monotonic() + 30
        while _record_status(redis_client, response_id) != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.1)
        watcher.wait_seen(10)
    finally:
        watcher.stop()
    assert _record_status(redis_client, response_id) == "cancelled"
    stored = redis_client.hget(f"resq:{{{response_id}}}:response", "response")
    assert stored is not None
    output_tokens = json.loads(stored)["usage"]["output_tokens"]
    assert 3 <= output_tokens < ENDLESS_MIN_TOKENS, output_tokens
    assert watcher.generated_at_flag is not None, "the cancel flag was never seen"
    after_flag = output_tokens - watcher.generated_at_flag
    print(f"tokens generated after the cancel flag: {after_flag} (of {output_tokens})")
    assert after_flag <= STEPS_AFTER_CANCEL, (after_flag, output_tokens)


def test_unknown_model_is_404(client: OpenAI) -> None:
    with pytest.raises(NotFoundError) as caught:
        client.responses.create(model="no-such-model", input="hi")
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"


def test_models_and_health(stack: Stack) -> None:
    models = httpx.get(f"{stack.base_url}/v1/models", timeout=10).json()
    assert models["object"] == "list"
    assert [model["id"] for model in models["data"]] == [MODEL]
    health = httpx.get(f"{stack.base_url}/health", timeout=10)
    assert health.status_code == 200
    report = health.json()
    assert report["status"] == "ok" and report["gpu_workers"] >= 1
    expected = "inline" if stack.postprocess_workers == 0 else stack.postprocess_workers
    assert report["postprocess_workers"] == expected
