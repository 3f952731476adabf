"""The post-processing state machine on a real tokenizer: any chunking, same events."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from resq import jsonutil
from resq.events import builders as build
from resq.events import types
from resq.events.emitter import EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess.detokenizer import IncrementalDetokenizer
from resq.postprocess.processor import ResponseProcessor
from resq.wire import FinishEntry, StartEntry, TokensEntry
from tests.support.invariants import check_stream, output_text
from tests.support.tokenizer import tiny_tokenizer
from tests.unit.test_events import RESPONSE_ID, base_response

EVENT = TypeAdapter(ResponseStreamEvent)
TEXT = "Hello! こんにちは、世界！ 😀 The answer is 4."


def chunkings(token_ids: list[int], count: int, seed: int = 7) -> list[list[list[int]]]:
    """``count`` random ways to split ``token_ids`` into consecutive chunks (plus one token each)."""
    rng = random.Random(seed)
    result = [[[token] for token in token_ids], [token_ids]]
    while len(result) < count:
        cuts = sorted(rng.sample(range(1, len(token_ids)), rng.randint(1, min(8, len(token_ids) - 1))))
        bounds = [0, *cuts, len(token_ids)]
        result.append([token_ids[a:b] for a, b in itertools.pairwise(bounds)])
    return result


def process(chunks: list[list[int]], finish: str = "stop") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    tokenizer = tiny_tokenizer()
    created = base_response()
    processor = ResponseProcessor(RESPONSE_ID, created, tokenizer, ProcessingOptions(model="tiny"))
    emitter = EventEmitter()
    head = emitter.emit(build.response_event(types.CREATED, created))
    encoded = [head, *processor.on_entry(StartEntry(prompt_tokens=7))]
    output_tokens = 0
    for chunk in chunks:
        output_tokens += len(chunk)
        encoded += processor.on_entry(TokensEntry(chunk))
    encoded += processor.on_entry(FinishEntry(finish, 7, output_tokens))  # type: ignore[arg-type]
    finished = processor.final_response()
    encoded.append(processor.terminal_event(finished.status, finished.response_json))
    numbers = [event.sequence_number for event in encoded]
    assert numbers == list(range(len(encoded)))
    events = [jsonutil.loads(event.data) for event in encoded]
    for event in events:
        EVENT.validate_python(event)
    Response.model_validate(events[-1]["response"])
    return events, jsonutil.loads(finished.response_json)


def test_any_chunking_gives_the_same_events() -> None:
    token_ids = tiny_tokenizer().encode(TEXT)
    assert len(token_ids) > 10
    reference = None
    for chunks in chunkings(token_ids, 30):
        events, final = process(chunks)
        check_stream(events)
        assert output_text(final) == TEXT
        texts = "".join(event["delta"] for event in events if event["type"] == types.OUTPUT_TEXT_DELTA)
        assert texts == TEXT
        # Deltas differ with the chunking; the items, and the final output, never do.
        items = [event["item"] for event in events if event["type"] == types.OUTPUT_ITEM_DONE]
        if reference is None:
            reference = (items, final["output"])
        assert (items, final["output"]) == reference


def test_finish_reasons_map_to_statuses() -> None:
    token_ids = tiny_tokenizer().encode("Hello!")
    expectations = {
        "stop": ("completed", types.COMPLETED),
        "length": ("incomplete", types.INCOMPLETE),
        "error": ("failed", types.FAILED),
        "cancelled": ("cancelled", types.INCOMPLETE),
    }
    for reason, (status, terminal) in expectations.items():
        events, final = process([token_ids], finish=reason)
        assert final["status"] == status and events[-1]["type"] == terminal
        if reason == "length":
            assert final["incomplete_details"] == {"reason": "max_output_tokens"}
        if reason == "error":
            assert final["error"]["code"] == "server_error"
        if reason == "stop":
            assert final["completed_at"] is not None
        assert final["usage"]["output_tokens"] == len(token_ids)


def test_cancelled_before_start_has_no_in_progress() -> None:
    tokenizer = tiny_tokenizer()
    processor = ResponseProcessor(RESPONSE_ID, base_response(), tokenizer, ProcessingOptions(model="tiny"))
    assert processor.on_entry(FinishEntry("cancelled", 5, 0)) == []
    assert processor.final_response().status == "cancelled"


@pytest.mark.parametrize("text", [TEXT, "ǅ ∰ 𝄞 ☃ 🦓", "naïve café — ça va?"])
def test_detokenizer_holds_back_split_characters(text: str) -> None:
    """The multi-byte UTF-8 case: no delta ever carries half a character."""
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.feed([token]) for token in token_ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces), "a half character reached the output"
    # Where byte-level BPE split a character over several tokens, some steps yield nothing.
    if any("\ufffd" in tokenizer.decode([token]) for token in token_ids):
        assert "" in pieces
