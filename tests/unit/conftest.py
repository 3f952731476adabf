"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.redis_server import PrivateRedis


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    """A redis-server of the module's own: its tests may flush it or change its config freely."""
    server = PrivateRedis(Path(tmp_path_factory.mktemp("private-redis")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def r(private_redis: PrivateRedis) -> Iterator[redis.Redis]:
    """A client of the module's private Redis, flushed for each test (a module may define its own)."""
    client = private_redis.client()
    client.flushdb()
    yield client
    client.close()
