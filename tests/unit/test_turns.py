"""Turns (resq.turns) on a real Redis: a chain is read whole, outlives deleted and expiring
ancestors while a descendant needs them, and goes once nothing does."""

from __future__ import annotations

from typing import Any

import redis

from resq import jsonutil, keys, turns

TTL_S = 600


def rid(name: str) -> str:
    return "resp_" + name * 32


def item(text: str) -> dict[str, Any]:
    return {"id": f"msg_{text}", "type": "message", "role": "user", "content": text}


def create(r: redis.Redis, name: str, parent: str | None, ttl_s: int = TTL_S) -> int:
    return int(
        r.eval(
            turns.CREATE_LUA,
            1,
            keys.turn(rid(name)),
            *turns.create_arguments(rid(parent) if parent else None, [item(name)], ttl_s, ttl_s),
        )
    )


def answer(r: redis.Redis, name: str) -> None:
    r.eval(turns.SET_OUTPUT_LUA, 1, keys.turn(rid(name)), jsonutil.dumps([item(name.upper())]))


def history(r: redis.Redis, name: str) -> turns.History:
    return turns.parse_history(r.eval(turns.HISTORY_LUA, 1, keys.turn(rid(name)), turns.TURN_KEY_TEMPLATE))


def release(r: redis.Redis, name: str) -> int:
    return int(r.eval(turns.RELEASE_LUA, 1, keys.turn(rid(name)), turns.TURN_KEY_TEMPLATE))


def chain(r: redis.Redis) -> None:
    for name, parent in (("a", None), ("b", "a"), ("c", "b")):
        assert create(r, name, parent) >= 0
        answer(r, name)


def test_a_chain_is_read_oldest_first_each_turn_once(r: redis.Redis) -> None:
    chain(r)
    read = history(r, "c")
    assert read.complete
    assert read.turns == [([item(name)], [item(name.upper())]) for name in "abc"]
    assert int(r.hget(keys.turn(rid("a")), "children") or 0) == 1


def test_a_turn_continuing_a_gone_one_is_not_written(r: redis.Redis) -> None:
    assert create(r, "b", "a") == -1
    assert not r.exists(keys.turn(rid("b")))


def test_a_new_turn_keeps_every_ancestor_alive_as_long_as_itself(r: redis.Redis) -> None:
    assert create(r, "a", None, ttl_s=5) == 0
    assert create(r, "b", "a", ttl_s=5) == 1
    assert create(r, "c", "b", ttl_s=TTL_S) == 2
    assert r.ttl(keys.turn(rid("a"))) > 5 and r.ttl(keys.turn(rid("b"))) > 5


def test_deleted_ancestors_stay_while_continued_and_go_with_their_last_child(r: redis.Redis) -> None:
    chain(r)
    assert release(r, "b") == 0  # c continues it: kept, marked deleted
    assert history(r, "c").complete and len(history(r, "c").turns) == 3
    assert release(r, "c") == 2  # c goes, then b (deleted, and now without children)
    assert not r.exists(keys.turn(rid("b"))) and not r.exists(keys.turn(rid("c")))
    # a was never deleted: it stays, with no children left.
    assert r.hget(keys.turn(rid("a")), "children") == b"0"
    assert release(r, "a") == 1
    assert r.dbsize() == 0


def test_a_turn_with_two_children_goes_after_both(r: redis.Redis) -> None:
    chain(r)
    assert create(r, "d", "b") == 2
    release(r, "b")
    release(r, "c")
    assert r.exists(keys.turn(rid("b")))
    assert history(r, "d").turns[1] == ([item("b")], [item("B")])
    release(r, "d")
    assert not r.exists(keys.turn(rid("b")))
