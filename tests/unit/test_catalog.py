"""Model cards expire with their workers: /v1/models and requests see only what is served now."""

from __future__ import annotations

import asyncio
import threading
import time

import redis
from redis.asyncio import Redis as AsyncRedis

from resq import keys
from resq.catalog import (
    CARD_REFRESH_S,
    SERVED_RECHECK_S,
    AsyncModelCatalog,
    ModelCard,
    mark_served,
    register_model,
    served_now,
)
from resq.postprocess.service import PostprocessService
from resq.settings import Settings
from tests.support.redis_server import PrivateRedis
from tests.support.tokenizer import tiny_tokenizer

SERVED_WITHIN_S = 10.0


def card(name: str, **fields: object) -> ModelCard:
    values: dict[str, object] = {
        "name": name,
        "context_length": 1024,
        "chat_template": "{{ messages }}",
        "special_tokens": {},
        "eos_token_ids": [0],
        "tokenizer_sha256": "sha",
        "created": 1,
        "source": "/models/a",
    }
    return ModelCard.model_validate({**values, **fields})


def _lookup(url: str, name: str) -> tuple[bool, list[str]]:
    async def run() -> tuple[bool, list[str]]:
        client = AsyncRedis.from_url(url)
        try:
            catalog = AsyncModelCatalog(client, SERVED_WITHIN_S)
            return await catalog.get(name) is not None, [c.name for c in await catalog.cards()]
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_a_card_counts_only_while_a_worker_serving_it_beats(private_redis: PrivateRedis) -> None:
    client: redis.Redis = private_redis.client()
    client.flushdb()
    register_model(client, card("live"), tiny_tokenizer().tokenizer.to_str())
    register_model(client, card("stale"), tiny_tokenizer().tokenizer.to_str())
    # The worker of "stale" stopped beating long ago (or restarted with another model).
    client.zadd(keys.MODELS_SERVED, {"stale": time.time() - 3 * SERVED_WITHIN_S})
    assert _lookup(private_redis.url, "live") == (True, ["live"])
    assert _lookup(private_redis.url, "stale")[0] is False
    # A worker serving it again brings it back.
    mark_served(client, "stale")
    found, listed = _lookup(private_redis.url, "stale")
    assert found and sorted(listed) == ["live", "stale"]


def test_a_card_without_any_beat_is_not_served_while_another_model_is(private_redis: PrivateRedis) -> None:
    client: redis.Redis = private_redis.client()
    client.flushdb()
    client.hset(keys.MODELS, "orphan", card("orphan").model_dump_json())  # written by an old version
    register_model(client, card("live"), tiny_tokenizer().tokenizer.to_str())
    assert _lookup(private_redis.url, "orphan") == (False, ["live"])


def test_while_no_worker_is_alive_the_last_cards_stand(private_redis: PrivateRedis) -> None:
    """A restart of the only GPU worker: requests wait for it (and fail after the lost timeout)."""
    client: redis.Redis = private_redis.client()
    client.flushdb()
    register_model(client, card("only"), tiny_tokenizer().tokenizer.to_str())
    client.zadd(keys.MODELS_SERVED, {"only": time.time() - 3 * SERVED_WITHIN_S})
    assert _lookup(private_redis.url, "only") == (True, ["only"])


def test_served_now_and_renders_like() -> None:
    assert served_now(100.0, 10.0, now=105.0) and not served_now(100.0, 10.0, now=111.0)
    assert not served_now(None, 10.0)
    assert card("m").renders_like(card("m", created=5, logprobs=True))  # start time, capabilities
    assert not card("m").renders_like(card("m", source="/models/b"))
    assert not card("m").renders_like(card("m", chat_template="other"))


def test_a_served_answer_is_reused_for_a_second_then_asked_again(private_redis: PrivateRedis) -> None:
    """The API asks whether a model is served at most once per SERVED_RECHECK_S, not per request."""
    client: redis.Redis = private_redis.client()
    client.flushdb()
    register_model(client, card("live"), tiny_tokenizer().tokenizer.to_str())

    async def run() -> list[bool]:
        redis_client = AsyncRedis.from_url(private_redis.url)
        try:
            catalog = AsyncModelCatalog(redis_client, SERVED_WITHIN_S)
            seen = [await catalog.get("live") is not None]
            # Its worker is gone (its beat is old): within the second the answer stands...
            client.zadd(keys.MODELS_SERVED, {"live": time.time() - 3 * SERVED_WITHIN_S})
            register_model(client, card("other"), tiny_tokenizer().tokenizer.to_str())
            seen.append(await catalog.get("live") is not None)
            # ...and after it the model is refused.
            await asyncio.sleep(SERVED_RECHECK_S + 0.1)
            seen.append(await catalog.get("live") is not None)
            return seen
        finally:
            await redis_client.aclose()

    assert asyncio.run(run()) == [True, True, False]


def _commands(client: redis.Redis) -> int:
    return sum(int(stat["calls"]) for stat in client.info("commandstats").values())


def test_a_refreshed_catalog_answers_a_request_after_a_quiet_second_without_asking_redis(
    private_redis: PrivateRedis,
) -> None:
    """The API's refresher renews the answers ahead of requests; a model that stops being served,
    or whose card changes, is dropped by it, and the next request decides as before."""
    client: redis.Redis = private_redis.client()
    client.flushdb()
    register_model(client, card("live"), tiny_tokenizer().tokenizer.to_str())
    register_model(client, card("gone"), tiny_tokenizer().tokenizer.to_str())
    register_model(client, card("changed"), tiny_tokenizer().tokenizer.to_str())

    async def run() -> tuple[int, bool, bool, str | None]:
        redis_client = AsyncRedis.from_url(private_redis.url)
        try:
            catalog = AsyncModelCatalog(redis_client, SERVED_WITHIN_S)
            for name in ("live", "gone", "changed"):
                assert await catalog.get(name) is not None
            client.zadd(keys.MODELS_SERVED, {"gone": time.time() - 3 * SERVED_WITHIN_S})
            register_model(client, card("changed", source="/models/b"), tiny_tokenizer().tokenizer.to_str())
            refreshing = asyncio.create_task(catalog.keep_fresh())
            await asyncio.sleep(SERVED_RECHECK_S + 0.3)  # past the answers get() took itself
            client.config_resetstat()
            found = await catalog.get("live") is not None
            asked = _commands(client)
            refreshing.cancel()
            gone = await catalog.get("gone") is None
            changed = await catalog.get("changed")
            return asked, found, gone, changed.card.source if changed is not None else None
        finally:
            await redis_client.aclose()

    asked, found, gone, changed_source = asyncio.run(run())
    assert found and asked == 1  # CONFIG RESETSTAT itself: get() sent nothing
    assert gone
    assert changed_source == "/models/b"


def test_a_card_of_another_start_of_the_same_model_keeps_the_built_tokenizer(
    private_redis: PrivateRedis,
) -> None:
    """A GPU worker restarted (a new start time, another capability): the API serves the new card
    with the tokenizer it built, through a request's own re-read and through the refresher."""
    client: redis.Redis = private_redis.client()
    client.flushdb()
    tokenizer_json = tiny_tokenizer().tokenizer.to_str()
    register_model(client, card("m"), tokenizer_json)

    async def run() -> None:
        redis_client = AsyncRedis.from_url(private_redis.url)
        try:
            catalog = AsyncModelCatalog(redis_client, SERVED_WITHIN_S)
            first = await catalog.get("m")
            assert first is not None
            first.prompt_ids([{"role": "user", "content": "Hi."}], cache_owner="o")  # builds the encoder
            register_model(client, card("m", created=2, penalties=True), tokenizer_json)
            await catalog.refresh()
            client.config_resetstat()
            second = await catalog.get("m")
            assert _commands(client) == 1  # CONFIG RESETSTAT itself
            assert second is not None and second.card.created == 2 and second.card.penalties is True
            assert second.tokenizer is first.tokenizer
            assert second._prompt_encoder is first._prompt_encoder
            register_model(client, card("m", created=3), tokenizer_json)
            catalog._entries["m"].fetched_at -= CARD_REFRESH_S  # old enough for get() to re-read it
            third = await catalog.get("m")
            assert third is not None and third.card.created == 3 and third.tokenizer is first.tokenizer
        finally:
            await redis_client.aclose()

    asyncio.run(run())


def test_the_refresher_vouches_only_for_a_model_a_live_worker_serves(private_redis: PrivateRedis) -> None:
    """While no GPU worker is alive the last cards stand for a request that asks (a restart); the
    refresher does not renew that answer ahead of time, so a request right after another model's
    worker came up is refused, not queued for a worker that never comes."""
    client: redis.Redis = private_redis.client()
    client.flushdb()
    register_model(client, card("old"), tiny_tokenizer().tokenizer.to_str())

    async def run() -> tuple[bool, bool]:
        redis_client = AsyncRedis.from_url(private_redis.url)
        try:
            catalog = AsyncModelCatalog(redis_client, SERVED_WITHIN_S)
            assert await catalog.get("old") is not None
            client.zadd(keys.MODELS_SERVED, {"old": time.time() - 3 * SERVED_WITHIN_S})  # its worker stopped
            await asyncio.sleep(SERVED_RECHECK_S + 0.1)
            await catalog.refresh()  # no worker alive: the card stands, the answer is not renewed
            kept = "old" in catalog._entries
            register_model(client, card("new"), tiny_tokenizer().tokenizer.to_str())  # another model's worker
            return kept, await catalog.get("old") is None
        finally:
            await redis_client.aclose()

    assert asyncio.run(run()) == (True, True)


def test_a_post_process_worker_builds_the_served_models_tokenizers_before_its_first_response(
    private_redis: PrivateRedis,
) -> None:
    """``PostprocessService.warm_up`` waits for a GPU worker to serve a model, then builds its
    tokenizer (a first response built it otherwise); a card no worker serves now is left alone."""
    client: redis.Redis = private_redis.client()
    client.flushdb()
    tokenizer_json = tiny_tokenizer().tokenizer.to_str()
    register_model(client, card("stale"), tokenizer_json)
    client.zadd(keys.MODELS_SERVED, {"stale": time.time() - 3600})
    settings = Settings(redis_url=private_redis.url, worker_ttl_s=SERVED_WITHIN_S)
    service = PostprocessService(settings, "pp-test")
    assert service.warm_up(wait_s=0.3, poll_s=0.05) == []  # none served: it gives up after wait_s
    # A GPU worker comes up while the post-process worker waits for it.
    threading.Timer(0.3, lambda: register_model(client, card("live"), tokenizer_json)).start()
    started = time.monotonic()
    assert service.warm_up(wait_s=10, poll_s=0.05) == ["live"]
    assert time.monotonic() - started < 5
    built = service._catalog._entries
    assert set(built) == {"live"} and built["live"].tokenizer.card.name == "live"
