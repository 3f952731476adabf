"""What the API process holds for its lifetime: clients, caches, pools."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from redis.asyncio import Redis as AsyncRedis

from api.inline import InlinePostprocessor
from api.store import ResponseStore
from resq import keys
from resq.catalog import AsyncModelCatalog
from resq.celery_app import make_celery
from resq.redis_client import async_redis
from resq.settings import Settings


@dataclass
class AppState:
    """Per-process state of the API, built at start-up and closed at shutdown."""

    settings: Settings
    redis: AsyncRedis
    catalog: AsyncModelCatalog
    store: ResponseStore
    celery: Celery
    inline: InlinePostprocessor | None
    # Celery's publisher is blocking: it runs on a few threads, off the event loop.
    publisher_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="celery-publish")
    )

    @classmethod
    def build(cls, settings: Settings) -> AppState:
        """Clients for ``settings``; nothing connects until first use."""
        redis = async_redis(settings.redis_url)
        return cls(
            settings=settings,
            redis=redis,
            catalog=AsyncModelCatalog(redis),
            store=ResponseStore(redis, settings.transient_ttl_s),
            celery=make_celery(settings),
            inline=InlinePostprocessor(settings) if settings.postprocess_workers == 0 else None,
        )

    async def send_task(self, name: str, queue: str, kwargs: dict[str, Any]) -> None:
        """Publish one Celery message without blocking the event loop."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            self.publisher_pool, lambda: self.celery.send_task(name, kwargs=kwargs, queue=queue)
        )

    async def start_postprocessing(self, response_id: str) -> None:
        """Hand the response to a post-process worker, or to the inline post-processor."""
        if self.inline is not None:
            self.inline.submit(response_id)
        else:
            await self.send_task(keys.POSTPROCESS_TASK, keys.POSTPROCESS_QUEUE, {"response_id": response_id})

    async def close(self) -> None:
        """Release everything."""
        if self.inline is not None:
            self.inline.close()
        self.publisher_pool.shutdown(wait=False)
        await self.redis.aclose()
