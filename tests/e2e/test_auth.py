"""API keys end to end: 401 without a valid key on every ``/v1`` endpoint, responses and conversations
isolated between keys (404 / ``previous_response_not_found`` for another key's), the per-key rate limit,
and no key in Redis or in the logs; the official SDK in strict mode.

One API process with the keys (in a key file) serves the whole module. It runs in the inline
post-processing mode only: auth lives in the API process, before anything reaches a worker, and
ownership is written by the API at submission (workers never touch the ``owner`` field, see
tests/unit/test_auth.py), so the parametrised two-mode ``stack`` would only double the runtime.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import websockets.exceptions
import websockets.sync.client
from openai import OpenAI

from api.auth import fingerprint
from tests.e2e.conftest import MODEL, Stack, start_stack
from tests.e2e.test_websocket import until_terminal
from tests.fixture_model import scenario
from tests.support.invariants import as_dict
from tests.support.processes import RoleProcess

pytestmark = pytest.mark.e2e

KEY_A = "sk-resq-test-alice-0123456789abcdef"
KEY_B = "sk-resq-test-bob-fedcba9876543210"
KEY_C = "sk-resq-test-carol-rate-limited-00"
"""Only the rate-limit test uses key C, so the other tests never meet the limit."""

RATE_LIMIT_RPM = 120
"""Per key: a burst of 120 requests, then 2 a second (a wait of 1 s when out)."""

WAIT_S = 240.0
MISSING_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


@pytest.fixture(scope="module")
def auth_stack(
    gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """An API that knows keys A, B and C (from a key file) and limits each to 120 requests a minute."""
    key_file = tmp_path_factory.mktemp("auth") / "api-keys"
    key_file.write_text(f"# resq test keys\n{KEY_A}\n\n{KEY_B}\n{KEY_C}\n")
    env = {**base_env, "RESQ_API_KEYS": f"@{key_file}", "RESQ_RATE_LIMIT_RPM": str(RATE_LIMIT_RPM)}
    started = start_stack(env, log_dir, 0, "auth")
    try:
        yield started
    finally:
        started.group.stop_all()


def sdk(stack: Stack, api_key: str) -> OpenAI:
    """The strict SDK client with ``api_key``."""
    return OpenAI(
        base_url=f"{stack.base_url}/v1",
        api_key=api_key,
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    )


def error_of(reply: httpx.Response) -> dict[str, Any]:
    """The OpenAI error envelope's inner object, checked to have exactly the four keys."""
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def finished_background(client: OpenAI) -> str:
    """A stored background response of ``client``'s key, once it completed."""
    created = client.responses.create(model=MODEL, input="Say hello.", temperature=0, background=True)
    deadline = time.monotonic() + WAIT_S
    while client.responses.retrieve(created.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response did not finish"
        time.sleep(0.1)
    return created.id


def every_v1_call(client: OpenAI, response_id: str, conversation_id: str) -> list[tuple[str, Any]]:
    """One SDK call of each ``/v1`` endpoint, as ``(name, thunk)``."""
    return [
        ("models.list", lambda: client.models.list()),
        ("responses.create", lambda: client.responses.create(model=MODEL, input="Say hello.")),
        (
            "responses.create stream",
            lambda: client.responses.create(model=MODEL, input="Say hello.", stream=True),
        ),
        ("responses.retrieve", lambda: client.responses.retrieve(response_id)),
        ("responses.retrieve stream", lambda: client.responses.retrieve(response_id, stream=True)),
        ("responses.cancel", lambda: client.responses.cancel(response_id)),
        ("responses.delete", lambda: client.responses.delete(response_id)),
        ("responses.input_items.list", lambda: client.responses.input_items.list(response_id)),
        (
            "responses.input_tokens.count",
            lambda: client.responses.input_tokens.count(model=MODEL, input="Hi"),
        ),
        ("responses.compact", lambda: client.responses.compact(model=MODEL, input="Hi")),
        *every_conversation_call(client, conversation_id),
    ]


def every_conversation_call(
    client: OpenAI, conversation_id: str, item_id: str = "msg_1"
) -> list[tuple[str, Any]]:
    """One SDK call of each ``/v1/conversations`` endpoint on ``conversation_id``, as ``(name, thunk)``."""
    conversations = client.conversations
    return [
        ("conversations.create", lambda: conversations.create(items=[{"role": "user", "content": "Hi"}])),
        ("conversations.retrieve", lambda: conversations.retrieve(conversation_id)),
        ("conversations.update", lambda: conversations.update(conversation_id, metadata={"k": "v"})),
        ("conversations.delete", lambda: conversations.delete(conversation_id)),
        ("conversations.items.list", lambda: conversations.items.list(conversation_id)),
        (
            "conversations.items.create",
            lambda: conversations.items.create(conversation_id, items=[{"role": "user", "content": "Hi"}]),
        ),
        (
            "conversations.items.retrieve",
            lambda: conversations.items.retrieve(item_id, conversation_id=conversation_id),
        ),
        (
            "conversations.items.delete",
            lambda: conversations.items.delete(item_id, conversation_id=conversation_id),
        ),
    ]


def test_every_v1_endpoint_needs_a_valid_key(auth_stack: Stack, redis_client: redis.Redis) -> None:
    owned = finished_background(sdk(auth_stack, KEY_A))
    first_item: Any = {"role": "user", "content": "Hi", "id": "msg_1"}
    conversation = sdk(auth_stack, KEY_A).conversations.create(items=[first_item]).id
    for name, call in every_v1_call(sdk(auth_stack, "sk-not-a-key"), owned, conversation):
        with pytest.raises(openai.AuthenticationError) as caught:
            call()
        assert caught.value.status_code == 401, name
        assert caught.value.code == "invalid_api_key", name
        assert caught.value.body == {
            "message": "Incorrect API key provided.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }, name

    base = auth_stack.base_url
    requests = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/responses", {"model": MODEL, "input": "Say hello."}),
        ("GET", f"/v1/responses/{owned}", None),
        ("GET", f"/v1/responses/{owned}?stream=true", None),
        ("POST", f"/v1/responses/{owned}/cancel", None),
        ("DELETE", f"/v1/responses/{owned}", None),
        ("GET", f"/v1/responses/{owned}/input_items", None),
        ("POST", "/v1/conversations", {"items": [{"role": "user", "content": "Hi"}]}),
        ("GET", f"/v1/conversations/{conversation}", None),
        ("POST", f"/v1/conversations/{conversation}", {"metadata": {"k": "v"}}),
        ("DELETE", f"/v1/conversations/{conversation}", None),
        ("GET", f"/v1/conversations/{conversation}/items", None),
        ("POST", f"/v1/conversations/{conversation}/items", {"items": [{"role": "user", "content": "Hi"}]}),
        ("GET", f"/v1/conversations/{conversation}/items/msg_1", None),
        ("DELETE", f"/v1/conversations/{conversation}/items/msg_1", None),
        ("GET", "/v1/conversations/not-an-id", None),
        # The gate answers before routing and parsing: nothing else about the request shows.
        ("GET", "/v1/no-such-endpoint", None),
        ("GET", "/v1/responses/not-an-id", None),
    ]
    for method, path, body in requests:
        for headers in ({}, {"Authorization": f"Basic {KEY_A}"}, {"Authorization": "Bearer"}):
            reply = httpx.request(method, f"{base}{path}", json=body, headers=headers, timeout=30)
            assert reply.status_code == 401, (method, path, headers, reply.text)
            assert error_of(reply) == {
                "message": MISSING_MESSAGE,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
            assert reply.headers["www-authenticate"] == "Bearer"
    malformed = httpx.post(
        f"{base}/v1/responses", content=b"{not json", headers={"Authorization": "Bearer nope"}, timeout=30
    )
    assert malformed.status_code == 401 and error_of(malformed)["code"] == "invalid_api_key"

    # Health checks and scrapes stay open.
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    assert httpx.get(f"{base}/metrics", timeout=30).status_code == 200
    # None of the refused calls touched the response.
    assert sdk(auth_stack, KEY_A).responses.retrieve(owned).status == "completed"
    assert redis_client.hget(f"resq:{{{owned}}}:response", "owner") == fingerprint(KEY_A).encode()
    alice = sdk(auth_stack, KEY_A)
    assert [item.id for item in alice.conversations.items.list(conversation)] == ["msg_1"]
    assert alice.conversations.retrieve(conversation).metadata == {}
    assert redis_client.hget(f"resq:{{{conversation}}}:conversation", "owner") == fingerprint(KEY_A).encode()


def test_another_key_cannot_reach_a_response(auth_stack: Stack, redis_client: redis.Redis) -> None:
    alice, bob = sdk(auth_stack, KEY_A), sdk(auth_stack, KEY_B)
    owned = finished_background(alice)
    not_found = f"Response with id '{owned}' not found."

    for call in (
        lambda: bob.responses.retrieve(owned),
        lambda: bob.responses.retrieve(owned, stream=True),
        lambda: bob.responses.cancel(owned),
        lambda: bob.responses.delete(owned),
        lambda: bob.responses.input_items.list(owned),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert isinstance(caught.value.body, dict) and caught.value.body["message"] == not_found
    # The stream resume, on the wire: the same 404 as for an id that never existed.
    for path in (f"/v1/responses/{owned}?stream=true&starting_after=0", f"/v1/responses/{owned}"):
        reply = httpx.get(
            f"{auth_stack.base_url}{path}", headers={"Authorization": f"Bearer {KEY_B}"}, timeout=30
        )
        assert reply.status_code == 404 and error_of(reply)["message"] == not_found
    for continuing in (
        lambda: bob.responses.create(model=MODEL, input="Continue.", previous_response_id=owned),
        lambda: bob.responses.input_tokens.count(model=MODEL, input="Continue.", previous_response_id=owned),
        lambda: bob.responses.compact(model=MODEL, input="Continue.", previous_response_id=owned),
    ):
        with pytest.raises(openai.BadRequestError) as previous:
            continuing()
        assert isinstance(previous.value.body, dict)
        assert previous.value.body["code"] == "previous_response_not_found"
        assert previous.value.body["param"] == "previous_response_id"

    # Bob's responses are Bob's: he continues his own conversation.
    own = bob.responses.create(model=MODEL, input="Say hello.", temperature=0)
    follow_up = bob.responses.create(
        model=MODEL, input="Again.", previous_response_id=own.id, max_output_tokens=16
    )
    assert follow_up.previous_response_id == own.id

    # Alice still has everything, untouched by Bob's attempts.
    retrieved = alice.responses.retrieve(owned)
    assert retrieved.status == "completed" and retrieved.output_text == scenario("hello").completion
    with alice.responses.retrieve(owned, stream=True) as events:
        types = [event.type for event in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [item.type for item in alice.responses.input_items.list(owned).data] == ["message"]
    continued = alice.responses.create(
        model=MODEL, input="Again.", previous_response_id=owned, temperature=0, max_output_tokens=16
    )
    assert continued.previous_response_id == owned
    assert alice.responses.cancel(owned).status == "completed"  # ended before the cancel: kept as is

    # The record names its owner by fingerprint; the key itself is nowhere in Redis.
    record = redis_client.hgetall(f"resq:{{{owned}}}:response")
    assert record[b"owner"] == fingerprint(KEY_A).encode()
    assert not any(KEY_A.encode() in value for value in record.values())
    for key in redis_client.scan_iter(match=f"resq:{{{owned}}}:*"):
        if redis_client.type(key) == b"string":
            assert KEY_A.encode() not in (redis_client.get(key) or b"")

    alice.responses.delete(owned)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(owned)


def test_another_key_cannot_reach_a_conversation(auth_stack: Stack, redis_client: redis.Redis) -> None:
    alice, bob = sdk(auth_stack, KEY_A), sdk(auth_stack, KEY_B)
    first_item: Any = {"role": "user", "content": "My name is Ada.", "id": "msg_1"}
    owned = alice.conversations.create(items=[first_item], metadata={"who": "alice"})
    not_found = f"Conversation with id '{owned.id}' not found."

    # Every conversation route, and generating in it or counting it.
    calls = [
        (name, call, "conversation_id")
        for name, call in every_conversation_call(bob, owned.id)
        if name != "conversations.create"
    ]
    calls += [
        (
            "responses.create",
            lambda: bob.responses.create(model=MODEL, conversation=owned.id, input="Hi"),
            "conversation",
        ),
        (
            "responses.input_tokens.count",
            lambda: bob.responses.input_tokens.count(model=MODEL, conversation=owned.id, input="Hi"),
            "conversation",
        ),
    ]
    for name, call, param in calls:
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body == {
            "message": not_found,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }, name
    # On the wire, the same 404 as for an id that never existed, whatever the query.
    unknown = "conv_" + "0" * 32
    for conversation_id, message in (
        (owned.id, not_found),
        (unknown, f"Conversation with id '{unknown}' not found."),
    ):
        for path in ("", "/items?limit=1&order=asc", "/items?after=msg_1", "/items/msg_1"):
            reply = httpx.get(
                f"{auth_stack.base_url}/v1/conversations/{conversation_id}{path}",
                headers={"Authorization": f"Bearer {KEY_B}"},
                timeout=30,
            )
            assert reply.status_code == 404 and error_of(reply)["message"] == message, (path, reply.text)

    # Bob's conversations are Bob's, and Alice cannot reach them either.
    own = bob.conversations.create(items=[{"role": "user", "content": "I am Bob."}])
    assert [item.type for item in bob.conversations.items.list(own.id)] == ["message"]
    with pytest.raises(openai.NotFoundError):
        alice.conversations.items.list(own.id)
    with pytest.raises(openai.NotFoundError):
        alice.conversations.items.create(own.id, items=[{"role": "user", "content": "Hi Bob"}])
    assert len(bob.conversations.items.list(own.id).data) == 1

    # Alice's conversation is untouched by Bob's attempts: no item added or deleted, same metadata.
    assert alice.conversations.retrieve(owned.id) == owned
    items = alice.conversations.items.list(owned.id)
    assert [item.id for item in items] == ["msg_1"]
    assert alice.conversations.items.retrieve("msg_1", conversation_id=owned.id).model_dump(
        exclude_none=True
    )["content"] == [{"type": "input_text", "text": "My name is Ada."}]
    record = redis_client.hgetall(f"resq:{{{owned.id}}}:conversation")
    assert record[b"owner"] == fingerprint(KEY_A).encode()
    assert not any(KEY_A.encode() in value for value in record.values())
    alice.conversations.delete(owned.id)
    with pytest.raises(openai.NotFoundError):
        alice.conversations.retrieve(owned.id)


def test_items_and_sealed_reasoning_are_the_owners_alone(auth_stack: Stack) -> None:
    """item_reference and encrypted_content go through the same ownership check as every by-id route."""
    alice, bob = sdk(auth_stack, KEY_A), sdk(auth_stack, KEY_B)
    first = alice.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "My name is Ada.", "id": "msg_alice_1"}],
        temperature=0,
        include=["reasoning.encrypted_content"],
    )
    references = [{"type": "item_reference", "id": first.output[-1].id}]
    for reference in (references, [{"type": "item_reference", "id": "msg_alice_1"}]):
        with pytest.raises(openai.BadRequestError) as caught:
            bob.responses.create(model=MODEL, input=[*reference, {"role": "user", "content": "Hi"}])
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input[0].id"
    own = alice.responses.create(
        model=MODEL,
        temperature=0,
        input=[
            {"type": "item_reference", "id": "msg_alice_1"},
            *references,
            {"role": "user", "content": "What is my name?"},
        ],
    )
    assert own.output_text == scenario("multi_turn").completion

    thought = alice.responses.create(
        model=MODEL, input="What is 2+2? Think first.", temperature=0, include=["reasoning.encrypted_content"]
    )
    blob = next(item for item in thought.output if item.type == "reasoning").encrypted_content
    echoed = [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "summary": [], "encrypted_content": blob},
    ]
    with pytest.raises(openai.BadRequestError) as sealed:
        bob.responses.create(model=MODEL, input=echoed)  # type: ignore[arg-type]
    assert isinstance(sealed.value.body, dict) and sealed.value.body["param"] == "input[1].encrypted_content"
    assert alice.responses.create(model=MODEL, input=echoed, max_output_tokens=4).status  # type: ignore[arg-type]


def test_a_key_cannot_learn_from_the_prompt_cache_what_another_key_sent(auth_stack: Stack) -> None:
    """The engine shares prompt blocks within one key: another key's same prompt is computed anew,
    and its ``cached_tokens`` say 0 (they once said how much of the other key's prompt it had
    guessed, a page at a time).

    The key's own turns hit right before and right after the other key's request, so its blocks
    were there when the other key's 0 was measured. The session's GPU worker evicts its oldest
    cached blocks when its cache runs low (gpu_worker.prefix_cache), which can take this prompt's
    between two of these requests: an attempt that sees the key's own blocks gone tries again with a
    new prompt.
    """

    def cached(api_key: str, secret: str) -> int:
        response = sdk(auth_stack, api_key).responses.create(
            model=MODEL, instructions=secret, input="Say hello.", max_output_tokens=4
        )
        assert response.usage is not None
        return response.usage.input_tokens_details.cached_tokens

    for _ in range(3):
        nonce = secrets.token_hex(4)
        secret = f"Notes {nonce}: " + " ".join(f"entry{index} is {index * 7}" for index in range(60))
        assert cached(KEY_A, secret) == 0
        if cached(KEY_A, secret) == 0:
            continue  # evicted already: the key's own next turn could not hit
        other_key = cached(KEY_B, secret)
        if cached(KEY_A, secret) > 0:  # still cached after the other key's request
            assert other_key == 0
            return
    pytest.fail("the engine's cache was evicted during every attempt: no key's next turn hit")


def test_a_key_at_its_share_of_pending_generations_gets_429_while_others_are_admitted(
    gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path, tmp_path: Path
) -> None:
    """``RESQ_MAX_PENDING_PER_KEY=2``: one key's long generations once took every slot, and the
    other keys got 429s or waited behind them in the queue."""
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{KEY_A}\n{KEY_B}\n")
    env = {**base_env, "RESQ_API_KEYS": f"@{key_file}", "RESQ_MAX_PENDING_PER_KEY": "2"}
    stack = start_stack(env, log_dir, 0, "per-key")
    try:
        alice, bob = sdk(stack, KEY_A), sdk(stack, KEY_B)
        endless = {"model": MODEL, "input": "Repeat forever.", "temperature": 0, "max_output_tokens": 960}
        running = [alice.responses.create(background=True, **endless).id for _ in range(2)]  # type: ignore[call-overload]
        with pytest.raises(openai.RateLimitError) as caught:
            alice.responses.create(model=MODEL, input="Say hello.", temperature=0)
        assert (
            isinstance(caught.value.body, dict)
            and "This API key has 2 generations" in caught.value.body["message"]
        )
        assert caught.value.response.headers["retry-after"] == "1"
        # The other key is admitted at once.
        assert bob.responses.create(model=MODEL, input="Say hello.", temperature=0).output_text == (
            scenario("hello").completion
        )
        for response_id in running:
            alice.responses.cancel(response_id)
        # Once one of hers ends, she is admitted again.
        answer = alice.responses.create(model=MODEL, input="Say hello.", temperature=0)
        assert answer.output_text == scenario("hello").completion
    finally:
        stack.group.stop_all()


def test_a_key_over_its_rate_limit_gets_429_then_recovers(auth_stack: Stack) -> None:
    carol = sdk(auth_stack, KEY_C)
    limited: openai.RateLimitError | None = None
    # The bucket holds RATE_LIMIT_RPM tokens and refills 2 a second: a fast loop empties it.
    for _ in range(RATE_LIMIT_RPM * 3):
        try:
            carol.models.list()
        except openai.RateLimitError as exc:
            limited = exc
            break
    assert limited is not None, "the rate limit never answered 429"
    assert limited.status_code == 429
    assert isinstance(limited.body, dict)
    assert limited.body["code"] == "rate_limit_exceeded" and limited.body["type"] == "requests"
    assert limited.body["param"] is None and "RPM" in limited.body["message"]
    retry_after = limited.response.headers["retry-after"]
    assert retry_after.isdigit() and 1 <= int(retry_after) <= 2

    # Other keys have their own buckets.
    assert sdk(auth_stack, KEY_A).models.list().data[0].id == MODEL
    time.sleep(int(retry_after))
    assert carol.models.list().data[0].id == MODEL
    # Every /v1 request takes a token, whatever its answer: these 404 until the bucket is empty.
    answers: list[int] = []
    while not answers or answers[-1] == 404:
        assert len(answers) < RATE_LIMIT_RPM * 3, "the rate limit never answered 429"
        try:
            carol.responses.retrieve("resp_" + "0" * 32)
        except openai.APIStatusError as exc:
            answers.append(exc.status_code)
    assert answers[-1] == 429 and len(answers) > 1
    # Unauthenticated requests never reach (nor drain) a bucket.
    reply = httpx.get(f"{auth_stack.base_url}/v1/models", timeout=30)
    assert reply.status_code == 401

    assert "refused (429): rate_limit_exceeded" in auth_stack.api.log_path.read_text(errors="replace")


def test_no_key_reaches_the_logs(auth_stack: Stack) -> None:
    for api_key in (KEY_A, KEY_B):
        assert sdk(auth_stack, api_key).models.list().data
    with pytest.raises(openai.AuthenticationError):
        sdk(auth_stack, "sk-not-a-key").models.list()
    # Also every request the module made before this test, when run whole.
    log = auth_stack.api.log_path.read_text(errors="replace")
    assert "refused (401): invalid_api_key" in log
    assert "API keys: 3 configured" in log and "RESQ_API_KEYS is empty" not in log
    for key in (KEY_A, KEY_B, KEY_C, "sk-not-a-key"):
        assert key not in log


def test_each_socket_message_is_counted_by_the_rate_limit(auth_stack: Stack) -> None:
    """A socket's messages are requests: over the limit one gets a 429 error event, and the socket
    serves on (10 creates on one socket passed a limit of 3 a minute; the handshake took one)."""
    carol = sdk(auth_stack, KEY_C)
    # The module's test before leaves Carol's bucket empty: on a fast machine this one began within
    # the second it takes to refill the handshake's and the first message's tokens (2 a second).
    time.sleep(2.0)
    with carol.responses.connect() as connection:
        connection.response.create(model=MODEL, input="Say hello.", max_output_tokens=4, store=False)
        first = until_terminal(connection)[-1]
        assert first["type"] in ("response.completed", "response.incomplete"), first
        while True:  # empty the bucket; the handshake of a drained key still opens a socket
            try:
                carol.models.list()
            except openai.RateLimitError:
                break
        again = {
            "model": MODEL,
            "input": "Again.",
            "max_output_tokens": 4,
            "store": False,
            "previous_response_id": first["response"]["id"],
        }
        connection.response.create(**again)
        error = as_dict(connection.recv())
        assert (error["type"], error["status"], error["error"]["code"]) == (
            "error",
            429,
            "rate_limit_exceeded",
        )
        time.sleep(1.5)  # refilled by 2 a second
        # The refused continuation evicted nothing: the unstored response continues on the socket.
        connection.response.create(**again)
        ended = until_terminal(connection)[-1]
        assert ended["type"] in ("response.completed", "response.incomplete"), ended


def test_a_websocket_handshake_needs_a_valid_key(auth_stack: Stack) -> None:
    url = auth_stack.base_url.replace("http://", "ws://") + "/v1/responses"
    for headers in ({}, {"Authorization": "Bearer sk-not-a-key"}):
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            websockets.sync.client.connect(url, additional_headers=headers)
        # The answer HTTP gives (it was a bare 403, as for a path that takes no socket).
        assert refused.value.response.status_code == 401
        body = json.loads(refused.value.response.body or b"{}")
        assert body["error"]["code"] == "invalid_api_key", body
    # With a valid key the socket serves the key's own responses, and no other key's.
    owned = finished_background(sdk(auth_stack, KEY_A))
    with sdk(auth_stack, KEY_B).responses.connect() as connection:
        connection.response.create(model=MODEL, input="Continue.", previous_response_id=owned)
        event = connection.recv()
        assert event.type == "error" and event.error.code == "previous_response_not_found"
