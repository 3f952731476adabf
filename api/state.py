"""What the API process holds for its lifetime: clients, caches, pools."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Concatenate, NamedTuple, ParamSpec, TypeVar

from celery import Celery
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.commands.core import AsyncScript

from api import metrics as api_metrics
from api.auth import KeyRing, parse_api_keys
from api.conversations import ConversationStore
from api.event_hub import EventHub
from api.inline import InlinePostprocessor
from api.rate_limit import RateLimiter
from api.store import ResponseStore
from resq import affinity, keys
from resq.catalog import WARM_UP_POLL_S, WARM_UP_WAIT_S, AsyncModelCatalog
from resq.celery_app import make_celery
from resq.guarded_step import GuardedStep
from resq.heartbeat import new_worker_id
from resq.recovery import generations
from resq.recovery.dispatch import queue_generation, queue_postprocessing, send_generation
from resq.recovery.leases import register_lease
from resq.recovery.reaper import Reaper
from resq.redis_client import async_redis, sync_redis
from resq.sealed import Sealer, sealer_from_settings
from resq.settings import Settings
from resq.startup_heap import freeze_startup_heap
from resq.task_messages import TaskMessages

log = logging.getLogger(__name__)

WARM_UP_OWNER = "resq-warm-up"
"""The prompt-piece owner of the warm-up's prompt (no caller is named so: it only builds the pieces'
splitter, as a request's first prompt would)."""

P = ParamSpec("P")
R = TypeVar("R")


def _prompt_threads() -> int:
    """Threads that render and tokenize prompts: at most 4, and one core left to the event loop."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores - 1))


ACCEPT_CONCURRENCY = 64
"""How many requests one API process accepts (prompt, admission, the recording step) at once.

A burst of thousands of requests otherwise all run their accept at once: every step of each
queues behind every other request's on the loop and the Redis pool, some waited past the
pool's 30 s for a connection, and all their prompts, jobs and messages were alive together
(B4's 4,000 streams, ``docs/benchmarks.md``: 2,353-2,720 held, at 360-450 KB each). Waiting here, a
request holds only its parsed body."""


class AcceptSlots:
    """At most ``size`` requests inside :func:`api.submission.accept` at once.

    Re-entrant within a task (a compaction accepts its summary from inside an accept), and a
    slot can be given back while its holder waits for something slow (that summary's end), so
    that a few long waits never keep every other request out.
    """

    def __init__(self, size: int) -> None:
        self._semaphore = asyncio.Semaphore(size)
        self._held: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar(
            "resq_accept_slot", default=None
        )

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Hold a slot for the block (at once when this task holds one already)."""
        held = self._held.get()
        if held is not None and held.task is asyncio.current_task():
            yield
            return
        slot = _Slot(asyncio.current_task())
        await self._semaphore.acquire()
        slot.held = True
        token = self._held.set(slot)
        try:
            yield
        finally:
            self._held.reset(token)
            if slot.held:
                self._semaphore.release()

    @contextlib.asynccontextmanager
    async def given_up(self) -> AsyncIterator[None]:
        """Give this task's slot back for the block, and take one again after it."""
        slot = self._held.get()
        if slot is None or slot.task is not asyncio.current_task() or not slot.held:
            yield
            return
        slot.held = False
        self._semaphore.release()
        try:
            yield
        finally:
            await self._semaphore.acquire()  # cancelled here: holds none, and gives none back
            slot.held = True


@dataclass
class _Slot:
    task: asyncio.Task[object] | None
    """The task that took it (a task it starts copies the context, not the slot)."""
    held: bool = False


def in_an_accept_slot(
    accepting: Callable[Concatenate[AppState, P], Awaitable[R]],
) -> Callable[Concatenate[AppState, P], Awaitable[R]]:
    """``accepting`` run in one of its first argument's :attr:`AppState.accept_slots`."""

    @functools.wraps(accepting)
    async def in_a_slot(state: AppState, /, *args: P.args, **kwargs: P.kwargs) -> R:
        async with state.accept_slots.hold():
            return await accepting(state, *args, **kwargs)

    return in_a_slot


class Routed(NamedTuple):
    """Where :meth:`AppState.route_generation` sends a job."""

    outcome: affinity.Outcome | None
    """``hit``, ``fallback`` or ``none``; None when the request named no prefix to follow."""
    worker: str | None
    """The GPU worker whose own queue takes the job; None: the model's shared queue."""


@dataclass
class AppState:
    """Per-process state of the API, built at start-up and closed at shutdown."""

    settings: Settings
    redis: AsyncRedis
    catalog: AsyncModelCatalog
    store: ResponseStore
    conversations: ConversationStore
    celery: Celery
    task_messages: TaskMessages
    """Builds the Celery messages that go out in the step recording a response (:mod:`resq.task_messages`)."""
    inline: InlinePostprocessor | None
    # Finds lost work (dead GPU workers, dead post-processors, lost messages); see resq.recovery.
    reaper_redis: Redis
    reaper: Reaper
    keyring: KeyRing
    rate_limiter: RateLimiter | None
    sealer: Sealer
    """Opens the ``encrypted_content`` blobs clients send back (the post-processors seal them)."""
    # A few MB of input take seconds to render and tokenize: never on the event loop, and on
    # a bounded pool, so that hostile requests queue behind each other, not behind every stream.
    prompt_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=_prompt_threads(), thread_name_prefix="prompt")
    )
    accept_slots: AcceptSlots = field(default_factory=lambda: AcceptSlots(ACCEPT_CONCURRENCY))
    """Requests being accepted at once; the rest wait their turn."""
    guarded_step: GuardedStep = field(init=False)
    """Runs the step recording a new response behind its admission, in one round trip."""
    _route: AsyncScript = field(init=False)
    """:data:`resq.affinity.ROUTE_LUA`, sent by its sha (not its text with every routed request)."""

    def __post_init__(self) -> None:
        self.guarded_step = GuardedStep(self.redis)
        self._route = self.redis.register_script(affinity.ROUTE_LUA)

    @classmethod
    def build(cls, settings: Settings) -> AppState:
        """Clients for ``settings`` (nothing connects until first use), and a running reaper."""
        keyring = load_keyring(settings)
        redis = async_redis(settings.redis_url)
        celery = make_celery(settings)
        holder_id = new_worker_id("api")
        inline = InlinePostprocessor(settings, holder_id) if settings.postprocess_workers == 0 else None
        reaper_redis = sync_redis(settings.redis_url)
        reaper = Reaper(
            reaper_redis,
            settings,
            holder_id,
            send_generation=lambda response_id, model: send_generation(celery, response_id, model),
            take_over_postprocessing=inline.take_over_lapsed if inline is not None else None,
        )
        reaper.start()
        return cls(
            settings=settings,
            redis=redis,
            catalog=AsyncModelCatalog(redis, settings.worker_ttl_s),
            store=ResponseStore(redis, settings.transient_ttl_s),
            conversations=ConversationStore(redis, settings.store_ttl_s),
            celery=celery,
            task_messages=TaskMessages(celery),
            inline=inline,
            reaper_redis=reaper_redis,
            reaper=reaper,
            keyring=keyring,
            rate_limiter=RateLimiter(redis, settings.rate_limit_rpm) if settings.rate_limit_rpm else None,
            sealer=sealer_from_settings(settings),
        )

    async def off_loop(self, function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``function(*args, **kwargs)`` on the prompt pool, in this task's context (log tags)."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return await loop.run_in_executor(
            self.prompt_pool, functools.partial(context.run, function, *args, **kwargs)
        )

    def stage_admission(self, pipe: AsyncPipeline, response_id: str, owner: str) -> None:
        """Queue the count of a new response's generation against ``RESQ_MAX_PENDING``, and against
        the caller's share (``RESQ_MAX_PENDING_PER_KEY``, when set and the caller has a key): the
        last guard of the step that records the response (:mod:`resq.guarded_step`, run by
        :attr:`guarded_step`), the one guard that writes."""
        settings = self.settings
        generations.admit(
            pipe,
            response_id,
            time.time(),
            settings.max_pending,
            owner,
            settings.max_pending_per_key,
            settings.transient_ttl_s,
        )

    async def cluster_full(self) -> bool:
        """Whether ``RESQ_MAX_PENDING`` generations are listed (after a refused admission: was it
        the cluster's bound or the caller's share?)."""
        return int(await self.redis.zcard(keys.GENERATIONS)) >= self.settings.max_pending

    def stage_recovery(self, pipe: AsyncPipeline, response_id: str) -> None:
        """Queue, in the step that records the response, its registration with the reaper: from
        that step on, if this process dies, its generation job or its post-processor is
        dispatched again. (One step with the record: a separate round trip before it cost a
        pipeline per request.)"""
        register_lease(pipe, response_id, self.settings.postprocess_lease_s)

    async def route_generation(self, model: str, lookup: tuple[str, ...]) -> Routed:
        """The GPU worker whose own queue a job goes to: the one that served its prefix last, when
        ``lookup`` names one that can take it (:mod:`resq.affinity`); None: the model's shared queue.
        No round trip without ``lookup``. Counted by :meth:`count_routed` once the job is admitted."""
        if not lookup:
            return Routed(None, None)
        reply = await self._route(keys=list(lookup), args=[affinity.WORKER_DETAILS_TEMPLATE, model])
        return Routed(*affinity.parse_route(reply))

    @staticmethod
    def count_routed(routed: Routed) -> None:
        """Count an admitted job's routing in the affinity metrics (a refused one is not routed)."""
        if routed.outcome is not None:
            api_metrics.AFFINITY_ROUTED.labels(routed.outcome).inc()

    async def warm_up(self) -> None:
        """Open the broker channel the task messages are built with before the first request needs
        it: opening it (Celery's AMQP machinery imported, a ping to Redis) added ~70 ms to the first
        response after a start. Best effort: with Redis away, the first request opens it instead.
        On a thread of its own, not the prompt pool's: kombu retries a refused connection for ~6 s
        (an API stopped within those seconds of its start waits for the thread to give up)."""
        try:
            await asyncio.to_thread(self.task_messages.connect)
        except Exception as error:  # Redis not there yet: nothing lost, the first request retries
            log.debug("the broker channel was not opened ahead of the first request: %s", error)
        await self._warm_tokenizers()
        freeze_startup_heap(collect=False)  # the tokenizers and the broker's channel too

    async def _warm_tokenizers(self) -> None:
        """Fetch and build the served models' tokenizers, and render one prompt with each, once a GPU
        worker has registered its model (polled for up to :data:`WARM_UP_WAIT_S`): the first request
        otherwise did it (~15 ms on the built-in model; a real vocabulary's tokenizer.json is
        megabytes to parse). The prompt is rendered as a request's is, with the context's bound and
        an owner, so that the length bound and the prompt's piece splitter are built too (~3.5 ms of
        the first request's before). Best effort, as :meth:`warm_up`."""
        deadline = time.monotonic() + WARM_UP_WAIT_S
        while time.monotonic() < deadline:
            try:
                cards = await self.catalog.cards()
                for card in cards:
                    tokenizer = await self.catalog.get(card.name)
                    if tokenizer is not None:
                        await self.off_loop(
                            tokenizer.prompt_ids,
                            [{"role": "user", "content": "Hello."}],
                            max_tokens=tokenizer.card.context_length,
                            cache_owner=WARM_UP_OWNER,
                        )
            except Exception as error:  # nothing lost: the first request builds what is missing
                log.debug("the tokenizers were not built ahead of the first request: %s", error)
                return
            if cards:
                return
            await asyncio.sleep(WARM_UP_POLL_S)

    async def queue_messages(
        self, pipe: AsyncPipeline, response_id: str, model: str, worker: str | None
    ) -> None:
        """Queue, in the step that records the response, its generation message (to ``worker``'s
        own queue, or the shared one) and its post-processing message (unless this API
        post-processes inline: :meth:`start_inline`). The first call opens the broker channel the
        messages are built with, off the loop (it pings Redis)."""
        if not self.task_messages.connected:
            await self.off_loop(self.task_messages.connect)
        queue_generation(self.task_messages, pipe, response_id, model, worker)
        if self.inline is None:
            queue_postprocessing(self.task_messages, pipe, response_id)

    def start_inline(self, response_id: str) -> None:
        """Post-process ``response_id`` in this process, when it has the inline post-processor."""
        if self.inline is not None:
            self.inline.submit(response_id)

    async def close(self) -> None:
        """Release everything."""
        self.reaper.stop()
        if self.inline is not None:
            self.inline.close()
        self.task_messages.close()
        self.prompt_pool.shutdown(wait=False, cancel_futures=True)
        self.reaper_redis.close()
        await EventHub.close_for(self.redis)
        await self.redis.aclose()


def load_keyring(settings: Settings) -> KeyRing:
    """The API keys of ``settings`` (a bad key file stops the start-up); warns once when there are none."""
    api_keys = parse_api_keys(settings.api_keys.get_secret_value() if settings.api_keys else None)
    secret = settings.owner_secret.get_secret_value().encode() if settings.owner_secret else None
    keyring = KeyRing(api_keys, secret)
    if keyring.open:
        log.warning(
            "RESQ_API_KEYS is empty: /v1 is open to anyone who can reach this port, and every "
            "caller shares the same responses (docs/security.md)"
        )
    else:
        log.info("API keys: %d configured; /v1 requires one", len(keyring))
    return keyring
