"""Session-wide fixtures: a real Redis, which must answer (the suite fails, never skips, without it)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

TEST_REDIS_URL = os.environ.get("RESQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
# litellm (a client under test) would fetch its model price list from the internet at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis database the suite owns (flushed at the start of the session)."""
    client = redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as exc:
        pytest.fail(
            f"no Redis answers at {TEST_REDIS_URL} (set RESQ_TEST_REDIS_URL, or start one: "
            f"redis-server --daemonize yes --port 6379): {exc}"
        )
    client.flushdb()
    client.close()
    return TEST_REDIS_URL


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A blocking client on the suite's database."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
