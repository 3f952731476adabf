"""A response that belongs to a conversation appends its items to it exactly once, whichever
post-processor finishes it and wherever the one before died (real Redis, the real runner)."""

from __future__ import annotations

import pytest
import redis

from resq import conversations, jsonutil, keys
from resq.catalog import TextTokenizer
from resq.options import ProcessingOptions
from resq.postprocess import runner
from resq.wire import FinishEntry, StartEntry, TokensEntry
from tests.unit.test_event_log import (
    RESPONSE_ID,
    TEXT,
    add_entries,
    keep_first,
    log_entries,
    postprocess,
    start_response,
)
from tests.unit.test_event_log import fast_retries as fast_retries
from tests.unit.test_event_log import tokenizer as tokenizer

CONVERSATION_ID = "conv_" + "c" * 32
SEEDED = {"id": "msg_seed", "type": "message", "role": "user", "content": [], "status": "completed"}
INPUT = {"id": "in_1", "type": "message", "role": "user", "content": [], "status": "completed"}


def begin(r: redis.Redis, tokenizer: TextTokenizer) -> None:
    """A conversation holding one item, and a response of it with its whole token stream."""
    r.eval(
        conversations.CREATE_LUA,
        4,
        *keys.conversation_keys(CONVERSATION_ID),
        600,
        "owner",
        0,
        "{}",
        *conversations.item_pairs([SEEDED]),
    )
    start_response(r)
    options = ProcessingOptions(model="tiny", conversation_id=CONVERSATION_ID)
    r.hset(keys.record(RESPONSE_ID), "options", options.model_dump_json())
    r.set(keys.input_items(RESPONSE_ID), jsonutil.dumps({"items": [INPUT], "conversation": [INPUT]}))
    feed(r, tokenizer)


def feed(r: redis.Redis, tokenizer: TextTokenizer) -> None:
    token_ids = tokenizer.encode(TEXT)
    add_entries(
        r,
        [StartEntry(4), TokensEntry(token_ids, start=0), FinishEntry("stop", 4, len(token_ids))],
    )


def conversation_ids(r: redis.Redis) -> list[str]:
    return [item_id.decode() for item_id in r.lrange(keys.conversation_items(CONVERSATION_ID), 0, -1)]


def output_ids(r: redis.Redis) -> list[str]:
    stored = jsonutil.loads(r.hget(keys.record(RESPONSE_ID), "response") or b"{}")
    return [item["id"] for item in stored["output"]]


def test_a_finished_response_appends_its_input_then_its_output(
    r: redis.Redis, tokenizer: TextTokenizer
) -> None:
    begin(r, tokenizer)
    assert postprocess(r, tokenizer) == "completed"
    assert conversation_ids(r) == ["msg_seed", "in_1", *output_ids(r)]
    assert r.sismember(keys.conversation_appended(CONVERSATION_ID), RESPONSE_ID)


def test_a_takeover_after_the_append_appends_nothing_twice(r: redis.Redis, tokenizer: TextTokenizer) -> None:
    begin(r, tokenizer)
    assert postprocess(r, tokenizer) == "completed"
    # The client deletes an item meanwhile: a second append would bring it back.
    r.lrem(keys.conversation_items(CONVERSATION_ID), 0, "in_1")
    r.hdel(keys.conversation_item_data(CONVERSATION_ID), "in_1")
    appended = conversation_ids(r)
    # The post-processor died after appending, before its terminal event was logged: the takeover
    # finds the final record and the token stream, and finishes the response again.
    keep_first(r, keys.events(RESPONSE_ID), len(log_entries(r)) - 1)
    feed(r, tokenizer)
    assert postprocess(r, tokenizer) == "completed"
    assert conversation_ids(r) == appended
    assert len(set(appended)) == len(appended)


def test_a_takeover_after_a_death_at_the_append_appends_once(
    r: redis.Redis, tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    begin(r, tokenizer)

    def die(self: object, output: object) -> None:
        raise SystemExit("killed while appending")

    with monkeypatch.context() as patched:
        patched.setattr(runner._Run, "_append_to_conversation", die)
        with pytest.raises(SystemExit):
            postprocess(r, tokenizer)
    assert conversation_ids(r) == ["msg_seed"]  # the final record is written, the items are not
    assert postprocess(r, tokenizer) == "completed"
    assert conversation_ids(r) == ["msg_seed", "in_1", *output_ids(r)]


def test_a_deleted_conversation_gets_nothing_and_the_response_ends(
    r: redis.Redis, tokenizer: TextTokenizer
) -> None:
    begin(r, tokenizer)
    r.delete(*keys.conversation_keys(CONVERSATION_ID))
    assert postprocess(r, tokenizer) == "completed"
    assert not r.exists(*keys.conversation_keys(CONVERSATION_ID))


def test_an_input_id_taken_meanwhile_joins_under_a_fresh_id_and_replaces_nothing(
    r: redis.Redis, tokenizer: TextTokenizer
) -> None:
    """Another response (or a client's add) put an item of this response's input id in the
    conversation after this one was accepted: both items stay, each response's block whole."""
    begin(r, tokenizer)
    other = {**INPUT, "content": [{"type": "input_text", "text": "the other one's"}]}
    r.eval(
        conversations.APPEND_LUA,
        4,
        *keys.conversation_keys(CONVERSATION_ID),
        *conversations.append_arguments(600, "resp_other", [other]),
    )
    assert postprocess(r, tokenizer) == "completed"
    ids = conversation_ids(r)
    assert ids[:2] == ["msg_seed", "in_1"] and len(ids) == 3 + len(output_ids(r))
    assert ids[3:] == output_ids(r)
    renamed = ids[2]
    assert renamed.startswith("msg_") and renamed != "in_1"
    item_data = keys.conversation_item_data(CONVERSATION_ID)
    assert jsonutil.loads(r.hget(item_data, "in_1") or b"{}") == other  # not replaced
    assert jsonutil.loads(r.hget(item_data, renamed) or b"{}") == {**INPUT, "id": renamed}


def test_a_clients_add_of_a_held_id_still_replaces_it(r: redis.Redis) -> None:
    """The items API's own add keeps its documented replace-in-place (no marker)."""
    r.eval(conversations.CREATE_LUA, 4, *keys.conversation_keys(CONVERSATION_ID), 600, "owner", 0, "{}")
    for text in ("first", "second"):
        item = {**INPUT, "content": [{"type": "input_text", "text": text}]}
        reply = r.eval(
            conversations.APPEND_LUA,
            4,
            *keys.conversation_keys(CONVERSATION_ID),
            *conversations.append_arguments(600, "", [item]),
        )
        assert reply == b"appended"
    assert conversation_ids(r) == ["in_1"]
    held = jsonutil.loads(r.hget(keys.conversation_item_data(CONVERSATION_ID), "in_1") or b"{}")
    assert held["content"][0]["text"] == "second"
