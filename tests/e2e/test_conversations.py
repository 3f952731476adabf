"""The Conversations API end to end: conversations and their items created, read, paged, changed and
deleted with the official SDK in strict mode (every answer parsed into the SDK's own models), the
400s and 404s, and a conversation served by another API process than the one that created it.

Where a test needs the wire (query values the SDK would not send, the error envelope) it uses httpx.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import redis
from openai import BadRequestError, NotFoundError, OpenAI
from openai.types.conversations import Conversation, ConversationDeletedResource, ConversationItemList

from tests.e2e.conftest import MODEL, Stack, start_stack
from tests.support.processes import RoleProcess

pytestmark = pytest.mark.e2e

UNKNOWN_ID = "conv_" + "0123456789abcdef" * 2
STORE_TTL_S = 30 * 86400
"""The default ``RESQ_STORE_TTL_S``: what every key of a conversation gets on each access."""


@pytest.fixture(scope="session")
def other_api(
    stack: Stack, gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path
) -> Iterator[Stack]:
    """Another API process on the same Redis, which created none of the conversations it is asked about."""
    other = start_stack(base_env, log_dir, 0, f"conversations-for-pp{stack.postprocess_workers}")
    try:
        yield other
    finally:
        other.group.stop_all()


def error_of(reply: httpx.Response) -> dict[str, Any]:
    """The OpenAI error envelope's inner object, checked to have exactly the four keys."""
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def user(text: str, **fields: Any) -> Any:
    """A user message in the easy form (typed Any: the SDK's item union is a TypedDict union)."""
    return {"role": "user", "content": text, **fields}


def id_of(item: Any) -> str:
    """The id of a ``ConversationItem`` (some members of the union type it as optional)."""
    assert isinstance(item.id, str)
    return item.id


def param_of(error: BadRequestError | NotFoundError) -> Any:
    assert isinstance(error.body, dict)
    return error.body["param"]


def test_a_conversation_is_created_retrieved_updated_and_deleted(
    client: OpenAI, redis_client: redis.Redis
) -> None:
    before = int(time.time())
    created = client.conversations.create(
        items=[user("Hello!"), {"type": "message", "role": "assistant", "content": "Hi, how can I help?"}],
        metadata={"topic": "greetings", "user": "ada"},
    )
    assert isinstance(created, Conversation)
    assert created.id.startswith("conv_") and len(created.id) == len("conv_") + 32
    assert created.object == "conversation"
    assert before - 1 <= created.created_at <= int(time.time()) + 1
    assert created.metadata == {"topic": "greetings", "user": "ada"}
    for suffix in ("conversation", "items", "item_data"):
        assert STORE_TTL_S - 60 < redis_client.ttl(f"resq:{{{created.id}}}:{suffix}") <= STORE_TTL_S

    assert client.conversations.retrieve(created.id) == created
    items = client.conversations.items.list(created.id, order="asc")
    roles = [(item.type, item.model_dump()["role"]) for item in items.data]
    assert roles == [("message", "user"), ("message", "assistant")]

    updated = client.conversations.update(created.id, metadata={"topic": "farewells"})
    assert updated.metadata == {"topic": "farewells"}
    assert (updated.id, updated.created_at) == (created.id, created.created_at)
    assert client.conversations.retrieve(created.id).metadata == {"topic": "farewells"}
    assert client.conversations.update(created.id, metadata=None).metadata == {}

    deleted = client.conversations.delete(created.id)
    assert isinstance(deleted, ConversationDeletedResource)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "conversation.deleted", True)
    assert not any(
        redis_client.exists(key) for key in redis_client.scan_iter(match=f"resq:{{{created.id}}}:*")
    )
    for call in (
        lambda: client.conversations.retrieve(created.id),
        lambda: client.conversations.update(created.id, metadata={}),
        lambda: client.conversations.delete(created.id),
        lambda: client.conversations.items.list(created.id),
        lambda: client.conversations.items.create(created.id, items=[user("x")]),
        lambda: client.conversations.items.retrieve(id_of(items.data[0]), conversation_id=created.id),
        lambda: client.conversations.items.delete(id_of(items.data[0]), conversation_id=created.id),
    ):
        with pytest.raises(NotFoundError) as caught:
            call()
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["message"] == f"Conversation with id '{created.id}' not found."
        assert caught.value.body["type"] == "invalid_request_error"


def test_an_empty_conversation(client: OpenAI) -> None:
    created = client.conversations.create()
    assert created.metadata == {}
    page = client.conversations.items.list(created.id)
    assert page.data == [] and page.has_more is False
    assert list(client.conversations.items.list(created.id, limit=1)) == []


def test_items_are_added_listed_retrieved_and_deleted(stack: Stack, client: OpenAI) -> None:
    conversation = client.conversations.create(items=[user("What is the weather in Paris?", id="msg_first")])
    sent: list[Any] = [
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": '{"celsius": 21}'},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Looked it up."}]},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "shell", "input": "ls"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "README.md"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "21 °C."}]},
    ]
    added = client.conversations.items.create(
        conversation.id,
        items=sent,
        include=["reasoning.encrypted_content"],
    )
    assert isinstance(added, ConversationItemList)
    kinds = [
        "function_call",
        "function_call_output",
        "reasoning",
        "custom_tool_call",
        "custom_tool_call_output",
    ]
    assert [item.type for item in added.data] == [*kinds, "message"]
    prefixes = ["fc_", "fco_", "rs_", "ctc_", "ctco_", "msg_"]
    assert all(id_of(item).startswith(prefix) for item, prefix in zip(added.data, prefixes, strict=True))
    assert added.first_id == id_of(added.data[0]) and added.last_id == id_of(added.data[-1])
    assert added.has_more is False and added.object == "list"
    reasoning = added.data[2].model_dump()
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Looked it up."}]  # stored as sent
    # (A sealed blob is opened when added: one this server did not issue is a 400, below.)

    every = client.conversations.items.list(
        conversation.id, order="asc", include=["message.output_text.logprobs"]
    )
    assert [id_of(item) for item in every.data] == ["msg_first", *(id_of(item) for item in added.data)]
    newest_first = client.conversations.items.list(conversation.id)  # default: desc, 20
    assert [id_of(item) for item in newest_first.data] == [id_of(item) for item in every.data][::-1]
    first = every.data[0]
    assert first.model_dump(exclude_none=True) == {
        "id": "msg_first",
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "What is the weather in Paris?"}],
        "status": "completed",
    }
    for item in every.data:
        retrieved = client.conversations.items.retrieve(
            id_of(item),
            conversation_id=conversation.id,
            include=["reasoning.encrypted_content"],
        )
        assert retrieved == item

    after_delete = client.conversations.items.delete(id_of(added.data[1]), conversation_id=conversation.id)
    assert isinstance(after_delete, Conversation) and after_delete == conversation
    with pytest.raises(NotFoundError) as gone:
        client.conversations.items.retrieve(id_of(added.data[1]), conversation_id=conversation.id)
    assert param_of(gone.value) == "item_id"
    with pytest.raises(NotFoundError):
        client.conversations.items.delete(id_of(added.data[1]), conversation_id=conversation.id)
    remaining = [id_of(item) for item in client.conversations.items.list(conversation.id, order="asc")]
    assert remaining == [id_of(item) for item in every.data if id_of(item) != id_of(added.data[1])]

    # An id the conversation holds keeps its place and takes the new item.
    client.conversations.items.create(conversation.id, items=[user("Rather Lyon.", id="msg_first")])
    replaced = client.conversations.items.list(conversation.id, order="asc", limit=1).data[0]
    assert id_of(replaced) == "msg_first" and replaced.model_dump()["content"][0]["text"] == "Rather Lyon."


def test_an_item_id_with_a_slash_is_addressable_and_dot_ids_are_refused(stack: Stack, client: OpenAI) -> None:
    """An id is the client's: one with a ``/`` travels encoded in the item's path and names it
    there (it was added, then no route could reach it); ``.`` and ``..`` never reach a route
    (clients resolve them away), so they are refused when added."""
    conversation = client.conversations.create(items=[{"role": "user", "content": "a", "id": "msg/1"}])
    assert client.conversations.items.retrieve("msg/1", conversation_id=conversation.id).id == "msg/1"
    client.conversations.items.delete("msg/1", conversation_id=conversation.id)
    assert client.conversations.items.list(conversation.id).data == []
    for dots in (".", ".."):
        answer = httpx.post(
            f"{stack.base_url}/v1/conversations/{conversation.id}/items",
            json={"items": [{"role": "user", "content": "b", "id": dots}]},
            headers={"Authorization": "Bearer sk-test"},
        )
        assert answer.status_code == 400, answer.text


@pytest.mark.parametrize("item_id", ["..", "a b", "x" * 300, "\x85x"])
def test_a_response_input_id_the_item_routes_could_not_address_is_refused_in_a_conversation(
    client: OpenAI, item_id: str
) -> None:
    """A response's input joins its conversation: an id refused when added directly was stored
    that way, then no item route could read or delete it (and ``..`` made a client's item delete
    a delete of the conversation)."""
    conversation = client.conversations.create()
    with pytest.raises(BadRequestError) as caught:
        client.responses.create(
            model=MODEL,
            conversation=conversation.id,
            input=[{"role": "user", "content": "Say hello.", "id": item_id}],  # type: ignore[list-item]
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "input[0].id"
    assert client.conversations.items.list(conversation.id).data == []


def test_a_sealed_item_that_does_not_open_is_refused_when_added(client: OpenAI) -> None:
    """Added, a blob another server or key sealed made every later response of the conversation a
    400 naming an input item the request did not have."""
    compacted = client.responses.compact(model=MODEL, input="We talked about cats.").output[-1]
    conversation = client.conversations.create()
    client.conversations.items.create(  # the caller's own: taken
        conversation.id,
        items=[compacted.model_dump(mode="json", exclude_none=True)],  # type: ignore[list-item]
    )
    forged = {"type": "reasoning", "summary": [], "encrypted_content": "rq1_" + "A" * 60}
    for adding in (
        lambda: client.conversations.items.create(conversation.id, items=[forged]),  # type: ignore[list-item]
        lambda: client.conversations.create(items=[forged]),  # type: ignore[list-item]
    ):
        with pytest.raises(BadRequestError) as caught:
            adding()
        assert (caught.value.code, caught.value.param) == (
            "invalid_encrypted_content",
            "items[0].encrypted_content",
        )
    answer = client.responses.create(
        model=MODEL, conversation=conversation.id, input="Say hello.", max_output_tokens=4
    )
    assert answer.status in ("completed", "incomplete")


def test_auto_paging_walks_45_items_in_both_orders(stack: Stack, client: OpenAI) -> None:
    texts = [f"item {index}" for index in range(45)]
    conversation = client.conversations.create(items=[user(text) for text in texts[:20]])
    client.conversations.items.create(conversation.id, items=[user(text) for text in texts[20:40]])
    client.conversations.items.create(conversation.id, items=[user(text) for text in texts[40:]])

    def text(item: Any) -> str:
        content: str = item.model_dump()["content"][0]["text"]
        return content

    orders: list[tuple[Literal["asc", "desc"], list[str]]] = [("asc", texts), ("desc", texts[::-1])]
    for order, expected in orders:
        first_page = client.conversations.items.list(conversation.id, limit=10, order=order)
        pages = list(first_page.iter_pages())
        assert [len(page.data) for page in pages] == [10, 10, 10, 10, 5]
        assert [page.has_more for page in pages] == [True, True, True, True, False]
        assert [text(item) for item in first_page] == expected  # auto-paging to the end
        # `after` by hand: the items after the 10th, in the same order.
        after = id_of(pages[0].data[-1])
        following = client.conversations.items.list(conversation.id, limit=7, order=order, after=after)
        assert [text(item) for item in following.data] == expected[10:17]
        assert following.has_more is True
    last = client.conversations.items.list(conversation.id, order="asc", limit=100)
    assert len(last.data) == 45 and last.has_more is False
    everything_after_last = client.conversations.items.list(
        conversation.id, order="asc", after=id_of(last.data[-1])
    )
    assert everything_after_last.data == [] and everything_after_last.has_more is False


def test_bad_requests_are_400_naming_the_parameter(stack: Stack, client: OpenAI) -> None:
    too_many = [user(f"m{index}") for index in range(21)]
    with pytest.raises(BadRequestError) as caught:
        client.conversations.create(items=too_many)
    assert param_of(caught.value) == "items"
    conversation = client.conversations.create(items=[user("Hi", id="msg_hi")])
    for items in (too_many, []):
        with pytest.raises(BadRequestError) as caught:
            client.conversations.items.create(conversation.id, items=items)
        assert param_of(caught.value) == "items"
    with pytest.raises(BadRequestError) as reference:
        client.conversations.items.create(conversation.id, items=[{"type": "item_reference", "id": "msg_hi"}])
    assert param_of(reference.value) == "items[0]" and "item_reference" in str(reference.value)
    with pytest.raises(BadRequestError) as metadata:
        client.conversations.create(metadata={str(index): "v" for index in range(17)})
    assert param_of(metadata.value) == "metadata"
    with pytest.raises(BadRequestError) as role:
        client.conversations.create(items=[user("beep", role="robot")])
    assert param_of(role.value) == "items[0].role"
    with pytest.raises(BadRequestError) as spaced:
        client.conversations.items.create(conversation.id, items=[user("x", id="with space")])
    assert param_of(spaced.value) == "items[0].id"

    for malformed in ("abc", "conv_123", "conv_" + "g" * 32, "resp_" + "0" * 32):
        with pytest.raises(BadRequestError) as caught:
            client.conversations.retrieve(malformed)
        assert param_of(caught.value) == "conversation_id"
        with pytest.raises(BadRequestError):
            client.conversations.items.list(malformed)
    for bad_item in ("with space", "tab\tinside", "x" * 257):
        with pytest.raises(BadRequestError) as caught:
            client.conversations.items.retrieve(bad_item, conversation_id=conversation.id)
        assert param_of(caught.value) == "item_id"

    base = f"{stack.base_url}/v1/conversations/{conversation.id}/items"
    refused: list[tuple[dict[str, Any], str]] = [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "msg_unknown"}, "after"),
        ({"include[]": "reasoning.everything"}, "include"),
        ({"include": "nope"}, "include"),
    ]
    for bad, param in refused:
        reply = httpx.get(base, params=bad, timeout=30)
        assert reply.status_code == 400, (bad, reply.text)
        assert error_of(reply)["param"] == param
        assert error_of(reply)["type"] == "invalid_request_error"
    with pytest.raises(BadRequestError):
        client.conversations.items.list(conversation.id, limit=0)

    # Unknown ids of the right shape are 404s.
    for call in (
        lambda: client.conversations.retrieve(UNKNOWN_ID),
        lambda: client.conversations.items.list(UNKNOWN_ID),
        lambda: client.conversations.items.retrieve("msg_hi", conversation_id=UNKNOWN_ID),
    ):
        with pytest.raises(NotFoundError) as missing:
            call()
        assert param_of(missing.value) == "conversation_id"
    with pytest.raises(NotFoundError) as item:
        client.conversations.items.retrieve("msg_nope", conversation_id=conversation.id)
    assert (
        isinstance(item.value.body, dict)
        and item.value.body["message"] == "Item with id 'msg_nope' not found."
    )
    # None of it harmed the conversation.
    assert [id_of(entry) for entry in client.conversations.items.list(conversation.id)] == ["msg_hi"]


def test_a_conversation_is_served_by_any_api_process(client: OpenAI, other_api: Stack) -> None:
    other = other_api.client()
    conversation = client.conversations.create(items=[user("One")], metadata={"made": "here"})
    assert other.conversations.retrieve(conversation.id) == conversation
    listed = other.conversations.items.list(conversation.id)
    assert [item.model_dump()["content"][0]["text"] for item in listed.data] == ["One"]
    other.conversations.items.create(conversation.id, items=[user("Two")])
    other.conversations.update(conversation.id, metadata={"made": "there"})
    texts = [
        item.model_dump()["content"][0]["text"]
        for item in client.conversations.items.list(conversation.id, order="asc")
    ]
    assert texts == ["One", "Two"]
    assert client.conversations.retrieve(conversation.id).metadata == {"made": "there"}
    # A response created on the other process joins the conversation; this one lists it.
    answered = other.responses.create(
        model=MODEL, conversation=conversation.id, input="Say hello.", temperature=0, max_output_tokens=16
    )
    listed_here = [id_of(item) for item in client.conversations.items.list(conversation.id, order="asc")]
    assert listed_here[3:] == [item.id for item in answered.output]
    other.conversations.delete(conversation.id)
    with pytest.raises(NotFoundError):
        client.conversations.retrieve(conversation.id)
