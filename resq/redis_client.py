"""Redis clients configured the same way in every role.

Connections retry on transient errors with backoff, so a restarted Redis is
picked up again without restarting resq's processes.
"""

from __future__ import annotations

from redis import Redis
from redis.asyncio import BlockingConnectionPool as AsyncBlockingConnectionPool
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from resq.redis_packing import with_plain_packer
from resq.redis_urls import transport_options

ASYNC_MAX_CONNECTIONS = 200
ASYNC_CONNECTION_WAIT_S = 30.0
_RETRY_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionResetError)


def sync_redis(url: str) -> Redis:
    """A blocking client (workers, the GPU publisher, the inline post-processor).

    Its connections pack plain commands in one C call (:mod:`resq.redis_packing`).
    """
    client = Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
        retry_on_error=list(_RETRY_ERRORS),
        health_check_interval=30,
        **transport_options(url),
    )
    pool = client.connection_pool
    pool.connection_class = with_plain_packer(pool.connection_class)
    return client


def async_redis(url: str) -> AsyncRedis:
    """An asyncio client (the API).

    Its pool makes a burst wait for a free connection rather than fail: redis-py's
    default async pool raises ``Too many connections`` past 100 at once, which
    turned a burst of a few hundred requests into 500s (``docs/benchmarks.md``, B4). Its
    connections pack plain commands in one C call (:mod:`resq.redis_packing`).
    """
    pool = AsyncBlockingConnectionPool.from_url(
        url,
        max_connections=ASYNC_MAX_CONNECTIONS,
        timeout=ASYNC_CONNECTION_WAIT_S,
        retry=AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
        retry_on_error=list(_RETRY_ERRORS),
        health_check_interval=30,
        **transport_options(url),
    )
    pool.connection_class = with_plain_packer(pool.connection_class)
    return AsyncRedis.from_pool(pool)
