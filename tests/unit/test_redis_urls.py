"""``RESQ_REDIS_URL`` on a Unix socket: the URL forms, and every client of a role reaching it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from resq.celery_app import make_celery
from resq.embedded_redis import EmbeddedRedis
from resq.redis_client import async_redis, sync_redis
from resq.redis_urls import celery_broker_url, is_unix_socket, transport_options, unix_socket_url
from resq.settings import Settings


@pytest.mark.parametrize(
    ("url", "broker"),
    [
        ("unix:///run/redis/redis.sock?db=3", "redis+socket:///run/redis/redis.sock?virtual_host=3"),
        ("unix:///run/redis/redis.sock", "redis+socket:///run/redis/redis.sock?virtual_host=0"),
        (
            "unix://:secret@/run/redis.sock?db=2&health_check_interval=5",
            "redis+socket://:secret@/run/redis.sock?virtual_host=2&health_check_interval=5",
        ),
        (
            "unix://app:secret@/run/redis.sock?db=1",
            "redis+socket://app:secret@/run/redis.sock?virtual_host=1",
        ),
        ("redis://127.0.0.1:6379/4", "redis://127.0.0.1:6379/4"),
        ("rediss://:pw@cache.internal:6380/0", "rediss://:pw@cache.internal:6380/0"),
    ],
)
def test_the_broker_url_names_the_same_socket_and_database_for_kombu(url: str, broker: str) -> None:
    assert celery_broker_url(url) == broker


def test_only_tcp_gets_keepalive() -> None:
    assert transport_options("redis://127.0.0.1:6379/0") == {"socket_keepalive": True}
    assert transport_options(unix_socket_url("/tmp/r.sock", 2)) == {}
    assert is_unix_socket("unix:///tmp/r.sock?db=2")
    assert not is_unix_socket("redis://127.0.0.1:6379/0")


@pytest.fixture(scope="module")
def socket_redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(unix_socket=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_the_embedded_redis_listens_on_its_socket_only(socket_redis: EmbeddedRedis) -> None:
    assert socket_redis.url == f"unix://{socket_redis.socket_path}?db=0"
    client = redis.Redis.from_url(socket_redis.url)
    try:
        assert client.config_get("port") == {"port": "0"}  # no TCP listener
        assert client.config_get("unixsocket") == {"unixsocket": str(socket_redis.socket_path)}
    finally:
        client.close()


@pytest.mark.anyio
async def test_the_api_client_reaches_the_socket_database(socket_redis: EmbeddedRedis) -> None:
    url = unix_socket_url(str(socket_redis.socket_path), 5)
    marker = f"resq-test-{uuid.uuid4().hex}"
    sync_client = sync_redis(url)
    sync_client.set(marker, "sync")
    client = async_redis(url)
    try:
        assert await client.get(marker) == b"sync"
    finally:
        await client.aclose()
        sync_client.close()


def test_the_workers_clients_reach_the_socket_database(socket_redis: EmbeddedRedis) -> None:
    """redis-py and Celery's broker connection on ``unix://...?db=5`` both use database 5."""
    url = unix_socket_url(str(socket_redis.socket_path), 5)
    sync_client = sync_redis(url)
    app = make_celery(Settings(redis_url=url))
    queue_name = f"resq-test-queue-{uuid.uuid4().hex}"
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue(queue_name)
        try:
            queue.put({"checked": queue_name})
            message = queue.get(timeout=5)
            assert message.payload == {"checked": queue_name}
            message.ack()
            # kombu's binding record of the queue is in database 5, where the store's keys are.
            assert sync_client.exists(f"_kombu.binding.{queue_name}") == 1
            other = redis.Redis.from_url(unix_socket_url(str(socket_redis.socket_path), 0))
            assert other.exists(f"_kombu.binding.{queue_name}") == 0
            other.close()
        finally:
            queue.close()
    sync_client.close()
