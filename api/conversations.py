"""Conversations as the routes (and response creation) see them: every access passes through here.

:class:`ConversationStore` checks an id's shape before any Redis key is built
(400 naming the parameter), then that the conversation exists and that the
caller owns it: a foreign conversation gets the same 404 as an unknown one, so
nobody learns whether a foreign id exists. Ownership is :func:`api.store.owns`,
the check stored responses use.

Reads are one script (:mod:`resq.conversations`) that returns the owner with the
data; the owner is checked here, after the read. Such a read of a foreign
conversation refreshes its TTL too: it harms nothing and tells the caller
nothing. Writes read the owner first and write only for its owner, in a second
script that answers ``missing`` if the conversation vanished meanwhile (an id is
never issued twice, so a conversation that exists again is the same one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from api.caller import Caller
from api.errors import OpenAIError, invalid_value
from api.input_items import PageRequest, normalise_item
from api.store import owns
from resq import conversations, ids, jsonutil, keys

Item = dict[str, Any]


def check_conversation_id(conversation_id: str, param: str = "conversation_id") -> str:
    """``conversation_id`` if it is shaped like an id resq issues; a 400 naming ``param`` otherwise."""
    if not ids.is_conversation_id(conversation_id):
        raise invalid_value(
            f"Invalid '{param}': {conversation_id!r}. Expected an ID that begins with 'conv_' "
            "followed by 32 hexadecimal digits.",
            param,
        )
    return conversation_id


def _shown(value: str) -> str:
    """``value`` quoted for an error message, cut short when long (an id may be any size)."""
    return repr(value) if len(value) <= 64 else f"{value[:64]!r} (cut short: {len(value)} characters)"


def check_item_id(item_id: str, param: str = "item_id") -> str:
    """``item_id`` if it may name a conversation item; a 400 naming ``param`` otherwise."""
    if not conversations.is_item_id(item_id):
        raise invalid_value(
            f"Invalid '{param}': {_shown(item_id)}. Expected an ID of 1 to "
            f"{conversations.MAX_ITEM_ID_CHARS} characters, without whitespace or control characters.",
            param,
        )
    return item_id


def conversation_not_found(conversation_id: str, param: str = "conversation_id") -> OpenAIError:
    """The 404 for an unknown (or foreign, or expired) conversation id."""
    return OpenAIError(404, f"Conversation with id '{conversation_id}' not found.", param=param, code=None)


def item_not_found(item_id: str) -> OpenAIError:
    """The 404 for an item id the conversation does not hold."""
    return OpenAIError(404, f"Item with id '{item_id}' not found.", param="item_id", code=None)


def prepare_items(items: list[Item], param: str = "items") -> list[Item]:
    """Posted items (as :data:`api.schemas.InputItem` dumps them) as a conversation stores them.

    Each is normalised to the SDK's ``ConversationItem`` shape (:func:`api.input_items.normalise_item`)
    and keeps its id, or gets a fresh one; reasoning keeps its ``encrypted_content`` as sent.
    ``item_reference`` items are refused, as are malformed ids and an id sent twice
    (400s naming ``param[i]``).
    """
    prepared: list[Item] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        kind = item.get("type") or "message"
        if kind == "item_reference":
            raise invalid_value(
                f"Invalid '{param}[{index}]': item_reference items cannot be added to a conversation; "
                "add the item itself.",
                f"{param}[{index}]",
            )
        sent_id = item.get("id")
        if sent_id:
            check_item_id(sent_id, f"{param}[{index}].id")
            if sent_id in seen:
                raise invalid_value(
                    f"Invalid '{param}[{index}].id': the id {sent_id!r} is sent twice.",
                    f"{param}[{index}].id",
                )
            seen.add(sent_id)
        prepared.append(normalise_item(item, conversations.new_item_id(kind)))
    return prepared


def item_list(data: list[Item], has_more: bool) -> dict[str, Any]:
    """OpenAI's list shape (``ConversationItemList``); ``first_id``/``last_id`` are "" for no items.

    The SDK types both as strings, never null; an empty string also stops its auto-paging.
    """
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else "",
        "last_id": data[-1]["id"] if data else "",
        "has_more": has_more,
    }


@dataclass(frozen=True)
class StoredConversation:
    """One conversation's header, as read at one moment."""

    conversation_id: str
    owner: str
    created_at: int
    metadata: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        """The ``Conversation`` object."""
        return {
            "id": self.conversation_id,
            "object": "conversation",
            "created_at": self.created_at,
            "metadata": self.metadata,
        }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _items(values: list[Any]) -> list[Item]:
    return [jsonutil.loads(value) for value in values]


class ConversationStore:
    """Creates, reads, changes and deletes conversations and their items in Redis."""

    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self._redis = redis
        self._ttl_s = ttl_s

    async def _eval(self, script: str, conversation_id: str, *args: str | int) -> Any:
        return await self._redis.eval(script, 4, *keys.conversation_keys(conversation_id), *args)

    async def create(self, caller: Caller, items: list[Item], metadata: dict[str, str]) -> StoredConversation:
        """A new conversation of ``caller`` holding ``items`` (prepared: :func:`prepare_items`)."""
        pairs = conversations.item_pairs(items)
        created_at = int(time.time())
        while True:
            conversation_id = ids.new_conversation_id()
            created = await self._eval(
                conversations.CREATE_LUA,
                conversation_id,
                self._ttl_s,
                caller.owner,
                created_at,
                jsonutil.dumps(metadata).decode(),
                *pairs,
            )
            if created == b"created":  # else 'exists': 128 random bits collided; draw again
                return StoredConversation(conversation_id, caller.owner, created_at, metadata)

    async def get(
        self, conversation_id: str, caller: Caller, param: str = "conversation_id"
    ) -> StoredConversation:
        """The conversation ``conversation_id``; 400 for a malformed id, 404 when the caller cannot see it."""
        check_conversation_id(conversation_id, param)
        header = await self._eval(conversations.HEADER_LUA, conversation_id, self._ttl_s)
        if header is None or not owns(_text(header[0]), caller):
            raise conversation_not_found(conversation_id, param)
        owner, created_at, metadata = header
        return StoredConversation(
            conversation_id, _text(owner), int(created_at), jsonutil.loads(metadata or b"{}")
        )

    async def update(
        self, conversation_id: str, caller: Caller, metadata: dict[str, str]
    ) -> StoredConversation:
        """Replace the conversation's metadata; the conversation as it is now."""
        stored = await self.get(conversation_id, caller)
        status = await self._eval(
            conversations.UPDATE_LUA, conversation_id, self._ttl_s, jsonutil.dumps(metadata).decode()
        )
        if status != b"updated":
            raise conversation_not_found(conversation_id)
        return StoredConversation(conversation_id, stored.owner, stored.created_at, metadata)

    async def delete(self, conversation_id: str, caller: Caller) -> None:
        """Remove every key of the conversation; 404 when the caller cannot see it (or it vanished)."""
        await self.get(conversation_id, caller)
        if await self._eval(conversations.DELETE_LUA, conversation_id) != b"deleted":
            raise conversation_not_found(conversation_id)

    async def add_items(self, conversation_id: str, caller: Caller, items: list[Item]) -> list[Item]:
        """Append ``items`` (prepared: :func:`prepare_items`) in order; the items as stored.

        An id the conversation holds already keeps its place and gets the new item.
        """
        await self.get(conversation_id, caller)
        status = await self._eval(
            conversations.APPEND_LUA,
            conversation_id,
            *conversations.append_arguments(self._ttl_s, "", items),
        )
        if status != b"appended":
            raise conversation_not_found(conversation_id)
        return items

    async def list_items(self, conversation_id: str, caller: Caller, page: PageRequest) -> dict[str, Any]:
        """One page of the conversation's items (OpenAI's list shape); 400 naming ``after`` when unknown."""
        check_conversation_id(conversation_id)
        reply = await self._eval(
            conversations.PAGE_LUA, conversation_id, self._ttl_s, page.limit, page.order, page.after or ""
        )
        if reply is None or not owns(_text(reply[0]), caller):
            raise conversation_not_found(conversation_id)
        if reply[1] == b"after_missing":
            raise invalid_value(f"No item with id {page.after!r} in this conversation.", "after")
        return item_list(_items(reply[2:]), reply[1] == b"1")

    async def get_item(self, conversation_id: str, item_id: str, caller: Caller) -> Item:
        """The item ``item_id`` of the conversation; 404 for an unknown item."""
        check_conversation_id(conversation_id)
        check_item_id(item_id)
        reply = await self._eval(conversations.ITEM_LUA, conversation_id, self._ttl_s, item_id)
        if reply is None or not owns(_text(reply[0]), caller):
            raise conversation_not_found(conversation_id)
        if len(reply) < 2:
            raise item_not_found(item_id)
        item: Item = jsonutil.loads(reply[1])
        return item

    async def delete_item(self, conversation_id: str, item_id: str, caller: Caller) -> StoredConversation:
        """Remove the item ``item_id``; the conversation (404 for an unknown item)."""
        check_conversation_id(conversation_id)
        check_item_id(item_id)
        stored = await self.get(conversation_id, caller)
        status = await self._eval(conversations.DELETE_ITEM_LUA, conversation_id, self._ttl_s, item_id)
        if status == b"missing":
            raise conversation_not_found(conversation_id)
        if status != b"deleted":
            raise item_not_found(item_id)
        return stored

    async def prompt_items(
        self, conversation_id: str, caller: Caller, param: str = "conversation"
    ) -> list[Item]:
        """Every item of the conversation, in order, in one round trip: what a response continuing it sees.

        400 naming ``param`` for a malformed id, 404 (``param``) for an unknown or foreign one.
        """
        check_conversation_id(conversation_id, param)
        reply = await self._eval(conversations.ALL_ITEMS_LUA, conversation_id, self._ttl_s)
        if reply is None or not owns(_text(reply[0]), caller):
            raise conversation_not_found(conversation_id, param)
        return _items(reply[1:])
