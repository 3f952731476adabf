"""Publishing engine output to Redis, one pipelined round trip per engine step.

A thread of its own drains the engine's output queue: the new tokens of every
active request go out as ``XADD``s in one pipeline, and the same round trip asks
whether any active request was cancelled (client gone, ``POST .../cancel``), so
cancellation costs no extra trip and the GPU stops spending steps within one
step of the flag appearing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from redis import Redis
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from gpu_worker import metrics
from gpu_worker.engine import Engine
from resq import keys
from resq.logs import about
from resq.wire import FinishEntry, FinishReason, StartEntry, TokensEntry, encode_entry

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
"""How long the publisher waits for engine output before re-checking cancellations."""


@dataclass
class _Tracked:
    prompt_tokens: int
    end_tokens: frozenset[int]
    """Tokens whose appearance last means the request stopped (rather than hit its limit)."""
    logprobs: bool = False
    published: int = 0


class TokenPublisher:
    """Moves tokens from the engine to the responses' token streams."""

    def __init__(self, redis: Redis, engine: Engine, stream_ttl_s: int) -> None:
        self._redis = redis
        self._engine = engine
        self._stream_ttl_s = stream_ttl_s
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="token-publisher", daemon=True)
        self.fatal_error: BaseException | None = None

    # --- called from the Celery task thread ----------------------------------------------------

    def start_request(
        self,
        response_id: str,
        prompt_tokens: int,
        stop_token_ids: Iterable[int] = (),
        logprobs: bool = False,
    ) -> None:
        """Track a request the engine is about to take, and publish its start entry."""
        end_tokens = self._engine.eos_token_ids | frozenset(stop_token_ids)
        with self._lock:
            self._tracked[response_id] = _Tracked(prompt_tokens, end_tokens, logprobs)
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(keys.tokens(response_id), encode_entry(StartEntry(prompt_tokens)))
        pipe.expire(keys.tokens(response_id), self._stream_ttl_s)
        pipe.execute()

    def finish_unstarted(
        self, response_id: str, prompt_tokens: int, reason: FinishReason, error: str | None
    ) -> None:
        """Publish the end of a request that never reached the engine."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(keys.tokens(response_id), encode_entry(FinishEntry(reason, prompt_tokens, 0, error)))
        pipe.expire(keys.tokens(response_id), self._stream_ttl_s)
        pipe.execute()

    def forget(self, response_id: str) -> None:
        """Stop tracking a request the engine refused."""
        with self._lock:
            self._tracked.pop(response_id, None)

    @property
    def active_count(self) -> int:
        """Requests in the engine now."""
        return len(self._tracked)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the publishing thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop publishing (the engine may stop afterwards without it counting as a failure)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def fail_remaining(self, message: str) -> None:
        """End every request still tracked with an error (the worker is going away)."""
        self._fail_all(message)

    # --- the publishing loop -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                outputs = self._engine.next_outputs(IDLE_WAIT_S)
                self._publish(outputs)
                if not self._engine.is_running() and not self._stop.is_set():
                    self._fail_all("The generation engine stopped unexpectedly.")
                    self.fatal_error = RuntimeError("engine thread died")
                    return
            except Exception as exc:  # keep publishing through Redis hiccups
                log.exception("publishing tokens failed; retrying")
                self._stop.wait(0.2)
                if self._stop.is_set():
                    self.fatal_error = exc

    def _publish(self, outputs: list[GenerationOutput]) -> None:
        latest: dict[str, GenerationOutput] = {}
        for output in outputs:  # outputs are cumulative: the last one per request says it all
            latest[output.request_id] = output
        with self._lock:
            active = list(self._tracked)
        if not latest and not active:
            return
        pipe = self._redis.pipeline(transaction=False)
        ended: list[str] = []
        published = 0
        for response_id, output in latest.items():
            tracked = self._tracked.get(response_id)
            if tracked is None:  # cancelled meanwhile; its end is already published
                continue
            new_tokens = output.generated_tokens[tracked.published :]
            # NOMKSTREAM: a response deleted mid-generation must not get its stream back
            # (without a TTL); its start entry created the stream, nothing else may.
            if new_tokens:
                logprobs = None
                if tracked.logprobs and len(output.logprobs) == len(output.generated_tokens):
                    logprobs = list(output.logprobs[tracked.published :])
                pipe.xadd(
                    keys.tokens(response_id),
                    encode_entry(TokensEntry(list(new_tokens), logprobs)),
                    nomkstream=True,
                )
                tracked.published += len(new_tokens)
                published += len(new_tokens)
            if output.is_finished():
                finish = self._finish_entry(output, tracked)
                pipe.xadd(keys.tokens(response_id), encode_entry(finish), nomkstream=True)
                ended.append(response_id)
                log.info(
                    "generation ended: %s, %d tokens",
                    finish.finish_reason,
                    finish.output_tokens,
                    extra=about(response_id),
                )
        checked = [response_id for response_id in active if response_id not in ended]
        for response_id in checked:
            pipe.exists(keys.cancel(response_id))
        results = pipe.execute()
        metrics.note_published(published)
        for response_id in ended:
            self._end(response_id)
        cancelled = [
            rid for rid, flag in zip(checked, results[len(results) - len(checked) :], strict=True) if flag
        ]
        if cancelled:
            self._cancel(cancelled)

    def _finish_entry(self, output: GenerationOutput, tracked: _Tracked) -> FinishEntry:
        generated = len(output.generated_tokens)
        if output.status == RequestStatus.FAILED or output.error is not None:
            return FinishEntry("error", tracked.prompt_tokens, generated, output.error or "generation failed")
        last = output.generated_tokens[-1] if output.generated_tokens else None
        reason: FinishReason = "stop" if last in tracked.end_tokens else "length"
        return FinishEntry(reason, tracked.prompt_tokens, generated)

    def _end(self, response_id: str) -> None:
        with self._lock:
            removed = self._tracked.pop(response_id, None)
        if removed is not None:
            self._engine.release_slot()

    def _cancel(self, response_ids: list[str]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for response_id in response_ids:
            tracked = self._tracked.get(response_id)
            if tracked is None:
                continue
            self._engine.cancel(response_id)
            entry = FinishEntry("cancelled", tracked.prompt_tokens, tracked.published)
            pipe.xadd(keys.tokens(response_id), encode_entry(entry), nomkstream=True)
            log.info("cancelled %s after %d tokens", response_id, tracked.published, extra=about(response_id))
        pipe.execute()
        for response_id in response_ids:
            self._end(response_id)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            tracked = dict(self._tracked)
        pipe = self._redis.pipeline(transaction=False)
        for response_id, state in tracked.items():
            pipe.xadd(
                keys.tokens(response_id),
                encode_entry(FinishEntry("error", state.prompt_tokens, state.published, message)),
                nomkstream=True,
            )
        pipe.execute()
        for response_id in tracked:
            self._end(response_id)
