"""API keys, owner fingerprints and the per-key token bucket (the bucket on the suite's real Redis)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

import api.auth
from api.auth import (
    DEFAULT_OWNER_SECRET,
    APIKeyError,
    KeyRing,
    bearer_token,
    fingerprint,
    match_index,
    parse_api_keys,
)
from api.caller import ANONYMOUS
from api.errors import OpenAIError, rate_limited
from api.gate import protected
from api.rate_limit import TOKEN_BUCKET_LUA, RateLimiter
from api.state import load_keyring
from resq import ids, jsonutil, keys
from resq.cli import main
from resq.records import CANCEL_LUA, FINALIZE_LUA, MARK_IN_PROGRESS_LUA
from resq.redis_client import async_redis
from resq.settings import Settings

KEY_A = "sk-resq-aaaaaaaaaaaaaaaaaaaaaaaa"
KEY_B = "sk-resq-bbbbbbbbbbbbbbbbbbbbbbbb"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- parsing RESQ_API_KEYS ---------------------------------------------------------------------------


def test_no_value_means_an_open_api() -> None:
    assert parse_api_keys(None) == ()
    assert parse_api_keys("") == ()
    assert parse_api_keys("   ") == ()


def test_a_comma_list_is_stripped_and_deduplicated() -> None:
    assert parse_api_keys(f" {KEY_A} ,{KEY_B},, {KEY_A}") == (KEY_A, KEY_B)


def test_a_value_naming_no_key_is_an_error_not_an_open_api(tmp_path: Path) -> None:
    with pytest.raises(APIKeyError):
        parse_api_keys(" , ,")
    empty = tmp_path / "keys"
    empty.write_text("# no keys yet\n\n")
    with pytest.raises(APIKeyError):
        parse_api_keys(f"@{empty}")


def test_a_key_file_has_one_key_a_line_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# team A\n{KEY_A}\n\n  {KEY_B}  \n   # rotated out: sk-old\n")
    assert parse_api_keys(f"@{path}") == (KEY_A, KEY_B)


def test_key_errors_never_show_a_key(tmp_path: Path) -> None:
    with pytest.raises(APIKeyError) as unreadable:
        parse_api_keys(f"@{tmp_path / 'missing'}")
    assert "missing" in str(unreadable.value)
    with pytest.raises(APIKeyError) as spaced:
        parse_api_keys(f"{KEY_A},sk-has space")
    assert "#2" in str(spaced.value) and "space" not in str(spaced.value).replace("whitespace", "")


@pytest.mark.parametrize("command", ["api", "up"])
def test_a_bad_key_setting_stops_the_start_with_one_line(tmp_path: Path, command: str) -> None:
    """Before anything starts (``up``: no Redis, no workers), not as uvicorn's start-up traceback."""
    result = CliRunner().invoke(
        main,
        [command],
        env={"RESQ_API_KEYS": f"@{tmp_path / 'missing'}", "RESQ_REDIS_URL": "redis://127.0.0.1:1/0"},
    )
    assert result.exit_code == 1, result.output
    assert "RESQ_API_KEYS: cannot read the API key file" in result.output
    assert "Traceback" not in result.output


def test_the_setting_is_secret_in_reprs_but_reaches_child_processes() -> None:
    settings = Settings(api_keys=f"{KEY_A},{KEY_B}", owner_secret="pepper")  # type: ignore[arg-type]
    assert KEY_A not in repr(settings) and "pepper" not in repr(settings)
    assert KEY_A not in str(settings.model_dump())
    env = settings.to_env()
    assert env["RESQ_API_KEYS"] == f"{KEY_A},{KEY_B}" and env["RESQ_OWNER_SECRET"] == "pepper"


# --- the constant-time check --------------------------------------------------------------------------


def digests(*api_keys: str) -> list[bytes]:
    return [hashlib.sha256(key.encode()).digest() for key in api_keys]


def test_a_token_matches_its_own_key_only() -> None:
    ring = digests(KEY_A, KEY_B)
    assert match_index(KEY_A, ring) == 0
    assert match_index(KEY_B, ring) == 1
    for wrong in ("", KEY_A[:-1], KEY_A + "x", KEY_A.upper(), "sk-other"):
        assert match_index(wrong, ring) is None


def test_every_key_is_compared_whether_or_not_one_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api.auth.hmac, "compare_digest", counting)
    ring = digests(KEY_A, KEY_B, "sk-third-key-cccccccccccc")
    for token in (KEY_A, "sk-wrong"):
        compared.clear()
        match_index(token, ring)
        assert len(compared) == 3
        # Always digests of equal length: a key's length does not show either.
        assert {len(a) for a, _ in compared} | {len(b) for _, b in compared} == {32}


def test_bearer_tokens_are_read_from_the_header() -> None:
    assert bearer_token(f"Bearer {KEY_A}") == KEY_A
    assert bearer_token(f"bearer   {KEY_A} ") == KEY_A
    for header in (None, "", "Bearer", "Bearer   ", f"Basic {KEY_A}", KEY_A):
        assert bearer_token(header) is None


# --- fingerprints and the key ring --------------------------------------------------------------------


def test_a_fingerprint_is_an_hmac_of_the_key() -> None:
    expected = hmac.new(DEFAULT_OWNER_SECRET, KEY_A.encode(), hashlib.sha256).hexdigest()
    assert fingerprint(KEY_A) == expected
    assert len(expected) == 64 and KEY_A not in expected
    assert fingerprint(KEY_A) != fingerprint(KEY_B)
    assert fingerprint(KEY_A, b"pepper") != fingerprint(KEY_A)
    # Not a plain hash of the key, which other systems might store too.
    assert fingerprint(KEY_A) != hashlib.sha256(KEY_A.encode()).hexdigest()


def test_the_key_ring_proves_callers_by_fingerprint() -> None:
    ring = KeyRing([KEY_A, KEY_B], b"pepper")
    assert not ring.open and len(ring) == 2
    assert ring.authenticate(f"Bearer {KEY_A}").owner == fingerprint(KEY_A, b"pepper")
    assert ring.authenticate(f"Bearer {KEY_B}").owner == fingerprint(KEY_B, b"pepper")
    assert KEY_A not in repr(vars(ring))


@pytest.mark.parametrize(
    ("header", "message"),
    [(None, "You didn't provide an API key."), (f"Bearer {KEY_A}x", "Incorrect API key provided.")],
)
def test_a_missing_or_wrong_key_is_a_401_in_openai_shape(header: str | None, message: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        KeyRing([KEY_A]).authenticate(header)
    error = caught.value
    assert error.status_code == 401
    assert error.body() == {
        "error": {
            "message": error.message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert error.message.startswith(message) and KEY_A not in error.message
    assert error.headers == {"WWW-Authenticate": "Bearer"}


def test_an_open_ring_lets_everyone_in_as_anonymous() -> None:
    ring = KeyRing([])
    assert ring.open
    assert ring.authenticate(None) is ANONYMOUS
    assert ring.authenticate("Bearer anything") is ANONYMOUS


def test_start_up_warns_once_on_an_open_api_and_never_logs_keys(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with caplog.at_level(logging.INFO, logger="api.state"):
        assert load_keyring(Settings()).open
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RESQ_API_KEYS is empty" in warnings[0].getMessage()
    caplog.clear()
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")
    with caplog.at_level(logging.DEBUG):
        ring = load_keyring(Settings(api_keys=f"@{path}"))  # type: ignore[arg-type]
    assert len(ring) == 2
    assert not any(record.levelno >= logging.WARNING for record in caplog.records)
    assert all(
        KEY_A not in record.getMessage() and KEY_B not in record.getMessage() for record in caplog.records
    )


def test_only_v1_paths_are_guarded() -> None:
    for path in ("/v1", "/v1/responses", "/v1/models", "/v1/anything/else"):
        assert protected(path)
    for path in ("/health", "/metrics", "/v1x", "/docs", "/openapi.json", "/"):
        assert not protected(path)


# --- ownership survives the workers --------------------------------------------------------------------


def test_the_scripts_workers_run_never_change_the_owner(redis_client: redis.Redis) -> None:
    response_id = ids.new_response_id()
    record = keys.record(response_id)
    redis_client.hset(record, mapping={"status": "queued", "response": b"{}", "owner": "f" * 64})
    redis_client.eval(MARK_IN_PROGRESS_LUA, 1, record, b'{"status": "in_progress"}')
    redis_client.eval(CANCEL_LUA, 2, record, keys.cancel(response_id), 60)
    redis_client.eval(
        FINALIZE_LUA,
        4,
        record,
        keys.events(response_id),
        keys.input_items(response_id),
        keys.turn(response_id),
        "cancelled",
        jsonutil.dumps({"status": "cancelled"}),
        60,
        b"[]",
    )
    assert redis_client.hget(record, "final") == b"1"
    assert redis_client.hget(record, "owner") == b"f" * 64
    redis_client.delete(*keys.all_keys(response_id))


# --- the 429 and the token bucket ---------------------------------------------------------------------


def test_rate_limited_is_a_429_with_whole_seconds_to_wait() -> None:
    error = rate_limited("Slow down.", 2.2)
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    assert error.body()["error"] == {
        "message": "Slow down.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert error.headers == {"Retry-After": "3"}
    assert rate_limited("Slow down.", 0.01).headers == {"Retry-After": "1"}


def take(client: redis.Redis, bucket: str, capacity: int, per_second: float) -> tuple[int, int]:
    taken, wait_ms = client.eval(TOKEN_BUCKET_LUA, 1, bucket, capacity, per_second)
    return int(taken), int(wait_ms)


def test_a_bucket_allows_its_capacity_then_says_how_long_to_wait(redis_client: redis.Redis) -> None:
    bucket = keys.rate_limit("unit-" + ids.new_response_id())
    # 3 a minute: a burst of 3, then one every 20 s.
    assert [take(redis_client, bucket, 3, 0.05) for _ in range(3)] == [(1, 0)] * 3
    taken, wait_ms = take(redis_client, bucket, 3, 0.05)
    assert taken == 0 and 19_000 <= wait_ms <= 20_000
    # It expires once it would be full again (60 s for 3 tokens at 3 a minute), not later.
    assert 55_000 <= redis_client.pttl(bucket) <= 61_000
    redis_client.delete(bucket)


def test_a_bucket_refills_with_time(redis_client: redis.Redis) -> None:
    bucket = keys.rate_limit("unit-" + ids.new_response_id())
    assert take(redis_client, bucket, 2, 20)[0] == 1
    assert take(redis_client, bucket, 2, 20)[0] == 1
    taken, wait_ms = take(redis_client, bucket, 2, 20)
    assert taken == 0 and 1 <= wait_ms <= 50
    time.sleep(wait_ms / 1000 + 0.02)
    assert take(redis_client, bucket, 2, 20)[0] == 1
    redis_client.delete(bucket)


@pytest.mark.anyio
async def test_each_key_has_its_own_bucket(redis_url: str, redis_client: redis.Redis) -> None:
    client = async_redis(redis_url)
    limiter = RateLimiter(client, 2)
    try:
        first, second = (
            KeyRing([key]).authenticate(f"Bearer {key}")
            for key in (KEY_A + ids.new_response_id(), KEY_B + ids.new_response_id())
        )
        assert [await limiter.take(first) for _ in range(2)] == [None, None]
        wait_s = await limiter.take(first)
        assert wait_s is not None and 29 <= wait_s <= 30
        assert await limiter.take(second) is None
        for caller in (first, second):
            assert redis_client.exists(keys.rate_limit(caller.owner))
            redis_client.delete(keys.rate_limit(caller.owner))
    finally:
        await client.aclose()
