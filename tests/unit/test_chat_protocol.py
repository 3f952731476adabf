"""The chat protocol end to end through the post-processor, validated against the openai SDK's models."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from api.chat import completion_template
from resq import jsonutil
from resq.catalog import TextTokenizer
from resq.events import types
from resq.events.emitter import EncodedEvent
from resq.options import ProcessingOptions
from resq.postprocess.processor import ResponseProcessor
from resq.protocols.chat import call_id
from resq.wire import FailureCode, FinishEntry, FinishReason, StartEntry, TokensEntry
from tests.support.tokenizer import tiny_tokenizer
from tests.unit.test_parsers import ANSWER, call, expected_reasoning_tokens, random_chunkings
from tests.unit.test_parsers import tiny_tokenizer as parser_tokenizer

RESPONSE_ID = "resp_" + "2" * 32
TEMPLATE: dict[str, Any] = {**completion_template(RESPONSE_ID, "tiny"), "created": 1_700_000_000}
TEXT = "Hello! こんにちは、世界！ 😀 The answer is 4."
PROMPT_TOKENS = 7

REASONING = "考えています… 😀 I need the weather."
"""The reasoning of ``ANSWER`` (trimmed), then ``Let me check.\\n`` and a get_weather call for Oslo."""


def chat_options(**changes: Any) -> ProcessingOptions:
    return ProcessingOptions(model="tiny", protocol="chat", **changes)


def reasoning_and_tools(**changes: Any) -> ProcessingOptions:
    return chat_options(reasoning_parser="qwen3", tool_parser="hermes", tools_enabled=True, **changes)


def logprob_at(position: int) -> float:
    """The logprob the fake engine reports for the token at ``position`` of the output."""
    return -0.01 * (position + 1)


@dataclass
class Assembled:
    """What a client makes of the deltas."""

    content: str = ""
    reasoning: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


@dataclass
class ChatRun:
    encoded: list[EncodedEvent]
    """Every event but the terminal one."""
    chunks: list[dict[str, Any]]
    terminal: EncodedEvent
    final: dict[str, Any]
    status: str
    processor: ResponseProcessor

    @property
    def data(self) -> list[bytes]:
        """The log's bytes, terminal event included."""
        return [event.data for event in [*self.encoded, self.terminal]]


def run_chat(
    tokenizer: TextTokenizer,
    token_chunks: list[list[int]],
    opts: ProcessingOptions,
    *,
    finish: FinishReason = "stop",
    output_tokens: int | None = None,
    error: str | None = None,
    cached_tokens: int = 0,
    error_code: FailureCode = "server_error",
) -> ChatRun:
    """The token stream through a processor; every chunk and the terminal event checked."""
    processor = ResponseProcessor(RESPONSE_ID, TEMPLATE, tokenizer, opts)
    encoded = processor.on_entry(StartEntry(prompt_tokens=PROMPT_TOKENS))
    position = 0
    for chunk in token_chunks:
        logprobs = [logprob_at(position + i) for i in range(len(chunk))] if opts.logprobs else None
        encoded += processor.on_entry(TokensEntry(chunk, logprobs))
        position += len(chunk)
    count = position if output_tokens is None else output_tokens
    encoded += processor.on_entry(FinishEntry(finish, PROMPT_TOKENS, count, error, cached_tokens, error_code))
    finished = processor.final_response()
    terminal = processor.terminal_event(finished.status, finished.response_json)

    numbers = [event.sequence_number for event in [*encoded, terminal]]
    first = opts.first_sequence_number
    assert numbers == list(range(first, first + len(numbers)))
    chunks = []
    for event in encoded:
        assert event.type == types.CHAT_CHUNK
        assert b"sequence_number" not in event.data
        chunk = jsonutil.loads(event.data)
        ChatCompletionChunk.model_validate(chunk, strict=False)
        chunks.append(chunk)
    # The terminal event is the stored final object, byte for byte.
    assert terminal.data == finished.response_json
    final = jsonutil.loads(finished.response_json)
    if finished.status in ("completed", "incomplete"):
        assert terminal.type == types.CHAT_DONE
        ChatCompletion.model_validate(final, strict=False)
    else:
        assert terminal.type == types.CHAT_FAILED
        assert set(final) == {"error"}
        kind = "invalid_request_error" if error_code == "invalid_prompt" else "server_error"
        assert isinstance(final["error"]["message"], str) and final["error"]["type"] == kind
    return ChatRun(encoded, chunks, terminal, final, finished.status, processor)


def check_chunks(result: ChatRun, opts: ProcessingOptions) -> Assembled:
    """The stream's shape, and the final completion agreeing with it."""
    chunks = result.chunks
    assert chunks, "no chunks at all"
    envelope = {**TEMPLATE, "object": "chat.completion.chunk"}
    for chunk in chunks:
        assert {key: chunk[key] for key in envelope} == envelope
        if opts.include_usage:
            assert "usage" in chunk
        else:
            assert "usage" not in chunk
    with_choices = chunks[:-1] if opts.include_usage else chunks
    if opts.include_usage:
        assert chunks[-1]["choices"] == [] and isinstance(chunks[-1]["usage"], dict)
    assert all(chunk["choices"] for chunk in with_choices)
    assert all(chunk.get("usage") is None for chunk in with_choices)

    # The role first, and once.
    assert with_choices[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sum("role" in chunk["choices"][0]["delta"] for chunk in with_choices) == 1
    # One finish_reason, on the last chunk with a choice, with an empty delta.
    finishing = [chunk for chunk in with_choices if chunk["choices"][0]["finish_reason"] is not None]
    assert len(finishing) == 1 and finishing[0] is with_choices[-1]
    assert with_choices[-1]["choices"][0]["delta"] == {}

    assembled = Assembled(finish_reason=finishing[0]["choices"][0]["finish_reason"])
    if opts.include_usage:
        assembled.usage = chunks[-1]["usage"]
    for chunk in with_choices:
        [choice] = chunk["choices"]
        assert choice["index"] == 0
        delta = choice["delta"]
        if delta.get("content"):
            assert set(delta) == {"content"}
            assembled.content += delta["content"]
            if opts.logprobs:
                assert choice["logprobs"]["refusal"] is None
                assembled.logprobs += choice["logprobs"]["content"]
            else:
                assert choice["logprobs"] is None
        else:
            assert choice["logprobs"] is None
        if "reasoning_content" in delta:
            assert set(delta) == {"reasoning_content"} and delta["reasoning_content"]
            assembled.reasoning += delta["reasoning_content"]
        if "tool_calls" in delta:
            assert set(delta) == {"tool_calls"}
            assembled.calls += delta["tool_calls"]
    assert [call["index"] for call in assembled.calls] == list(range(len(assembled.calls)))

    if result.terminal.type == types.CHAT_DONE:
        final = result.final
        assert {key: final[key] for key in TEMPLATE if key != "object"} == {
            key: value for key, value in TEMPLATE.items() if key != "object"
        }
        assert final["object"] == "chat.completion"
        [choice] = final["choices"]
        assert choice["finish_reason"] == assembled.finish_reason
        message = choice["message"]
        assert message["role"] == "assistant"
        if assembled.calls and not assembled.content:
            assert message["content"] is None
        else:
            assert message["content"] == assembled.content
        assert message.get("reasoning_content", "") == assembled.reasoning
        expected_calls = [{key: c[key] for key in ("id", "type", "function")} for c in assembled.calls]
        assert message.get("tool_calls", []) == expected_calls
        if opts.logprobs:
            assert choice["logprobs"] == {"content": assembled.logprobs, "refusal": None}
        else:
            assert choice["logprobs"] is None
        if opts.include_usage:
            assert final["usage"] == assembled.usage
    return assembled


def usage_of(result: ChatRun, assembled: Assembled) -> dict[str, Any]:
    return assembled.usage if assembled.usage is not None else result.final["usage"]


# --- any chunking ----------------------------------------------------------------------------------


@pytest.mark.parametrize("with_markup_tokens", [True, False], ids=["tags_as_tokens", "tags_split"])
def test_reasoning_text_and_a_call_for_any_token_chunking(with_markup_tokens: bool) -> None:
    tokenizer = parser_tokenizer(with_markup_tokens)
    token_ids = tokenizer.encode(ANSWER)
    opts = reasoning_and_tools(include_usage=True)
    # The chunks follow the entries (the processor joins each entry's segments); what a client
    # assembles of them, and the final completion, never do.
    reference: tuple[bytes, Assembled] | None = None
    for chunks in random_chunkings(token_ids, 24, seed=5):
        result = run_chat(tokenizer, chunks, opts)
        assembled = check_chunks(result, opts)
        if reference is None:
            reference = (result.terminal.data, assembled)
        assert (result.terminal.data, assembled) == reference, chunks

    assert result.status == "completed" and result.terminal.type == types.CHAT_DONE
    assert assembled.finish_reason == "tool_calls"
    assert assembled.reasoning == REASONING
    assert assembled.content == "Let me check.\n"
    [made] = assembled.calls
    assert made["id"] == call_id(RESPONSE_ID, 0) and made["type"] == "function"
    assert made["function"]["name"] == "get_weather"
    assert json.loads(made["function"]["arguments"]) == {"city": "Oslo"}
    message = result.final["choices"][0]["message"]
    assert message["content"] == "Let me check.\n" and message["reasoning_content"] == REASONING
    reasoning_tokens = expected_reasoning_tokens(tokenizer, ANSWER)
    assert result.processor.reasoning_tokens == reasoning_tokens > 0
    usage = usage_of(result, assembled)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == reasoning_tokens
    assert usage["prompt_tokens"] == PROMPT_TOKENS and usage["completion_tokens"] == len(token_ids)
    assert usage["total_tokens"] == PROMPT_TOKENS + len(token_ids)


def test_plain_text_for_any_token_chunking() -> None:
    # Without a reasoning parser or logprobs the processor decodes whole entries: the content
    # deltas follow the entries, and what they add up to, and the final completion, never do.
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(TEXT)
    opts = chat_options()
    reference: tuple[bytes, Assembled] | None = None
    for chunks in random_chunkings(token_ids, 30, seed=3):
        result = run_chat(tokenizer, chunks, opts)
        assembled = check_chunks(result, opts)
        assert assembled.content == TEXT and assembled.finish_reason == "stop"
        if reference is None:
            reference = (result.terminal.data, assembled)
        assert (result.terminal.data, assembled) == reference, chunks
    message = result.final["choices"][0]["message"]
    assert message["content"] == TEXT
    assert "reasoning_content" not in message and "tool_calls" not in message
    assert result.final["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


# --- finish reasons ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "finish_reason", "status"),
    [("stop", "stop", "completed"), ("length", "length", "incomplete")],
)
def test_finish_reason_of_an_answer(engine: FinishReason, finish_reason: str, status: str) -> None:
    tokenizer = tiny_tokenizer()
    opts = chat_options(include_usage=True)
    result = run_chat(tokenizer, [tokenizer.encode(TEXT)], opts, finish=engine)
    assembled = check_chunks(result, opts)
    assert result.status == status and result.terminal.type == types.CHAT_DONE
    assert assembled.finish_reason == finish_reason
    assert result.final["choices"][0]["finish_reason"] == finish_reason


@pytest.mark.parametrize(("engine", "finish_reason"), [("stop", "tool_calls"), ("length", "length")])
def test_finish_reason_with_calls(engine: FinishReason, finish_reason: str) -> None:
    tokenizer = tiny_tokenizer()
    opts = reasoning_and_tools()
    text = call("Paris") + "\n" + call("Rome")
    result = run_chat(tokenizer, [tokenizer.encode(text)], opts, finish=engine)
    assembled = check_chunks(result, opts)
    assert assembled.finish_reason == finish_reason
    assert [c["id"] for c in assembled.calls] == [call_id(RESPONSE_ID, 0), call_id(RESPONSE_ID, 1)]
    cities = [json.loads(c["function"]["arguments"])["city"] for c in assembled.calls]
    assert cities == ["Paris", "Rome"]
    assert result.final["choices"][0]["message"]["content"] is None


@pytest.mark.parametrize(("engine", "message"), [("error", "boom"), ("cancelled", None)])
def test_failed_and_cancelled_end_with_an_error_body(engine: FinishReason, message: str | None) -> None:
    tokenizer = tiny_tokenizer()
    opts = chat_options(include_usage=True)
    result = run_chat(tokenizer, [tokenizer.encode(TEXT)], opts, finish=engine, error=message)
    check_chunks(result, opts)
    assert result.status == ("failed" if engine == "error" else "cancelled")
    assert result.terminal.type == types.CHAT_FAILED
    assert result.final["error"]["code"] == "server_error"
    if message is not None:
        assert result.final["error"]["message"] == message


def test_a_request_at_fault_ends_with_an_invalid_request_error() -> None:
    """A grammar the decoder could not follow is the request's fault: the route answers it 400."""
    tokenizer = tiny_tokenizer()
    opts = chat_options()
    result = run_chat(
        tokenizer,
        [tokenizer.encode(TEXT)],
        opts,
        finish="error",
        error="grammar",
        error_code="invalid_prompt",
    )
    assert result.status == "failed"
    assert result.final["error"] == {
        "message": "grammar",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_prompt",
    }


def test_cancelled_before_any_token() -> None:
    tokenizer = tiny_tokenizer()
    opts = chat_options()
    result = run_chat(tokenizer, [], opts, finish="cancelled")
    assembled = check_chunks(result, opts)
    assert assembled.content == "" and result.terminal.type == types.CHAT_FAILED


# --- stop sequences ----------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["stop", "length", "cancelled"])
def test_a_stop_sequence_ends_the_answer_with_stop(engine: FinishReason) -> None:
    """The runner stops the engine after a stop sequence: whatever it then reports, the answer stopped."""
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(TEXT)
    opts = chat_options(stop=(" is 4", "never"), include_usage=True)
    reference: tuple[bytes, Assembled] | None = None
    for chunks in random_chunkings(token_ids, 16, seed=9):
        result = run_chat(tokenizer, chunks, opts, finish=engine, output_tokens=len(token_ids) + 3)
        assembled = check_chunks(result, opts)
        # The stop sequence spans entries in some chunkings: the deltas differ, nothing else.
        if reference is None:
            reference = (result.terminal.data, assembled)
        assert (result.terminal.data, assembled) == reference, chunks
    assert result.processor.stopped_early
    assert result.status == "completed" and result.terminal.type == types.CHAT_DONE
    assert assembled.content == "Hello! こんにちは、世界！ 😀 The answer"
    assert assembled.finish_reason == "stop"
    assert result.final["choices"][0]["finish_reason"] == "stop"
    # The usage counts the answer: the tokens up to the one that completed the stop sequence, not
    # what the engine went on to write until it was told to stop (that depends on timing).
    through_stop = next(n for n in range(len(token_ids) + 1) if " is 4" in tokenizer.decode(token_ids[:n]))
    assert usage_of(result, assembled)["completion_tokens"] == through_stop < len(token_ids)


def test_an_engine_error_after_a_stop_sequence_still_fails() -> None:
    tokenizer = tiny_tokenizer()
    opts = chat_options(stop=(" is 4",))
    result = run_chat(tokenizer, [tokenizer.encode(TEXT)], opts, finish="error", error="boom")
    check_chunks(result, opts)
    assert result.status == "failed" and result.terminal.type == types.CHAT_FAILED


def test_a_stop_sequence_drops_the_call_after_it() -> None:
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(ANSWER)
    opts = reasoning_and_tools(stop=("check",), include_usage=True)
    reference: tuple[bytes, Assembled] | None = None
    for chunks in random_chunkings(token_ids, 16, seed=2):
        result = run_chat(tokenizer, chunks, opts, finish="cancelled")
        seen = (result.terminal.data, check_chunks(result, opts))  # the chunks follow the entries
        if reference is None:
            reference = seen
        assert seen == reference, chunks
    assembled = check_chunks(result, opts)
    assert result.processor.stopped_early
    assert assembled.reasoning == REASONING and assembled.content == "Let me " and assembled.calls == []
    assert assembled.finish_reason == "stop" and result.terminal.type == types.CHAT_DONE


def test_stop_sequences_ignore_reasoning_and_call_arguments() -> None:
    tokenizer = tiny_tokenizer()
    opts = reasoning_and_tools(stop=("weather", "Oslo"))
    result = run_chat(tokenizer, [tokenizer.encode(ANSWER)], opts)
    assembled = check_chunks(result, opts)
    assert not result.processor.stopped_early
    assert assembled.reasoning == REASONING and assembled.content == "Let me check.\n"
    assert len(assembled.calls) == 1 and assembled.finish_reason == "tool_calls"


def test_overlapping_stop_sequences_give_the_same_answer_for_any_chunking() -> None:
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(TEXT)
    opts = chat_options(stop=("answer is", "swer"))
    contents = set()
    for chunks in [[token_ids], [[token] for token in token_ids]]:
        result = run_chat(tokenizer, chunks, opts)
        contents.add(check_chunks(result, opts).content)
    assert len(contents) == 1, contents
    assert all(TEXT.startswith(content) and "swer" not in content for content in contents)


# --- usage, logprobs, numbering ---------------------------------------------------------------------


def test_include_usage_adds_a_last_chunk_with_the_usage() -> None:
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(TEXT)
    opts = chat_options(include_usage=True)
    result = run_chat(tokenizer, [token_ids], opts, cached_tokens=3)
    assembled = check_chunks(result, opts)
    last = result.chunks[-1]
    assert last["choices"] == [] and last["usage"] == assembled.usage
    assert assembled.usage is not None
    assert assembled.usage["prompt_tokens"] == PROMPT_TOKENS
    assert assembled.usage["completion_tokens"] == len(token_ids)
    assert assembled.usage["total_tokens"] == PROMPT_TOKENS + len(token_ids)
    assert assembled.usage["prompt_tokens_details"]["cached_tokens"] == 3
    assert assembled.usage["completion_tokens_details"]["reasoning_tokens"] == 0
    ChatCompletionChunk.model_validate(last, strict=False)


def test_without_include_usage_no_chunk_has_usage() -> None:
    tokenizer = tiny_tokenizer()
    opts = reasoning_and_tools()
    assert not opts.include_usage
    result = run_chat(tokenizer, [tokenizer.encode(ANSWER)], opts)
    check_chunks(result, opts)
    assert all("usage" not in chunk and chunk["choices"] for chunk in result.chunks)
    # The final completion always has it.
    assert result.final["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_logprobs_on_content_chunks_only_when_asked() -> None:
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(TEXT)
    opts = chat_options(logprobs=True)
    reference: tuple[bytes, Assembled] | None = None
    for chunks in random_chunkings(token_ids, 12, seed=4):
        result = run_chat(tokenizer, chunks, opts)
        seen = (result.terminal.data, check_chunks(result, opts))  # the chunks follow the entries
        if reference is None:
            reference = seen
        assert seen == reference, chunks
    assembled = check_chunks(result, opts)
    entries = assembled.logprobs
    assert [entry["logprob"] for entry in entries] == [logprob_at(i) for i in range(len(token_ids))]
    assert b"".join(bytes(entry["bytes"]) for entry in entries) == TEXT.encode()
    assert all(entry["top_logprobs"] == [] for entry in entries)


def test_logprobs_with_reasoning_and_calls() -> None:
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode(ANSWER)
    opts = reasoning_and_tools(logprobs=True, include_usage=True)
    reference: tuple[bytes, Assembled] | None = None
    for chunks in random_chunkings(token_ids, 12, seed=6):
        result = run_chat(tokenizer, chunks, opts)
        seen = (result.terminal.data, check_chunks(result, opts))  # the chunks follow the entries
        if reference is None:
            reference = seen
        assert seen == reference, chunks
    assembled = check_chunks(result, opts)
    assert assembled.content == "Let me check.\n" and assembled.logprobs
    shown = b"".join(bytes(entry["bytes"]) for entry in assembled.logprobs).decode()
    assert "Let me check." in shown and "<think>" not in shown and "<tool_call>" not in shown


def test_without_logprobs_no_chunk_carries_them() -> None:
    tokenizer = tiny_tokenizer()
    opts = reasoning_and_tools()
    result = run_chat(tokenizer, [tokenizer.encode(ANSWER)], opts)
    check_chunks(result, opts)
    assert all(chunk["choices"][0]["logprobs"] is None for chunk in result.chunks)
    assert result.final["choices"][0]["logprobs"] is None


def test_numbering_starts_after_the_events_the_api_logged() -> None:
    tokenizer = tiny_tokenizer()
    opts = chat_options(first_sequence_number=3, include_usage=True)
    result = run_chat(tokenizer, [tokenizer.encode(TEXT)], opts)  # run_chat checks the numbers
    check_chunks(result, opts)
    assert result.encoded[0].sequence_number == 3
    assert result.terminal.sequence_number == 3 + len(result.encoded)
