"""Stored responses as the routes see them: every read of a response by id passes through here.

The routes never read a response record themselves. :meth:`ResponseStore.get`
checks the id's shape (400), that the response exists, was stored
(``store=true``) and that the caller may see it (404 otherwise, with the same
message, so that nobody learns whether a foreign id exists).
:meth:`ResponseStore.visible` is the one place where ownership is decided: the
record's ``owner`` (the creating key's fingerprint, written once by the API at
submission; workers never write it) must be the caller's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import anyio
from redis.asyncio import Redis

from api.caller import Caller
from api.errors import OpenAIError, invalid_value, response_not_found
from api.relay import follow_events, last_sequence_number
from resq import ids, item_index, jsonutil, keys, records, turns
from resq.records import CANCEL_LUA, DELETE_LUA, TERMINAL_STATUSES
from resq.redis_types import optional_bytes

log = logging.getLogger(__name__)

Item = dict[str, Any]


@dataclass(frozen=True)
class StoredResponse:
    """One response record, as read at one moment."""

    response_id: str
    status: str
    response_json: bytes
    final: bool
    store: bool
    background: bool
    owner: str

    @property
    def terminal(self) -> bool:
        """Whether the status can no longer change."""
        return self.status in TERMINAL_STATUSES

    def current_json(self) -> bytes:
        """The Response as a client sees it now.

        Once final, the stored bytes exactly as the create call returned them.
        Before that, the latest snapshot with the record's status, which moves
        ahead of the snapshot when a cancel marks the record before the
        post-processor writes the final cancelled Response.
        """
        if self.final:
            return self.response_json
        snapshot = jsonutil.loads(self.response_json)
        if snapshot.get("status") == self.status:
            return self.response_json
        return jsonutil.dumps({**snapshot, "status": self.status})


@dataclass(frozen=True)
class EarlierConversation:
    """What continuing from a response (``previous_response_id``) needs of it."""

    conversation: list[Item]
    """The items it was generated from (its own earlier conversation and input)."""
    output: list[Item]
    """Its output items."""
    linked: bool = True
    """Its history is a chain of turns (:mod:`resq.turns`), which the continuation extends; False
    for a response stored with its whole conversation, before turns existed."""


def check_response_id(response_id: str, param: str = "response_id") -> str:
    """``response_id`` if it is shaped like an id resq issues; a 400 otherwise."""
    if not ids.is_response_id(response_id):
        raise invalid_value(
            f"Invalid '{param}': {response_id!r}. Expected an ID that begins with 'resp_' "
            "followed by 32 hexadecimal digits.",
            param,
        )
    return response_id


def previous_response_not_found(response_id: str) -> OpenAIError:
    """The 400 for a ``previous_response_id`` that names no stored response the caller may see."""
    return invalid_value(
        f"Previous response with id '{response_id}' not found.",
        "previous_response_id",
        "previous_response_not_found",
    )


def owns(owner: str, caller: Caller) -> bool:
    """Whether ``caller`` is the ``owner`` a record names: the single ownership check of the API."""
    return owner == caller.owner


def _item_of(entry: item_index.IndexedItem | None, item_id: str, caller: Caller) -> Item | None:
    """The item ``item_id`` of an indexed response, if the caller may see that response."""
    if entry is None or not entry.store or not owns(entry.owner, caller) or not entry.payload:
        return None
    if entry.where == item_index.OUTPUT:
        if not entry.final:
            return None  # output is only referable once the response ended
        candidates: list[Item] = jsonutil.loads(entry.payload).get("output", [])
    else:
        candidates = jsonutil.loads(entry.payload).get("items", [])
    return next((item for item in candidates if item.get("id") == item_id), None)


class ResponseStore:
    """Reads, cancels and deletes stored responses in Redis."""

    def __init__(self, redis: Redis, transient_ttl_s: int) -> None:
        self._redis = redis
        self._transient_ttl_s = transient_ttl_s

    @staticmethod
    def visible(stored: StoredResponse, caller: Caller) -> bool:
        """Whether ``caller`` may see ``stored``: the single ownership check of the API."""
        return owns(stored.owner, caller)

    async def referenced_items(self, references: list[tuple[int, str]], caller: Caller) -> dict[int, Item]:
        """The items ``references`` (``(input index, item id)``) name, by input index; one round trip.

        An item resolves when a stored response the caller may see (the same check as every
        by-id route) holds it as an output or input item; otherwise a 400 names ``input[i].id``.
        """
        if not references:
            return {}
        resolve_keys = item_index.resolve_keys(caller.owner, (item_id for _, item_id in references))
        raw = await self._redis.eval(
            item_index.RESOLVE_LUA,
            len(resolve_keys),
            *resolve_keys,
            item_index.RECORD_KEY_TEMPLATE,
            item_index.INPUT_KEY_TEMPLATE,
        )
        resolved: dict[int, Item] = {}
        for (index, item_id), entry in zip(references, item_index.parse_resolved(raw), strict=True):
            item = _item_of(entry, item_id, caller)
            if item is None:
                raise invalid_value(
                    f"Item with id '{item_id}' not found: item_reference resolves only items of "
                    "your stored responses.",
                    f"input[{index}].id",
                )
            resolved[index] = item
        return resolved

    async def _read(self, response_id: str) -> StoredResponse | None:
        values = await self._redis.hmget(keys.record(response_id), records.STORED_FIELDS)
        record = records.parse_stored([optional_bytes(value) for value in values])
        if record is None:
            return None
        return StoredResponse(
            response_id=response_id,
            status=record.status,
            response_json=record.object_json,
            final=record.final,
            store=record.store,
            background=record.background,
            owner=record.owner,
        )

    async def _read_visible(self, response_id: str, caller: Caller) -> StoredResponse | None:
        stored = await self._read(response_id)
        if stored is None or not stored.store or not self.visible(stored, caller):
            return None
        return stored

    async def get(self, response_id: str, caller: Caller) -> StoredResponse:
        """The stored response ``response_id``; 400 for a malformed id, 404 when the caller cannot see it."""
        check_response_id(response_id)
        stored = await self._read_visible(response_id, caller)
        if stored is None:
            raise response_not_found(response_id)
        return stored

    async def earlier_conversation(self, response_id: str, caller: Caller) -> EarlierConversation:
        """What a request with ``previous_response_id=response_id`` continues; 400 when unusable.

        A malformed id is ``previous_response_not_found`` too: no response can have it.
        """
        if not ids.is_response_id(response_id):
            raise previous_response_not_found(response_id)
        stored = await self._read_visible(response_id, caller)
        if stored is None:
            raise previous_response_not_found(response_id)
        if not stored.final:
            raise invalid_value(
                f"Previous response with id '{response_id}' has status '{stored.status}': "
                "a conversation can only continue from a finished response.",
                "previous_response_id",
            )
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(keys.input_items(response_id))
        pipe.eval(turns.HISTORY_LUA, 1, keys.turn(response_id), turns.TURN_KEY_TEMPLATE)
        raw_input, raw_history = await pipe.execute()
        record = optional_bytes(raw_input)
        if record is None:
            raise previous_response_not_found(response_id)
        output: list[Item] = jsonutil.loads(stored.response_json)["output"]
        inputs = jsonutil.loads(record)
        if "conversation" in inputs:  # stored whole, before turns existed
            return EarlierConversation(inputs["conversation"], output, linked=False)
        if inputs.get("conversation_id"):
            raise invalid_value(
                f"Previous response with id '{response_id}' belongs to conversation "
                f"'{inputs['conversation_id']}': continue it with 'conversation' instead.",
                "previous_response_id",
            )
        history = turns.parse_history(raw_history)
        if not history.turns:
            raise previous_response_not_found(response_id)
        if not history.complete:
            log.warning("the history of %s lost turns; continuing from what is left", response_id)
        conversation = [item for given, answered in history.turns[:-1] for item in (*given, *answered)]
        # The response's own output comes from its record, which has it whatever its status.
        return EarlierConversation([*conversation, *history.turns[-1][0]], output)

    async def input_items(self, stored: StoredResponse) -> list[Item]:
        """The input items of ``stored``, in input order; 404 when they are gone."""
        record = optional_bytes(await self._redis.get(keys.input_items(stored.response_id)))
        if record is None:
            raise response_not_found(stored.response_id)
        items: list[Item] = jsonutil.loads(record)["items"]
        return items

    async def cancel(self, stored: StoredResponse) -> bool:
        """Mark ``stored`` cancelled unless it ended already, and flag its generation to stop.

        Returns False when the response vanished meanwhile.
        """
        status = await self._redis.eval(
            CANCEL_LUA,
            2,
            keys.record(stored.response_id),
            keys.cancel(stored.response_id),
            self._transient_ttl_s,
        )
        return status is not None

    async def wait_until_final(self, response_id: str, caller: Caller, timeout_s: float) -> StoredResponse:
        """The response once the post-processor wrote its final Response, or as it is after ``timeout_s``."""
        with anyio.move_on_after(timeout_s):
            # The terminal event is logged after the final Response is stored: once the log
            # ends, the record is final.
            async for _ in follow_events(
                self._redis, response_id, await last_sequence_number(self._redis, response_id)
            ):
                pass
        return await self.get(response_id, caller)

    async def delete(self, stored: StoredResponse) -> bool:
        """Remove every key of ``stored`` (a running generation is told to stop); False if already gone."""
        return await self.delete_keys(stored.response_id)

    async def delete_keys(self, response_id: str) -> bool:
        """Remove every key of ``response_id`` in one step, as :meth:`delete` does.

        A generation still running keeps only the cancel flag (expiring on its own), which
        stops the GPU worker; the post-processors write nothing to a response that is gone.
        """
        record, flag = keys.record(response_id), keys.cancel(response_id)
        others = [key for key in keys.all_keys(response_id) if key not in (record, flag)]
        status = await self._redis.eval(
            DELETE_LUA, 2 + len(others), record, flag, *others, self._transient_ttl_s
        )
        # Its turn goes too, unless a later turn continues it (then it goes with the last of them).
        await self._redis.eval(turns.RELEASE_LUA, 1, keys.turn(response_id), turns.TURN_KEY_TEMPLATE)
        return status is not None
