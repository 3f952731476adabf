"""Stateful Responses end to end: store, retrieve, conversations, background jobs, resume, cancel,
delete and input items, against both post-processing modes, with the SDK in strict mode.

Where a test needs the bytes on the wire (byte-identical JSON, resumed streams) it reads
them with httpx; everything else goes through the official SDK.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from openai import BadRequestError, NotFoundError, OpenAI

from tests.e2e.conftest import MODEL, Stack, start_stack
from tests.fixture_model import ENDLESS_MIN_TOKENS, scenario
from tests.support.invariants import check_stream, output_text
from tests.support.processes import RoleProcess
from tests.support.scenarios import scenario_input, scenario_tools

pytestmark = pytest.mark.e2e

WAIT_S = 240.0
"""Upper bound for anything to happen on a loaded two-core machine (never reached when it works)."""

UNKNOWN_ID = "resp_" + "0123456789abcdef" * 2
RawEvent = tuple[str, bytes]


@pytest.fixture(scope="session")
def second_api(
    stack: Stack, gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path
) -> Iterator[Stack]:
    """Another API process on the same Redis, which created none of the responses it is asked about.

    Its streams are compared with the log event for event, so it never merges a lagging client's
    deltas (``RESQ_SSE_COALESCE_AFTER=0``): on a busy machine a resumed stream's reader could fall
    more than 16 events behind mid-generation, and got them merged (tests/e2e/test_slow_clients.py
    tests that merging)."""
    env = {**base_env, "RESQ_SSE_COALESCE_AFTER": "0"}
    other = start_stack(env, log_dir, 0, f"second-for-pp{stack.postprocess_workers}")
    try:
        yield other
    finally:
        other.group.stop_all()


# --- helpers ----------------------------------------------------------------------------------------


TERMINAL_TYPES = ("response.completed", "response.incomplete", "response.failed")


def iter_events(reply: httpx.Response) -> Iterator[RawEvent]:
    """``(type, data bytes)`` of each SSE event of ``reply``, as it arrives, up to ``data: [DONE]``.

    ``[DONE]`` (a frame without an event type) must come right after the terminal event.
    """
    event_type = ""
    last_type = ""
    for line in reply.iter_lines():
        if line.startswith("event: "):
            event_type = line[len("event: ") :]
        elif line == "data: [DONE]":
            assert not event_type and last_type in TERMINAL_TYPES, (event_type, last_type)
            return
        elif line.startswith("data: "):
            yield event_type, line[len("data: ") :].encode()
            last_type, event_type = event_type, ""


def raw_events(reply: httpx.Response, stop_after: int | None = None) -> list[RawEvent]:
    """The SSE events of ``reply``: all of them, or the first ``stop_after``."""
    events: list[RawEvent] = []
    for event in iter_events(reply):
        events.append(event)
        if stop_after is not None and len(events) >= stop_after:
            break
    return events


def replay(base_url: str, response_id: str, starting_after: int | None = None) -> list[RawEvent]:
    """Every event ``GET ?stream=true`` sends (after ``starting_after``), read to the end of the body."""
    params: dict[str, Any] = {"stream": "true"}
    if starting_after is not None:
        params["starting_after"] = starting_after
    with (
        httpx.Client(timeout=WAIT_S) as http,
        http.stream("GET", f"{base_url}/v1/responses/{response_id}", params=params) as reply,
    ):
        assert reply.status_code == 200, reply.read()
        return raw_events(reply)


def decoded(events: list[RawEvent]) -> list[dict[str, Any]]:
    """The events' JSON, checked to name the same type as their SSE ``event:`` line."""
    result = []
    for event_type, data in events:
        event = json.loads(data)
        assert event["type"] == event_type
        result.append(event)
    return result


def wait_for(condition: Any, what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll ``condition()`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def wait_until_done(client: OpenAI, response_id: str) -> dict[str, Any]:
    """Poll ``GET`` until the response reaches a terminal status; return it."""

    def done() -> dict[str, Any] | None:
        current = client.responses.retrieve(response_id).model_dump(mode="json")
        return current if current["status"] not in ("queued", "in_progress") else None

    result: dict[str, Any] = wait_for(done, f"{response_id} to finish")
    return result


def response_keys(redis_client: redis.Redis, response_id: str) -> set[str]:
    """The Redis keys of one response that exist now."""
    return {key.decode() for key in redis_client.scan_iter(match=f"resq:{{{response_id}}}:*")}


def error_of(reply: httpx.Response) -> dict[str, Any]:
    """The OpenAI error envelope's inner object, checked to have all four keys."""
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def explicit_history(*turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items that replay a conversation by hand (earlier output items echoed as input)."""
    return [item for turn in turns for item in turn]


def echoed(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output items as a client echoes them back as input."""
    items = []
    for item in response["output"]:
        if item["type"] == "message":
            items.append({"role": "assistant", "content": output_text({"output": [item]})})
        elif item["type"] == "function_call":
            items.append(
                {
                    "type": "function_call",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
    return items


def greedy(client: OpenAI, **request: Any) -> dict[str, Any]:
    """A non-streaming greedy response, as a dict."""
    request.setdefault("temperature", 0)
    response: dict[str, Any] = client.responses.create(model=MODEL, **request).model_dump(mode="json")
    return response


# --- store and retrieve -------------------------------------------------------------------------------


def test_retrieve_returns_the_bytes_the_create_call_returned(stack: Stack, client: OpenAI) -> None:
    body = {"model": MODEL, "input": "Say hello.", "temperature": 0}
    created = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=WAIT_S)
    assert created.status_code == 200
    response_id = created.json()["id"]
    retrieved = httpx.get(f"{stack.base_url}/v1/responses/{response_id}", timeout=30)
    assert retrieved.status_code == 200
    assert retrieved.content == created.content
    assert created.json()["store"] is True

    sdk = client.responses.retrieve(response_id)
    assert sdk.status == "completed"
    assert sdk.output_text == scenario("hello").completion

    # A streamed response: the terminal event carries the same bytes GET returns.
    with (
        httpx.Client(timeout=WAIT_S) as http,
        http.stream("POST", f"{stack.base_url}/v1/responses", json={**body, "stream": True}) as reply,
    ):
        streamed = raw_events(reply)
    streamed_id = json.loads(streamed[0][1])["response"]["id"]
    terminal = streamed[-1][1]
    stored = httpx.get(f"{stack.base_url}/v1/responses/{streamed_id}", timeout=30).content
    assert terminal.endswith(b',"response":' + stored + b"}")


def test_store_false_is_not_retrievable(stack: Stack, client: OpenAI, redis_client: redis.Redis) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", temperature=0, store=False)
    assert response.to_dict()["store"] is False
    assert response.output_text == scenario("hello").completion
    for method, path in [
        ("GET", ""),
        ("GET", "/input_items"),
        ("POST", "/cancel"),
        ("DELETE", ""),
    ]:
        reply = httpx.request(method, f"{stack.base_url}/v1/responses/{response.id}{path}", timeout=30)
        assert reply.status_code == 404, (method, path, reply.text)
        assert error_of(reply)["message"] == f"Response with id '{response.id}' not found."
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Again.", previous_response_id=response.id)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "previous_response_not_found"
    # Once the client has it, nothing of a store=false response stays in Redis.
    wait_for(lambda: not response_keys(redis_client, response.id), "the unstored response's keys to go")


@pytest.mark.parametrize("store", [True, False])
def test_only_a_stored_response_records_its_input(
    client: OpenAI, redis_client: redis.Redis, store: bool
) -> None:
    # The input record is written in the step that records the response, before its first event:
    # at `response.created` a stored response has it, and an unstored one (whose input nobody can
    # read back) never gets one.
    with client.responses.create(
        model=MODEL, input="Say hello.", temperature=0, store=store, stream=True
    ) as stream:
        created = next(iter(stream))
        assert created.type == "response.created"
        response_id = created.response.id
        assert redis_client.exists(f"resq:{{{response_id}}}:input") == int(store)
        assert redis_client.exists(f"resq:{{{response_id}}}:response") == 1


def test_stored_keys_get_the_store_ttl_once_final(
    stack: Stack, client: OpenAI, redis_client: redis.Redis
) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
    transient_ttl_s = 3600  # RESQ_TRANSIENT_TTL_S default; the store TTL default is 30 days
    for suffix in ("response", "events", "input"):
        ttl = redis_client.ttl(f"resq:{{{response.id}}}:{suffix}")
        assert ttl > transient_ttl_s, (suffix, ttl)


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", ""), ("GET", "/input_items"), ("POST", "/cancel"), ("DELETE", "")],
)
def test_malformed_ids_are_400_and_unknown_ids_404(stack: Stack, method: str, path: str) -> None:
    for malformed in ("abc", "resp_123", "resp_" + "g" * 32, "msg_" + "0" * 32):
        reply = httpx.request(method, f"{stack.base_url}/v1/responses/{malformed}{path}", timeout=30)
        assert reply.status_code == 400, (malformed, reply.text)
        assert error_of(reply)["type"] == "invalid_request_error"
    reply = httpx.request(method, f"{stack.base_url}/v1/responses/{UNKNOWN_ID}{path}", timeout=30)
    assert reply.status_code == 404, reply.text
    assert error_of(reply)["message"] == f"Response with id '{UNKNOWN_ID}' not found."


def test_sdk_raises_not_found_for_unknown_ids(client: OpenAI) -> None:
    with pytest.raises(NotFoundError):
        client.responses.retrieve(UNKNOWN_ID)
    with pytest.raises(NotFoundError):
        client.responses.cancel(UNKNOWN_ID)
    with pytest.raises(NotFoundError):
        client.responses.delete(UNKNOWN_ID)
    with pytest.raises(NotFoundError):
        client.responses.input_items.list(UNKNOWN_ID)


def test_query_parameters_the_sdk_may_send_do_not_break_retrieve(stack: Stack, client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
    retrieved = client.responses.retrieve(
        response.id, include=["message.output_text.logprobs"], include_obfuscation=False
    )
    assert retrieved.model_dump() == response.model_dump()
    listed = client.responses.input_items.list(response.id, include=["message.output_text.logprobs"])
    assert len(listed.data) == 1
    for params, param in [
        ({"stream": "maybe"}, "stream"),
        ({"stream": "true", "starting_after": "x"}, "starting_after"),
        ({"stream": "true", "starting_after": "-1"}, "starting_after"),
    ]:
        reply = httpx.get(f"{stack.base_url}/v1/responses/{response.id}", params=params, timeout=30)
        assert reply.status_code == 400, reply.text
        assert error_of(reply)["param"] == param


# --- conversations ------------------------------------------------------------------------------------


def test_continuing_a_tool_call_with_its_result(client: OpenAI) -> None:
    tools = scenario_tools(scenario("tool_call"))
    first = greedy(client, input="What is the weather in Paris?", tools=tools)
    calls = [item for item in first["output"] if item["type"] == "function_call"]
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    second = greedy(
        client,
        previous_response_id=first["id"],
        tools=tools,
        input=[{"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "22C and sunny"}],
    )
    # The fixture model answers this exactly only when it sees the whole earlier conversation.
    assert output_text(second) == scenario("after_tool_result").completion
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] >= (
        first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    )


def test_chaining_equals_sending_the_whole_history(client: OpenAI) -> None:
    first = greedy(client, input="Say hello.")
    assert output_text(first) == scenario("hello").completion
    second = greedy(client, previous_response_id=first["id"], input="Count to twenty.", max_output_tokens=24)
    assert second["usage"]["input_tokens"] >= (
        first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    )
    by_hand = greedy(
        client,
        input=explicit_history(
            [{"role": "user", "content": "Say hello."}],
            echoed(first),
            [{"role": "user", "content": "Count to twenty."}],
        ),
        max_output_tokens=24,
    )
    assert second["usage"]["input_tokens"] == by_hand["usage"]["input_tokens"]
    assert output_text(second) == output_text(by_hand)


def test_new_instructions_replace_the_earlier_ones(client: OpenAI) -> None:
    first = greedy(client, instructions="You are terse.", input="Say hello.")
    assert output_text(first) == scenario("terse_system").completion
    history = [
        {"role": "user", "content": "Say hello."},
        *echoed(first),
        {"role": "user", "content": "Again."},
    ]

    without = greedy(client, previous_response_id=first["id"], input="Again.", max_output_tokens=16)
    without_by_hand = greedy(client, input=history, max_output_tokens=16)
    assert without["instructions"] is None
    assert without["usage"]["input_tokens"] == without_by_hand["usage"]["input_tokens"]
    assert output_text(without) == output_text(without_by_hand)

    replaced = greedy(
        client,
        previous_response_id=first["id"],
        instructions="Answer in French.",
        input="Again.",
        max_output_tokens=16,
    )
    replaced_by_hand = greedy(client, instructions="Answer in French.", input=history, max_output_tokens=16)
    assert replaced["instructions"] == "Answer in French."
    assert replaced["usage"]["input_tokens"] == replaced_by_hand["usage"]["input_tokens"]
    assert output_text(replaced) == output_text(replaced_by_hand)


def test_two_requests_may_branch_from_one_response(client: OpenAI) -> None:
    root = greedy(client, input="Say hello.")
    left = greedy(client, previous_response_id=root["id"], input="Count to twenty.", max_output_tokens=12)
    right = greedy(client, previous_response_id=root["id"], input="Say hello.", max_output_tokens=12)
    leaf = greedy(client, previous_response_id=left["id"], input="Say hello.", max_output_tokens=12)

    base = [{"role": "user", "content": "Say hello."}, *echoed(root)]
    expected = {
        "left": [*base, {"role": "user", "content": "Count to twenty."}],
        "right": [*base, {"role": "user", "content": "Say hello."}],
    }
    expected["leaf"] = [*expected["left"], *echoed(left), {"role": "user", "content": "Say hello."}]
    for name, branch in [("left", left), ("right", right), ("leaf", leaf)]:
        by_hand = greedy(client, input=expected[name], max_output_tokens=12)
        assert branch["usage"]["input_tokens"] == by_hand["usage"]["input_tokens"], name
        assert output_text(branch) == output_text(by_hand), name
    # The leaf continues the left branch only: the right branch did not leak into it.
    assert leaf["usage"]["input_tokens"] > left["usage"]["input_tokens"] + left["usage"]["output_tokens"]


def test_an_unstored_request_may_continue_a_stored_one(stack: Stack, client: OpenAI) -> None:
    first = greedy(client, input="Say hello.")
    second = greedy(
        client, previous_response_id=first["id"], input="Say hello.", store=False, max_output_tokens=8
    )
    assert second["store"] is False
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    reply = httpx.get(f"{stack.base_url}/v1/responses/{second['id']}", timeout=30)
    assert reply.status_code == 404


def test_unusable_previous_response_ids_are_400(stack: Stack) -> None:
    for previous, code in [
        (UNKNOWN_ID, "previous_response_not_found"),
        ("resp_nope", "previous_response_not_found"),
    ]:
        body = {"model": MODEL, "input": "hi", "previous_response_id": previous}
        reply = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=30)
        assert reply.status_code == 400, reply.text
        error = error_of(reply)
        assert error["param"] == "previous_response_id"
        assert error["code"] == code


def test_a_deleted_response_cannot_be_continued(client: OpenAI) -> None:
    first = greedy(client, input="Say hello.")
    client.responses.delete(first["id"])
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Again.", previous_response_id=first["id"])
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "previous_response_not_found"
    assert caught.value.body["param"] == "previous_response_id"


def _post_timed(url: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
    """POST ``body``; ``answer`` gets the reply and the monotonic times it was sent and answered."""
    answer["sent"] = time.monotonic()
    answer["reply"] = httpx.post(url, json=body, timeout=WAIT_S)
    answer["answered"] = time.monotonic()


def test_a_continuation_racing_the_delete_of_its_parent_is_refused_or_continuable(
    stack: Stack, client: OpenAI
) -> None:
    """The parent deleted while a continuation of it is being accepted: after the request read the
    parent's history, before the step that records it. The continuation is refused (400), or
    recorded with a turn of its own; never recorded without one, which no request could continue
    (before the step's parent guard, 11 of 11 such continuations in a review)."""
    long_input = [{"role": "user", "content": f"line {index}"} for index in range(3000)]  # a slow accept
    overlapped = refused = 0
    for attempt in range(8):
        parent = greedy(client, input="Say hello.", max_output_tokens=2)
        answer: dict[str, Any] = {}
        body = {
            "model": MODEL,
            "input": long_input,
            "previous_response_id": parent["id"],
            "max_output_tokens": 2,
            "truncation": "auto",
        }
        continuing = threading.Thread(
            target=_post_timed, args=(f"{stack.base_url}/v1/responses", body, answer)
        )
        continuing.start()
        time.sleep(0.02 * (attempt + 1))
        client.responses.delete(parent["id"])
        deleted_at = time.monotonic()
        continuing.join()
        overlapped += answer["sent"] < deleted_at < answer["answered"]
        reply: httpx.Response = answer["reply"]
        if reply.status_code == 400:
            assert error_of(reply)["code"] == "previous_response_not_found"
            refused += 1
            continue
        assert reply.status_code == 200, reply.text
        child_id = reply.json()["id"]
        grandchild = client.responses.create(
            model=MODEL, input="Again.", previous_response_id=child_id, max_output_tokens=2, truncation="auto"
        )
        assert grandchild.previous_response_id == child_id
    # The deletes landed while continuations were being accepted, and some were refused for it.
    assert overlapped > 0 and refused > 0, (overlapped, refused)


# --- background, resume, cancel -----------------------------------------------------------------------


def test_background_response_is_polled_to_completion(client: OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="Count to twenty.", temperature=0, background=True)
    assert created.status == "queued"
    assert created.background is True
    assert created.output == []
    seen = [created.status]

    def finished() -> dict[str, Any] | None:
        current = client.responses.retrieve(created.id).model_dump(mode="json")
        if current["status"] != seen[-1]:
            seen.append(current["status"])
        return current if current["status"] not in ("queued", "in_progress") else None

    final: dict[str, Any] = wait_for(finished, "the background response to finish")
    assert seen in (["queued", "completed"], ["queued", "in_progress", "completed"]), seen
    assert final["status"] == "completed"
    assert final["background"] is True
    assert output_text(final) == scenario("count").completion
    assert final["usage"]["output_tokens"] > 0


def test_background_stream_resumes_from_another_api_process(
    stack: Stack, second_api: Stack, client: OpenAI
) -> None:
    body = {
        "model": MODEL,
        "input": "Repeat forever.",
        "temperature": 0,
        "max_output_tokens": 120,
        "background": True,
        "stream": True,
    }
    cut = 6
    with (
        httpx.Client(timeout=WAIT_S) as http,
        http.stream("POST", f"{stack.base_url}/v1/responses", json=body) as reply,
    ):
        head = raw_events(reply, stop_after=cut + 1)
    # The client left after event `cut`: a background response goes on without it.
    first_events = decoded(head)
    assert [event["type"] for event in first_events[:3]] == [
        "response.created",
        "response.queued",
        "response.in_progress",
    ]
    assert first_events[0]["response"]["status"] == "queued"
    response_id = first_events[0]["response"]["id"]

    # Resumed at `cut` from an API process that never saw this response, most likely mid-generation.
    resumed = replay(second_api.base_url, response_id, starting_after=cut)
    everything = replay(second_api.base_url, response_id)
    assert everything[: cut + 1] == head
    assert resumed == everything[cut + 1 :]
    assert [event["sequence_number"] for event in decoded(resumed)] == list(range(cut + 1, len(everything)))
    final = check_stream(decoded(everything), background=True)
    assert final["status"] == "incomplete"
    assert final["usage"]["output_tokens"] == 120

    # The SDK, strict, from the second process: retrieve(stream=True, starting_after) and the stream helper.
    other = second_api.client()
    with other.responses.retrieve(response_id, stream=True, starting_after=cut) as events:
        sdk_resumed = [event.to_dict() for event in events]
    assert sdk_resumed == decoded(resumed)
    with other.responses.stream(response_id=response_id, starting_after=cut) as helper:
        helper_numbers = [event.sequence_number for event in helper]
    assert helper_numbers == list(range(cut + 1, len(everything)))


def test_replay_from_zero_gives_the_whole_stream(stack: Stack, second_api: Stack) -> None:
    body = {"model": MODEL, "input": "Say hello.", "temperature": 0, "stream": True}
    with (
        httpx.Client(timeout=WAIT_S) as http,
        http.stream("POST", f"{stack.base_url}/v1/responses", json=body) as reply,
    ):
        original = raw_events(reply)
    response_id = json.loads(original[0][1])["response"]["id"]
    assert replay(second_api.base_url, response_id) == original
    final = check_stream(decoded(original))
    assert output_text(final) == scenario("hello").completion
    # Past the terminal event there is nothing to send, and the body ends at once.
    assert replay(second_api.base_url, response_id, starting_after=len(original) - 1) == []

    with second_api.client().responses.stream(response_id=response_id) as helper:
        replayed = [(event.type, event.sequence_number) for event in helper]
        from_helper = helper.get_final_response()
    assert replayed == [(event["type"], event["sequence_number"]) for event in decoded(original)]
    assert from_helper.output_text == scenario("hello").completion


def _delta_count(base_url: str, response_id: str) -> int:
    return sum(1 for kind, _ in replay(base_url, response_id) if kind == "response.output_text.delta")


ENDLESS_LIMIT = 960
"""Output limit of the endless scenario (it runs to the limit): seconds of generation, far longer
than the few milliseconds between its first delta and the call that acts on it."""
ATTEMPTS = 5
"""Tries at catching an endless response while it runs; more than one only if the machine stalls."""


def _endless(client: OpenAI) -> str:
    created = client.responses.create(
        model=MODEL, input="Repeat forever.", temperature=0, max_output_tokens=ENDLESS_LIMIT, background=True
    )
    return created.id


def _running_endless(stack: Stack, client: OpenAI) -> tuple[str, str]:
    """A background endless response once it streams deltas, and a control started after it."""
    target = _endless(client)
    with (
        httpx.Client(timeout=WAIT_S) as http,
        http.stream("GET", f"{stack.base_url}/v1/responses/{target}", params={"stream": "true"}) as reply,
    ):
        for kind, _ in iter_events(reply):
            if kind == "response.output_text.delta":
                break
    # Same prompt, same limit, started later: when it ends, the target would have ended too.
    return target, _endless(client)


def test_cancel_stops_generation_and_stays_cancelled(stack: Stack, second_api: Stack, client: OpenAI) -> None:
    assert ENDLESS_MIN_TOKENS < ENDLESS_LIMIT
    for _ in range(ATTEMPTS):
        target, control = _running_endless(stack, client)
        # A live stream of the response, followed while the cancel happens, from the API that never
        # merges a lagging reader's deltas: it is compared with the log event for event below.
        live: list[list[RawEvent]] = []
        follower = threading.Thread(target=lambda: live.append(replay(second_api.base_url, target)))  # noqa: B023
        follower.start()
        cancel_reply = httpx.post(f"{stack.base_url}/v1/responses/{target}/cancel", timeout=WAIT_S)
        assert cancel_reply.status_code == 200, cancel_reply.text
        if cancel_reply.json()["status"] == "cancelled":
            break
        # The target ran to its limit before the cancel reached it (a stalled machine): again.
        assert cancel_reply.json()["status"] == "incomplete"
        follower.join(timeout=WAIT_S)
        wait_until_done(client, control)
    else:
        pytest.fail(f"no cancel reached a running response in {ATTEMPTS} attempts")
    cancelled = cancel_reply.json()
    assert cancelled["background"] is True
    output_tokens = cancelled["usage"]["output_tokens"]
    assert 1 <= output_tokens < ENDLESS_LIMIT
    deltas_at_cancel = _delta_count(stack.base_url, target)

    # Cancelling again: 200 with the same cancelled Response, byte for byte.
    again = httpx.post(f"{stack.base_url}/v1/responses/{target}/cancel", timeout=WAIT_S)
    assert again.status_code == 200
    assert again.content == cancel_reply.content
    assert client.responses.cancel(target).model_dump() == client.responses.retrieve(target).model_dump()

    # Run the control job to its end: by then the cancelled one would have finished too.
    finished_control = wait_until_done(client, control)
    assert finished_control["status"] == "incomplete"
    assert finished_control["usage"]["output_tokens"] == ENDLESS_LIMIT
    after = httpx.get(f"{stack.base_url}/v1/responses/{target}", timeout=30)
    assert after.content == cancel_reply.content
    assert _delta_count(stack.base_url, target) == deltas_at_cancel

    # Its stream, live or replayed, ends with response.incomplete whose Response says cancelled.
    follower.join(timeout=WAIT_S)
    assert live and live[0] == replay(second_api.base_url, target)
    events = decoded(live[0])
    final = check_stream(events, background=True)
    assert events[-1]["type"] == "response.incomplete"
    assert final["status"] == "cancelled"
    assert live[0][-1][1].endswith(b',"response":' + cancel_reply.content + b"}")


def test_cancel_is_for_background_responses_only(stack: Stack, client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
    with pytest.raises(BadRequestError):
        client.responses.cancel(response.id)
    assert client.responses.retrieve(response.id).status == "completed"


def test_cancel_right_after_create_is_final_and_a_finished_response_keeps_its_status(client: OpenAI) -> None:
    created = _endless(client)
    cancelled = client.responses.cancel(created)
    assert cancelled.status == "cancelled"
    assert cancelled.usage is not None and cancelled.usage.output_tokens < ENDLESS_LIMIT
    assert wait_until_done(client, created)["status"] == "cancelled"

    finished = client.responses.create(model=MODEL, input="Say hello.", temperature=0, background=True)
    done = wait_until_done(client, finished.id)
    assert client.responses.cancel(finished.id).model_dump(mode="json") == done


def test_previous_response_must_be_finished(stack: Stack, client: OpenAI) -> None:
    for _ in range(ATTEMPTS):
        running, control = _running_endless(stack, client)
        body = {"model": MODEL, "input": "hi", "previous_response_id": running}
        reply = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=30)
        client.responses.cancel(running)
        client.responses.cancel(control)
        if reply.status_code == 400:
            break
        # Accepted only if the earlier response had ended before (a stalled machine): again.
        assert reply.status_code == 200, reply.text
        assert client.responses.retrieve(running).status == "incomplete"
    else:
        pytest.fail(f"no request reached a running response in {ATTEMPTS} attempts")
    error = error_of(reply)
    assert error["param"] == "previous_response_id"
    assert "in_progress" in error["message"]


# --- delete -------------------------------------------------------------------------------------------


def test_delete_removes_every_key(stack: Stack, client: OpenAI, redis_client: redis.Redis) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
    assert response_keys(redis_client, response.id)
    reply = httpx.delete(f"{stack.base_url}/v1/responses/{response.id}", timeout=30)
    assert reply.status_code == 200
    assert reply.json() == {"id": response.id, "object": "response", "deleted": True}
    assert response_keys(redis_client, response.id) == set()
    with pytest.raises(NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(NotFoundError):
        client.responses.delete(response.id)


def test_deleting_a_running_response_stops_it(
    stack: Stack, client: OpenAI, redis_client: redis.Redis
) -> None:
    flag = "resq:{%s}:cancel"
    for _ in range(ATTEMPTS):
        target, control = _running_endless(stack, client)
        client.responses.delete(target)
        with pytest.raises(NotFoundError):
            client.responses.retrieve(target)
        left = response_keys(redis_client, target)
        if left:
            break
        # Nothing is left only when it had finished before the delete (a stalled machine): again.
        wait_until_done(client, control)
    else:
        pytest.fail(f"no delete reached a running response in {ATTEMPTS} attempts")
    # Only the cancel flag stays (it expires), also after the generation would have ended:
    # nothing the GPU worker or the post-processor still wrote brought a key back.
    assert left == {flag % target}
    wait_until_done(client, control)
    assert response_keys(redis_client, target) <= {flag % target}
    assert redis_client.ttl(flag % target) > 0


def _generating(redis_client: redis.Redis, marker: str) -> str | None:
    """The id of the response whose metadata carries ``marker``, once it streams deltas."""
    for key in redis_client.scan_iter(match="resq:{resp_*}:response"):
        created = redis_client.hget(key, "created")
        if created is not None and marker.encode() in created:
            response_id = key.decode().split("{", 1)[1].split("}", 1)[0]
            deltas = redis_client.xrange(f"resq:{{{response_id}}}:events", "0-4", "+", count=1)
            return response_id if deltas else None
    return None


def test_a_waiting_client_of_a_deleted_response_gets_404(
    stack: Stack, client: OpenAI, redis_client: redis.Redis
) -> None:
    for attempt in range(ATTEMPTS):
        outcome: list[BaseException | str] = []
        marker = f"waiting-{stack.postprocess_workers}-{attempt}-{time.time_ns()}"

        def wait_for_answer() -> None:
            try:
                answer = client.responses.create(
                    model=MODEL,
                    input="Repeat forever.",
                    temperature=0,
                    max_output_tokens=ENDLESS_LIMIT,
                    metadata={"marker": marker},  # noqa: B023
                )
                outcome.append(answer.status)  # noqa: B023
            except BaseException as exc:
                outcome.append(exc)  # noqa: B023

        waiting = threading.Thread(target=wait_for_answer)
        waiting.start()
        response_id = wait_for(lambda: _generating(redis_client, marker), "the request to generate")  # noqa: B023
        httpx.delete(f"{stack.base_url}/v1/responses/{response_id}", timeout=30)
        waiting.join(timeout=WAIT_S)
        if not isinstance(outcome[0], str):
            break
        # It had finished before the delete (a stalled machine): again.
        assert outcome[0] == "incomplete"
    else:
        pytest.fail(f"no delete reached a running response in {ATTEMPTS} attempts")
    # Not a 5xx, which the SDK would retry by creating the response again.
    assert isinstance(outcome[0], NotFoundError), outcome[0]


# --- input items --------------------------------------------------------------------------------------


def test_input_items_page_in_both_orders(stack: Stack, client: OpenAI) -> None:
    chosen = scenario("multi_turn")
    response = client.responses.create(model=MODEL, input=scenario_input(chosen), temperature=0)  # type: ignore[arg-type]
    assert response.output_text == chosen.completion
    texts = [message["content"] for message in chosen.messages]

    everything = client.responses.input_items.list(response.id, order="asc")
    assert [item.id for item in everything.data] and all(item.id for item in everything.data)
    ids_in_order = [item.id for item in everything.data]
    assert len(set(ids_in_order)) == 3
    assert [item.model_dump(mode="json")["content"][0]["text"] for item in everything.data] == texts
    assert everything.has_more is False

    for order, expected in [("asc", ids_in_order), ("desc", ids_in_order[::-1])]:
        pages = []
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1, "order": order}
            if after is not None:
                params["after"] = after
            page = httpx.get(
                f"{stack.base_url}/v1/responses/{response.id}/input_items", params=params, timeout=30
            ).json()
            pages.append(page)
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert [page["first_id"] for page in pages] == expected
        assert [page["last_id"] for page in pages] == expected
        assert [page["has_more"] for page in pages] == [True, True, False]
        # The SDK's auto-pagination follows last_id and stops on has_more=false.
        paged = client.responses.input_items.list(response.id, limit=1, order=order)  # type: ignore[arg-type]
        assert [item.id for item in paged] == expected

    default = client.responses.input_items.list(response.id)
    assert [item.id for item in default.data] == ids_in_order[::-1]
    # Past the last item: an empty page, whose cursors are strings as the SDK's type says.
    empty = client.responses.input_items.list(response.id, order="asc", after=ids_in_order[-1])
    assert empty.data == [] and empty.first_id == empty.last_id == "" and empty.has_more is False
    included = client.responses.input_items.list(response.id, include=["message.output_text.logprobs"])
    assert [item.id for item in included.data] == ids_in_order[::-1]

    refused: list[tuple[dict[str, Any], str]] = [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"order": "up"}, "order"),
        ({"include[]": "bogus"}, "include"),
    ]
    for bad, param in refused:
        reply = httpx.get(f"{stack.base_url}/v1/responses/{response.id}/input_items", params=bad, timeout=30)
        assert reply.status_code == 400, reply.text
        assert error_of(reply)["param"] == param


def test_input_items_of_a_continuation_are_its_own(client: OpenAI) -> None:
    first = greedy(client, input="Say hello.")
    second = greedy(client, previous_response_id=first["id"], input="Count to twenty.", max_output_tokens=4)
    items = client.responses.input_items.list(second["id"]).data
    assert len(items) == 1
    assert items[0].model_dump(mode="json")["content"][0]["text"] == "Count to twenty."
