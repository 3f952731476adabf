"""B3: post-process throughput, with a synthetic token source instead of the GPU worker.

The bench writes what the API would (the response record, ``response.created``
in the event log, one Celery message per response), then publishes the token
streams the way the GPU worker's publisher does: one pipelined round trip per
"engine step" carrying one token for every response, as fast as Redis takes
them. Post-process workers turn them into events; the figure is events logged
per second, from the first token published to the last terminal event logged.

The builder baseline feeds the same entries to the same
:class:`~resq.postprocess.processor.ResponseProcessor` in a tight loop in
this process: no Redis, no Celery, no threads.
"""

from __future__ import annotations

import json
import time
from typing import Any

from redis import Redis
from tokenizers import Tokenizer

from bench.models import BenchModel
from bench.token_streams import SyntheticStream
from resq import ids, jsonutil, keys
from resq.catalog import ModelCard, TextTokenizer, register_model, tokenizer_sha256
from resq.events import builders as build
from resq.events import types
from resq.events.emitter import EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess.processor import ResponseProcessor
from resq.wire import FinishEntry, StartEntry, TokensEntry, encode_entry

PROMPT_TOKENS = 24
DONE_POLL_S = 0.05


def card_from_dir(model: BenchModel) -> tuple[ModelCard, str]:
    """The model card a GPU worker would register for ``model``, read from its files (no torch)."""
    path = model.path
    tokenizer_json = (path / "tokenizer.json").read_text()
    config = json.loads((path / "config.json").read_text())
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    eos = generation.get("eos_token_id")
    card = ModelCard(
        name=model.served_name,
        context_length=int(config["max_position_embeddings"]),
        chat_template=(path / "chat_template.jinja").read_text(),
        special_tokens={
            key: value
            for key, value in tokenizer_config.items()
            if key.endswith("_token") and isinstance(value, str)
        },
        eos_token_ids=sorted([eos] if isinstance(eos, int) else eos or []),
        tokenizer_sha256=tokenizer_sha256(tokenizer_json),
        created=int(time.time()),
        source=str(path),
    )
    return card, tokenizer_json


def register(redis: Redis, model: BenchModel) -> TextTokenizer:
    """Register ``model``'s card and tokenizer; its :class:`TextTokenizer`."""
    card, tokenizer_json = card_from_dir(model)
    register_model(redis, card, tokenizer_json)
    return TextTokenizer(card, Tokenizer.from_str(tokenizer_json))


def _options(model_name: str, stream: SyntheticStream) -> ProcessingOptions:
    return ProcessingOptions(
        model=model_name, first_sequence_number=1, reasoning_parser="qwen3" if stream.reasoning else None
    )


def _created(response_id: str, model_name: str) -> dict[str, Any]:
    from api.schemas import CreateResponseRequest
    from api.submission import initial_response

    request = CreateResponseRequest(model=model_name, input="Tell me about Python.", stream=True)
    return initial_response(request, response_id, model_name, background=False, store=True)


def create_responses(
    redis: Redis, model_name: str, streams: list[SyntheticStream], ttl_s: int = 3600
) -> list[str]:
    """Write the records and first events the API would write; the new response ids."""
    response_ids = []
    pipe = redis.pipeline(transaction=False)
    for stream in streams:
        response_id = ids.new_response_id()
        response_ids.append(response_id)
        created = _created(response_id, model_name)
        created_json = jsonutil.dumps(created)
        event = EventEmitter(0).emit(build.response_event(types.CREATED, created))
        pipe.hset(
            keys.record(response_id),
            mapping={
                "status": "in_progress",
                "created": created_json,
                "response": created_json,
                "options": _options(model_name, stream).model_dump_json(),
                "store": "1",
                "background": "0",
                "owner": "",
            },
        )
        pipe.xadd(
            keys.events(response_id), {"type": event.type, "data": event.data}, id=keys.event_entry_id(0)
        )
        pipe.set(keys.input_items(response_id), b'{"items":[],"messages":[]}', ex=ttl_s)
    pipe.execute()
    return response_ids


def publish(redis: Redis, response_ids: list[str], streams: list[SyntheticStream]) -> None:
    """Publish every stream as the GPU worker would: one pipelined round trip per step."""
    pipe = redis.pipeline(transaction=False)
    for response_id in response_ids:
        pipe.xadd(keys.tokens(response_id), encode_entry(StartEntry(PROMPT_TOKENS)))
    pipe.execute()
    steps = max(len(stream.token_ids) for stream in streams)
    for step in range(steps):
        pipe = redis.pipeline(transaction=False)
        for response_id, stream in zip(response_ids, streams, strict=True):
            if step < len(stream.token_ids):
                # Placed, as the GPU worker's publisher sends them (the position of the token).
                entry = TokensEntry([stream.token_ids[step]], start=step)
                pipe.xadd(keys.tokens(response_id), encode_entry(entry))
        pipe.execute()
    pipe = redis.pipeline(transaction=False)
    for response_id, stream in zip(response_ids, streams, strict=True):
        finish = FinishEntry("length", PROMPT_TOKENS, len(stream.token_ids))
        pipe.xadd(keys.tokens(response_id), encode_entry(finish))
    pipe.execute()


def wait_all_final(redis: Redis, response_ids: list[str], timeout_s: float) -> float:
    """Wait until every response has its final Response stored; the time it happened."""
    deadline = time.monotonic() + timeout_s
    pending = list(response_ids)
    while pending:
        pipe = redis.pipeline(transaction=False)
        for response_id in pending:
            pipe.xrevrange(keys.events(response_id), count=1)
        now = time.perf_counter()
        replies = pipe.execute()
        pending = [
            response_id
            for response_id, reply in zip(pending, replies, strict=True)
            if not reply or reply[0][1].get(b"type") not in types.TERMINAL_TYPES_BYTES
        ]
        if not pending:
            return now
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} responses did not finish post-processing in {timeout_s:.0f}s")
        time.sleep(DONE_POLL_S)
    return time.perf_counter()


def count_events(redis: Redis, response_ids: list[str]) -> int:
    """Events the post-processors logged (``response.created``, logged by the 'API', excluded)."""
    pipe = redis.pipeline(transaction=False)
    for response_id in response_ids:
        pipe.xlen(keys.events(response_id))
    return sum(int(length) - 1 for length in pipe.execute())


def run_through_workers(
    redis: Redis, send_postprocess: Any, model_name: str, streams: list[SyntheticStream], timeout_s: float
) -> tuple[int, float]:
    """Post-process ``streams`` through the running workers; (events, seconds)."""
    response_ids = create_responses(redis, model_name, streams)
    for response_id in response_ids:
        send_postprocess(response_id)
    started = time.perf_counter()
    publish(redis, response_ids, streams)
    ended = wait_all_final(redis, response_ids, timeout_s)
    events = count_events(redis, response_ids)
    pipe = redis.pipeline(transaction=False)
    for response_id in response_ids:
        pipe.delete(*keys.all_keys(response_id))
    pipe.execute()
    return events, ended - started


def run_builder(
    tokenizer: TextTokenizer, model_name: str, streams: list[SyntheticStream]
) -> tuple[int, float]:
    """The same streams through :class:`ResponseProcessor` alone, in a tight loop; (events, seconds)."""
    created = _created("resp_builder", model_name)
    started = time.perf_counter()
    events = 0
    for index, stream in enumerate(streams):
        processor = ResponseProcessor(
            f"resp_builder{index}", created, tokenizer, _options(model_name, stream)
        )
        events += len(processor.on_entry(StartEntry(PROMPT_TOKENS)))
        for token_id in stream.token_ids:
            events += len(processor.on_entry(TokensEntry([token_id])))
        events += len(processor.on_entry(FinishEntry("length", PROMPT_TOKENS, len(stream.token_ids))))
        finished = processor.final_response()
        processor.terminal_event(finished.status, finished.response_json)
        events += 1
    return events, time.perf_counter() - started
