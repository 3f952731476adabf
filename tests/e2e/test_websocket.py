"""WebSocket mode (``client.responses.connect()``), with the official SDK: the same events as SSE,
one response at a time, errors that leave the socket usable, chaining, the HTTP resume, and auth."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import websockets.exceptions
import websockets.sync.client

from resq import keys
from tests.e2e.conftest import MODEL, Stack, start_stack
from tests.support.invariants import as_dict, check_stream, output_text
from tests.support.processes import RoleProcess
from tests.support.reasoning import REASONING_PROMPT, reasoning_items, unstored_with_sealed_reasoning
from tests.support.responses import wait_ended

pytestmark = pytest.mark.e2e

TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


def until_terminal(connection: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for event in connection:
        events.append(as_dict(event))
        if event.type in TERMINAL:
            return events
    raise AssertionError("the socket closed before a terminal event")


def long_request(max_output_tokens: int) -> dict[str, Any]:
    """A ``response.create`` message whose answer runs on (the fixture model repeats itself)."""
    return {
        "type": "response.create",
        "model": MODEL,
        "input": "Repeat forever.",
        "max_output_tokens": max_output_tokens,
    }


def raw_socket(stack: Stack) -> websockets.sync.client.ClientConnection:
    """A socket on the stack's API, for frames the SDK would not send."""
    url = stack.base_url.replace("http://", "ws://") + "/v1/responses"
    return websockets.sync.client.connect(url, additional_headers={"Authorization": "Bearer sk-test"})


def test_a_socket_streams_responses_like_sse_and_chains_them(stack: Stack) -> None:
    client = stack.client()
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=16)
        first_events = until_terminal(connection)
        first = check_stream(first_events)
        # The same response over HTTP, for comparison: the same text.
        http = client.responses.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=16)
        assert output_text(first) == http.output_text

        # A bad message: an error event naming the parameter; the socket stays usable.
        connection.response.create(model=MODEL, input="Say hello.", temperature=7)
        error = until_terminal(connection)[-1]
        assert error["type"] == "error" and error["status"] == 400
        assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", "temperature")

        # Chained across messages by previous_response_id.
        connection.response.create(
            model=MODEL, input="Again.", previous_response_id=first["id"], temperature=0, max_output_tokens=8
        )
        second = check_stream(until_terminal(connection))
        assert second["previous_response_id"] == first["id"]
    # Every event is in the log: the HTTP resume replays the socket's response byte for byte.
    replayed = [as_dict(event) for event in client.responses.retrieve(first["id"], stream=True)]
    assert [(event["sequence_number"], event["type"]) for event in replayed] == [
        (event["sequence_number"], event["type"]) for event in first_events
    ]
    assert check_stream(replayed)["output"] == first["output"]


def test_messages_sent_at_once_are_answered_in_order(stack: Stack) -> None:
    client = stack.client()
    with client.responses.connect() as connection:
        for budget in (12, 4):
            connection.response.create(
                model=MODEL, input="Say hello.", temperature=0, max_output_tokens=budget
            )
        finals = [check_stream(until_terminal(connection)) for _ in range(2)]
    assert [final["max_output_tokens"] for final in finals] == [12, 4]


def test_a_socket_closed_mid_stream_cancels_its_generation(stack: Stack) -> None:
    client = stack.client()
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Repeat forever.", temperature=0, max_output_tokens=900)
        response_id = None
        for event in connection:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta":
                break
    assert response_id is not None
    final = wait_ended(client, response_id)
    assert final.status == "cancelled"


def test_a_close_behind_waiting_messages_cancels_and_a_message_past_them_is_refused(stack: Stack) -> None:
    """Messages past the 4 that may wait are refused at once (a 429 error event each), so the
    socket is always read: a close behind waiting messages was never read (the reader waited for
    room), the streaming generation ran to its end and the waiting messages were answered."""
    log_path = stack.api.log_path
    logged_before = len(log_path.read_text(errors="replace"))
    request = long_request(900)
    socket = raw_socket(stack)
    for index in range(8):
        socket.send(json.dumps({**request, "stream_id": f"s{index}"}))
    created: str | None = None
    refused: list[dict[str, Any]] = []
    while created is None or len(refused) < 3:
        event = json.loads(socket.recv(timeout=30))
        if event["type"] == "error":
            refused.append(event)
        elif event["type"] == "response.created":
            assert event["stream_id"] == "s0"
            created = event["response"]["id"]
    # The first one streams; 4 wait (3 or 4 are refused, as the first is taken before or after
    # the reader has read the rest): the refused are the last sent.
    assert [event["stream_id"] for event in refused] == [f"s{index}" for index in range(8 - len(refused), 8)]
    assert {(event["status"], event["error"]["code"]) for event in refused} == {
        (429, "too_many_messages_waiting")
    }
    closing = time.monotonic()
    socket.close()
    assert time.monotonic() - closing < 5  # the server answered the close (the client waited 10 s)
    assert wait_ended(stack.client(), created).status == "cancelled"
    time.sleep(1)
    logged = log_path.read_text(errors="replace")[logged_before:]
    assert logged.count("accepted: ") == 1, "a message waiting at the close was accepted"


def test_a_socket_response_is_counted_in_the_metrics_as_an_sse_one(stack: Stack) -> None:
    def scraped() -> dict[str, float]:
        text = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
        names = ("resq_responses_delivered_total", "resq_time_to_first_token_seconds_count")
        return {
            name: sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
            for name in names
        }

    before = scraped()
    with stack.client().responses.connect() as connection:
        connection.response.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=8)
        check_stream(until_terminal(connection))
    after = scraped()
    assert {name: after[name] - before[name] for name in before} == {
        "resq_responses_delivered_total": 1,
        "resq_time_to_first_token_seconds_count": 1,
    }


def test_sockets_closed_right_after_a_request_log_no_errors(stack: Stack) -> None:
    """Closing a socket while its response streams is a client's right, not a server error: the
    relay that meets the closed socket ends quietly (each such close logged an asyncio error with
    two tracebacks before)."""
    log_path = stack.api.log_path
    logged_before = len(log_path.read_text(errors="replace"))
    request = long_request(200)
    for _ in range(10):
        with raw_socket(stack) as socket:
            socket.send(json.dumps(request))
            socket.recv(timeout=30)  # response.created; closed then: the relay's next sends meet it
            # (A message still queued when its socket closes is not accepted at all.)
    time.sleep(2)  # each cancelled generation ends; the API logs what it logs
    logged = log_path.read_text(errors="replace")[logged_before:]
    assert logged.count("generation cancelled") + logged.count("socket closed while") > 0, logged[-2000:]
    assert "Traceback" not in logged and "never retrieved" not in logged, logged[-4000:]


def test_background_and_non_objects_are_refused_on_the_socket(stack: Stack) -> None:
    with raw_socket(stack) as socket:
        socket.send('{"type": "response.create", "model": "fixture", "input": "Hi", "background": true}')
        assert '"param":"background"' in str(socket.recv(timeout=30))
        socket.send("not json")
        assert '"code":"invalid_json"' in str(socket.recv(timeout=30))
        # A binary frame is read as UTF-8 JSON (it used to end the socket's reader: no answer, ever).
        socket.send(b'{"type": "response.create", "model": "fixture", "input": "Hi", "background": true}')
        assert '"param":"background"' in str(socket.recv(timeout=30))
        socket.send(b"\xff\xfe not UTF-8")
        assert '"code":"invalid_json"' in str(socket.recv(timeout=30))
        socket.send("[" * 100_000)  # deeper than any JSON parser recurses
        assert '"code":"invalid_json"' in str(socket.recv(timeout=30))
        socket.send('{"type": "session.update"}')
        assert '"param":"type"' in str(socket.recv(timeout=30))
        socket.send('{"type": "response.create", "model": "fixture", "input": "Hi", "stream": "yes"}')
        assert '"param":"stream"' in str(socket.recv(timeout=30))
        # Numbers the store cannot write get the same error as over HTTP (the message's JSON is
        # parsed as a body is, so 2**64 is not silently read as a float).
        socket.send(
            '{"type": "response.create", "model": "fixture", "input": [{"role": "assistant", "content": '
            '[{"type": "output_text", "text": "x", "annotations": [18446744073709551616]}]}]}'
        )
        assert '"param":"input[0].content[0].annotations[0]"' in str(socket.recv(timeout=30))
        socket.send('{"type": "response.create", "model": "fixture", "input": "Hi", "temperature": NaN}')
        assert '"param":"temperature"' in str(socket.recv(timeout=30))
        # The socket is still usable.
        socket.send('{"type": "response.create", "model": "fixture", "input": "Hi", "max_output_tokens": 4}')
        while True:
            event = json.loads(socket.recv(timeout=60))
            assert event["type"] not in ("error", "response.failed"), event
            if event["type"] in ("response.completed", "response.incomplete"):
                break


def test_an_unstored_response_is_continued_on_its_socket_only(stack: Stack) -> None:
    """The socket keeps its last response in memory (the Open Responses rule): a ``store: false``
    response continues there; on another socket it is ``previous_response_not_found``."""
    client = stack.client()
    with client.responses.connect() as connection:
        connection.response.create(
            model=MODEL, input="Say hello.", store=False, temperature=0, max_output_tokens=8
        )
        first = check_stream(until_terminal(connection))
        connection.response.create(
            model=MODEL,
            input="Again.",
            store=False,
            previous_response_id=first["id"],
            temperature=0,
            max_output_tokens=8,
        )
        second = check_stream(until_terminal(connection))
        assert second["previous_response_id"] == first["id"]
        # The continuation saw the first turn: its prompt is longer than the new input alone.
        alone = client.responses.input_tokens.count(model=MODEL, input="Again.").input_tokens
        assert second["usage"]["input_tokens"] > alone
    with client.responses.connect() as other:
        other.response.create(model=MODEL, input="Again.", store=False, previous_response_id=second["id"])
        error = until_terminal(other)[-1]
        assert error["type"] == "error" and error["error"]["code"] == "previous_response_not_found"


@pytest.fixture(scope="module")
def short_lived(gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path) -> Iterator[Stack]:
    """An API whose sockets live 3 s."""
    started = start_stack({**base_env, "RESQ_WEBSOCKET_MAX_S": "3"}, log_dir, 0, "ws-limit")
    try:
        yield started
    finally:
        started.group.stop_all()


def test_a_socket_past_its_limit_gets_the_limit_error_after_its_response_then_closes(
    short_lived: Stack,
) -> None:
    client = short_lived.client()
    started = time.monotonic()
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=8)
        check_stream(until_terminal(connection))
        limit = connection.recv()  # nothing else was asked: it comes at the limit
        assert limit.type == "error" and limit.error.code == "websocket_connection_limit_reached"
        assert time.monotonic() - started >= 2.5
        with pytest.raises(websockets.exceptions.ConnectionClosedOK):
            connection.recv()  # closed normally (1000) right after


def test_a_stream_id_is_echoed_on_every_event_of_its_response(stack: Stack) -> None:
    request = {"type": "response.create", "model": MODEL, "input": "Say hello.", "max_output_tokens": 8}
    with raw_socket(stack) as socket:
        socket.send(json.dumps({**request, "stream_id": "lane-1"}))
        events = []
        while not events or events[-1]["type"] not in TERMINAL:
            events.append(json.loads(socket.recv(timeout=60)))
    assert {event.get("stream_id") for event in events} == {"lane-1"}
    check_stream([{key: value for key, value in event.items() if key != "stream_id"} for event in events])


def test_a_response_deleted_mid_stream_ends_with_an_error_event_and_the_socket_serves_on(
    stack: Stack,
) -> None:
    """Over HTTP the stream of a deleted response ends; a socket has no end of stream, so its
    client is told (it waited forever for a terminal event)."""
    client = stack.client()
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=400)
        created = connection.recv()
        assert created.type == "response.created"
        assert client.responses.delete(created.response.id) is None
        error = until_terminal(connection)[-1]
        assert error["type"] == "error" and error["status"] == 404, error
        connection.response.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=8)
        assert check_stream(until_terminal(connection))["status"] in ("completed", "incomplete")


def test_a_stored_response_is_continued_from_the_store_as_over_http(stack: Stack) -> None:
    """The socket's memory is for unstored responses: a stored one deleted, or one that belongs to
    a conversation, is refused as HTTP refuses it (the memory had continued both)."""
    client = stack.client()
    conversation = client.conversations.create()
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Say hello.", temperature=0, max_output_tokens=8)
        stored = check_stream(until_terminal(connection))
        client.responses.delete(stored["id"])
        connection.response.create(model=MODEL, input="Again.", previous_response_id=stored["id"])
        error = until_terminal(connection)[-1]
        assert error["type"] == "error" and error["error"]["code"] == "previous_response_not_found"

        connection.response.create(
            model=MODEL, input="Say hello.", conversation=conversation.id, temperature=0, max_output_tokens=8
        )
        in_conversation = check_stream(until_terminal(connection))
        connection.response.create(model=MODEL, input="Again.", previous_response_id=in_conversation["id"])
        error = until_terminal(connection)[-1]
        assert error["type"] == "error" and error["error"]["param"] == "previous_response_id", error
    assert len(client.conversations.items.list(conversation.id).data) == 2  # the turn, and no more


def test_sealed_reasoning_sent_to_an_unstored_turn_stays_sealed_in_a_stored_continuation(
    stack: Stack, redis_client: redis.Redis
) -> None:
    """Codex's reasoning, sent back sealed to a ``store: false`` turn, is opened for that turn's
    prompt only: a stored turn continuing it on the socket keeps its history as sent (it stored
    the socket's opened copy, the reasoning's text readable at rest)."""
    client = stack.client()
    first = unstored_with_sealed_reasoning(client, MODEL)
    (reasoning,) = reasoning_items(first)
    assert reasoning.encrypted_content and reasoning.content
    echoed = {
        "type": "reasoning",
        "id": reasoning.id,
        "summary": [],
        "encrypted_content": reasoning.encrypted_content,
    }
    answer = [item.model_dump(exclude_none=True) for item in first.output if item.type == "message"]
    with client.responses.connect() as connection:
        connection.response.create(
            model=MODEL,
            input=[
                {"role": "user", "content": REASONING_PROMPT},
                echoed,
                *answer,
                {"role": "user", "content": "Thanks."},
            ],
            store=False,
            temperature=0,
            max_output_tokens=8,
        )
        unstored = check_stream(until_terminal(connection))
        connection.response.create(
            model=MODEL,
            input="Again.",
            previous_response_id=unstored["id"],
            temperature=0,
            max_output_tokens=8,
        )
        stored = check_stream(until_terminal(connection))
    assert stored["previous_response_id"] == unstored["id"]
    record = json.loads(redis_client.get(keys.input_items(stored["id"])) or b"{}")
    (kept,) = [item for item in record["conversation"] if item.get("id") == reasoning.id]
    assert kept["encrypted_content"] == reasoning.encrypted_content and not kept.get("content"), kept


def test_the_sdks_socket_fields_and_a_stream_id_json_cannot_carry(stack: Stack) -> None:
    request = {"type": "response.create", "model": MODEL, "input": "Hi", "max_output_tokens": 4}
    with raw_socket(stack) as socket:
        # A lone surrogate is valid JSON but no text: refused before anything is created (it
        # used to end the socket's handler, with the response created and never answered).
        socket.send(json.dumps({**request, "stream_id": "\ud800"}))
        error = json.loads(socket.recv(timeout=30))
        assert (error["type"], error["error"]["param"]) == ("error", "stream_id")
        # The SDK's `generate`, true by default, must be a boolean.
        socket.send(json.dumps({**request, "generate": "no"}))
        error = json.loads(socket.recv(timeout=30))
        assert (error["error"]["param"], error["error"]["code"]) == ("generate", "invalid_type")
        socket.send(json.dumps({**request, "generate": True}))
        events = [json.loads(socket.recv(timeout=60))]
        while events[-1]["type"] not in TERMINAL:
            events.append(json.loads(socket.recv(timeout=60)))
        check_stream(events)


def test_a_response_prepared_without_output_is_continued_by_the_next_turn(stack: Stack) -> None:
    """``generate: false`` (Codex's prewarm over its socket): the response ends ``completed`` with
    no output, its prompt computed (a prefill-only job), and its input is the history the next turn
    continues, whose prompt finds those pages cached."""
    client = stack.client()
    instructions = "You are a terse assistant. " * 20
    with client.responses.connect() as connection:
        connection.response.create(
            model=MODEL, instructions=instructions, input="My name is Ada.", generate=False
        )
        prepared = check_stream(until_terminal(connection))
        assert (prepared["status"], prepared["output"]) == ("completed", [])
        assert prepared["usage"]["output_tokens"] == 0 and prepared["usage"]["input_tokens"] > 0
        connection.response.create(
            model=MODEL,
            instructions=instructions,
            input="What is my name?",
            previous_response_id=prepared["id"],
            temperature=0,
            max_output_tokens=8,
        )
        answered = check_stream(until_terminal(connection))
    alone = client.responses.input_tokens.count(
        model=MODEL, instructions=instructions, input="What is my name?"
    ).input_tokens
    assert answered["usage"]["input_tokens"] > alone  # the prepared turn is in its prompt
    assert answered["usage"]["input_tokens_details"]["cached_tokens"] >= 64  # and was computed
    with client.responses.connect() as connection:  # a session's start: its instructions alone
        connection.response.create(model=MODEL, instructions=instructions, input=[], generate=False)
        alone = check_stream(until_terminal(connection))
        assert (alone["status"], alone["output"], alone["usage"]["output_tokens"]) == ("completed", [], 0)
    stored = client.responses.retrieve(prepared["id"])
    assert stored.status == "completed" and stored.output == []
    assert [item.type for item in client.responses.input_items.list(prepared["id"]).data] == ["message"]
    # In a conversation, its input joins the conversation as a generated turn's would.
    conversation = client.conversations.create()
    with client.responses.connect() as connection:
        connection.response.create(
            model=MODEL, input="My name is Ada.", conversation=conversation.id, generate=False
        )
        assert check_stream(until_terminal(connection))["status"] == "completed"
    items = client.conversations.items.list(conversation.id).data
    assert [(item.type, item.content[0].text) for item in items] == [("message", "My name is Ada.")]  # type: ignore[union-attr]
