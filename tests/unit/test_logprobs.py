"""Logprobs through detokenizer and parsers, and answers that start with a forced prefix."""

from __future__ import annotations

import itertools
import random
import types as pytypes
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from resq import jsonutil
from resq.catalog import TextTokenizer
from resq.events import builders as build
from resq.events import types
from resq.events.emitter import EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess.logprobs import LOWEST_LOGPROB, LogprobAligner
from resq.postprocess.parsers import forced_call_prefix
from resq.postprocess.processor import ResponseProcessor
from resq.postprocess.segments import ReasoningSegment, TextSegment
from resq.protocols import responses as processor_module
from resq.wire import FinishEntry, StartEntry, TokensEntry
from tests.support.invariants import check_stream
from tests.support.tokenizer import tiny_tokenizer
from tests.unit.test_events import RESPONSE_ID, base_response

EVENT = TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ANSWER = "<think>\nI need the weather.\n</think>\n\nLet me check. こんにちは 😀\n" + CALL + "\nDone."
MESSAGES = ("Let me check. こんにちは 😀\n", "\nDone.")


def options(**extra: Any) -> ProcessingOptions:
    return ProcessingOptions(
        model="tiny", reasoning_parser="qwen3", tool_parser="hermes", tools_enabled=True, **extra
    )


def fake_logprob(index: int) -> float:
    """A distinct value per token position, so an entry says which token it came from."""
    return -(index + 1) / 64


def process(
    tokenizer: TextTokenizer,
    chunks: list[list[int]],
    opts: ProcessingOptions,
    *,
    with_logprobs: bool = True,
    alternatives: list[tuple[int, float]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
    """``alternatives``: the top logprobs every token position gets, when given."""
    created = base_response()
    proc = ResponseProcessor(RESPONSE_ID, created, tokenizer, opts)
    encoded = [EventEmitter().emit(build.response_event(types.CREATED, created))]
    encoded += proc.on_entry(StartEntry(prompt_tokens=5))
    position = 0
    for chunk in chunks:
        logprobs = (
            [fake_logprob(position + offset) for offset in range(len(chunk))] if with_logprobs else None
        )
        tops = [alternatives] * len(chunk) if alternatives is not None else None
        encoded += proc.on_entry(TokensEntry(chunk, logprobs, top_logprobs=tops))
        position += len(chunk)
    encoded += proc.on_entry(FinishEntry("stop", 5, position))
    finished = proc.final_response()
    encoded.append(proc.terminal_event(finished.status, finished.response_json))
    events = [jsonutil.loads(event.data) for event in encoded]
    return events, jsonutil.loads(finished.response_json), proc.reasoning_tokens


def chunkings(token_ids: list[int], count: int, seed: int = 5) -> list[list[list[int]]]:
    rng = random.Random(seed)
    result = [[[token] for token in token_ids], [token_ids]]
    while len(result) < count:
        cuts = sorted(rng.sample(range(1, len(token_ids)), rng.randint(1, min(10, len(token_ids) - 1))))
        result.append([token_ids[a:b] for a, b in itertools.pairwise([0, *cuts, len(token_ids)])])
    return result


def expected_entries(tokenizer: TextTokenizer, text: str, shown: str) -> list[tuple[int, float]]:
    """Independently: (token id, logprob) of the tokens whose characters overlap ``shown`` in ``text``."""
    start = text.index(shown)
    end = start + len(shown)
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    return [
        (token_id, fake_logprob(index))
        for index, (token_id, (first, last)) in enumerate(zip(encoding.ids, encoding.offsets, strict=True))
        if first < end and last > start
    ]


def unnumbered_non_deltas(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events other than deltas, without their sequence numbers."""
    return [
        {k: v for k, v in e.items() if k != "sequence_number"}
        for e in events
        if not e["type"].endswith(".delta")
    ]


def test_text_logprobs_come_from_the_texts_own_tokens_for_any_chunking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processor_module, "time", pytypes.SimpleNamespace(time=lambda: 1_700_000_000))
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(ANSWER)
    reference = None
    for chunks in chunkings(token_ids, 24):
        events, final, _ = process(tokenizer, chunks, options(logprobs=True))
        if reference is None:
            reference = (events, final)
        assert final == reference[1]
        # One delta per entry and item (the processor joins an entry's segments): the numbering
        # follows the deltas, everything else is the same for any chunking...
        assert unnumbered_non_deltas(events) == unnumbered_non_deltas(reference[0])
        # ...and the deltas' logprobs add up to each done event's.
        for done in (e for e in events if e["type"] == types.OUTPUT_TEXT_DONE):
            deltas = [
                entry
                for e in events
                if e["type"] == types.OUTPUT_TEXT_DELTA and e["output_index"] == done["output_index"]
                for entry in e["logprobs"]
            ]
            assert deltas == done["logprobs"]
    assert reference is not None
    events, final = reference
    check_stream(events)
    for event in events:
        EVENT.validate_python(event)
    Response.model_validate(final)
    messages = [item for item in final["output"] if item["type"] == "message"]
    assert [item["content"][0]["text"] for item in messages] == list(MESSAGES)
    for item, shown in zip(messages, MESSAGES, strict=True):
        entries = item["content"][0]["logprobs"]
        expected = expected_entries(tokenizer, ANSWER, shown)
        assert [entry["logprob"] for entry in entries] == [logprob for _, logprob in expected]
        # Byte-level tokens: their bytes add up to the text, even where one holds half a character.
        assert b"".join(bytes(entry["bytes"]) for entry in entries).decode() == shown
        for entry, (token_id, _) in zip(entries, expected, strict=True):
            assert bytes(entry["bytes"]) == tokenizer.token_bytes(token_id)
            assert entry["top_logprobs"] == []
    # Events carry the same entries without the bytes; deltas add up to the done event's list.
    for index, item in enumerate(final["output"]):
        if item["type"] != "message":
            continue
        deltas = [
            entry
            for event in events
            if event["type"] == types.OUTPUT_TEXT_DELTA and event["output_index"] == index
            for entry in event["logprobs"]
        ]
        done = next(e for e in events if e["type"] == types.OUTPUT_TEXT_DONE and e["output_index"] == index)
        part_entries = [
            {k: v for k, v in entry.items() if k != "bytes"} for entry in item["content"][0]["logprobs"]
        ]
        assert deltas == done["logprobs"] == part_entries


def test_each_entry_lists_its_positions_alternatives() -> None:
    """Parts carry ``{token, bytes, logprob}`` alternatives, events ``{token, logprob}``, as the SDK
    types them; a special token (the end of the answer) shows its own spelling."""
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(ANSWER)
    end = tokenizer.card.eos_token_ids[0]
    word = tokenizer.encode("Hello")[0]
    events, final, _ = process(
        tokenizer,
        [token_ids[:7], token_ids[7:]],
        options(logprobs=True),
        alternatives=[(word, -0.1), (end, -2.5)],
    )
    Response.model_validate(final)
    for event in events:
        EVENT.validate_python(event)
    expected = [
        {"token": "Hello", "bytes": list(b"Hello"), "logprob": -0.1},
        {"token": tokenizer.spelling(end), "bytes": list(tokenizer.spelling(end).encode()), "logprob": -2.5},
    ]
    assert expected[1]["token"].startswith("<|")
    entries = [
        entry
        for item in final["output"]
        if item["type"] == "message"
        for entry in item["content"][0]["logprobs"]
    ]
    assert entries and all(entry["top_logprobs"] == expected for entry in entries)
    streamed = [
        entry for event in events if event["type"] == types.OUTPUT_TEXT_DELTA for entry in event["logprobs"]
    ]
    without_bytes = [{"token": top["token"], "logprob": top["logprob"]} for top in expected]
    assert len(streamed) == len(entries) and all(entry["top_logprobs"] == without_bytes for entry in streamed)


def test_without_logprobs_asked_none_are_given() -> None:
    tokenizer = tiny_tokenizer()
    _, final, _ = process(tokenizer, [tokenizer.encode(ANSWER)], options())
    assert all(item["content"][0]["logprobs"] == [] for item in final["output"] if item["type"] == "message")


def test_tokens_without_logprobs_from_the_engine_give_no_entries() -> None:
    tokenizer = tiny_tokenizer()
    _, final, _ = process(tokenizer, [tokenizer.encode(ANSWER)], options(logprobs=True), with_logprobs=False)
    assert all(item["content"][0]["logprobs"] == [] for item in final["output"] if item["type"] == "message")


def test_aligner_gives_each_token_once_and_skips_hidden_ones() -> None:
    tokenizer = tiny_tokenizer()
    aligner = LogprobAligner(tokenizer)
    hello = tokenizer.tokenizer.token_to_id("Hello") or tokenizer.encode("Hello")[0]
    aligner.add_token(0, hello, "ab", -0.5)  # chars 0-1: partly shown
    aligner.add_token(2, hello, "", float("-inf"))  # stands for char 2, not yet decoded
    aligner.add_token(2, hello, "cd", -0.25)  # chars 2-3
    aligner.add_token(4, hello, "ef", -0.125)  # hidden (e.g. reasoning)
    aligner.add_token(6, hello, "g", -1.0)
    out = aligner.attach([TextSegment("bc", start=1), ReasoningSegment("ef"), TextSegment("g", start=6)])
    first, hidden, last = out
    assert isinstance(first, TextSegment) and isinstance(last, TextSegment)
    assert [entry["logprob"] for entry in first.logprobs] == [-0.5, LOWEST_LOGPROB, -0.25]
    assert hidden == ReasoningSegment("ef")
    assert [entry["logprob"] for entry in last.logprobs] == [-1.0]


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("name", [None, "get_weather"])
def test_a_forced_prefix_is_parsed_as_output_but_never_counted(reasoning: str, name: str | None) -> None:
    tokenizer = tiny_tokenizer()
    prefix = forced_call_prefix(reasoning, "hermes", name)
    call_opening = prefix.removeprefix("</think>\n\n")
    assert CALL.startswith(call_opening)
    forced = tokenizer.encode(prefix)
    sampled = tokenizer.encode(CALL[len(call_opening) :])
    opts = ProcessingOptions(
        model="tiny",
        reasoning_parser=reasoning,
        tool_parser="hermes",
        tools_enabled=True,
        forced_prefix_ids=tuple(forced),
        logprobs=True,
    )
    for chunks in chunkings(sampled, 6):
        events, final, reasoning_tokens = process(tokenizer, chunks, opts)
        check_stream(events)
        assert [(item["type"], item.get("name")) for item in final["output"]] == [
            ("function_call", "get_weather")
        ]
        assert jsonutil.loads(final["output"][0]["arguments"]) == {"city": "Oslo"}
        assert reasoning_tokens == 0
        assert final["usage"]["output_tokens"] == len(sampled)


def test_nothing_is_forced_into_a_response_that_never_started() -> None:
    tokenizer = tiny_tokenizer()
    opts = options(forced_prefix_ids=tuple(tokenizer.encode("<tool_call>\n{")))
    proc = ResponseProcessor(RESPONSE_ID, base_response(), tokenizer, opts)
    assert proc.on_entry(FinishEntry("cancelled", 5, 0)) == []
    assert jsonutil.loads(proc.final_response().response_json)["output"] == []
