"""The post-processing state machine of one response: token-stream entries in, events out.

It does no I/O, so the same code runs in a Celery post-process worker, inline in
the API, and in unit tests. Its output depends only on the response's created
snapshot, its options and its token stream: a processor re-run from the start of
the stream after a crash produces the same events, byte for byte, and the
runner skips the ones already logged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from resq import jsonutil, sealed
from resq.catalog import TextTokenizer
from resq.events import builders as build
from resq.events import types
from resq.events.assembler import OutputAssembler, ReasoningOutput
from resq.events.builders import ItemStatus
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess.detokenizer import IncrementalDetokenizer
from resq.postprocess.logprobs import LogprobAligner
from resq.postprocess.parsers import ReasoningTokenCounter, make_parser
from resq.postprocess.segments import Segment
from resq.sealed import Sealer
from resq.wire import FinishEntry, StartEntry, TokensEntry, TokenStreamEntry

FinalStatus = Literal["completed", "incomplete", "failed", "cancelled"]

_STATUS_BY_FINISH: dict[str, FinalStatus] = {
    "stop": "completed",
    "length": "incomplete",
    "cancelled": "cancelled",
    "error": "failed",
}


@dataclass(frozen=True, slots=True)
class Finished:
    """What the runner stores before it logs the terminal event."""

    status: FinalStatus
    response_json: bytes


def _reasoning_output(options: ProcessingOptions, sealer: Sealer | None) -> ReasoningOutput:
    owner = options.seal_reasoning_for
    if owner is None:
        return ReasoningOutput(summary=options.reasoning_summary)
    if sealer is None:
        raise ValueError("the request asks for encrypted reasoning, and no sealer was given")
    return ReasoningOutput(
        summary=options.reasoning_summary, seal=partial(sealer.seal, sealed.REASONING, owner)
    )


class ResponseProcessor:
    """Builds the events and the final Response of one response."""

    def __init__(
        self,
        response_id: str,
        created_response: dict[str, Any],
        tokenizer: TextTokenizer,
        options: ProcessingOptions,
        sealer: Sealer | None = None,
    ) -> None:
        self._response_id = response_id
        self._template = created_response
        self._emitter = EventEmitter(options.first_sequence_number)
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._parser = make_parser(options)
        self._reasoning_counter = ReasoningTokenCounter() if self._parser.tracks_reasoning else None
        self._logprobs = LogprobAligner(tokenizer) if options.logprobs else None
        self._forced_prefix_ids = list(options.forced_prefix_ids)
        self._output_length = 0
        """Characters of decoded output so far (where the next token's text starts)."""
        self._assembler = OutputAssembler(response_id, _reasoning_output(options, sealer))
        self._started = False
        self._leading_output = [dict(item) for item in options.leading_output]
        self.reasoning_tokens = 0
        self.finish: FinishEntry | None = None

    @property
    def next_sequence_number(self) -> int:
        """The number the next event will get."""
        return self._emitter.next_sequence_number

    def in_progress_response(self) -> dict[str, Any]:
        """The snapshot while generating (``response.in_progress`` and the record)."""
        return {**self._template, "status": "in_progress"}

    def on_entry(self, entry: TokenStreamEntry) -> list[EncodedEvent]:
        """The events one token-stream entry causes (the terminal event excluded)."""
        if self.finish is not None:
            return []
        events: list[dict[str, Any]] = []
        if not self._started and not (isinstance(entry, FinishEntry) and entry.output_tokens == 0):
            self._started = True
            events.append(build.response_event(types.IN_PROGRESS, self.in_progress_response()))
        if self._leading_output:
            # Items the API made before generation (a context_management compaction) come first.
            leading, self._leading_output = self._leading_output, []
            for item in leading:
                events += self._assembler.add_finished(item)
        if isinstance(entry, TokensEntry):
            if self._forced_prefix_ids:
                # The answer starts with the tokens the API forced (tool_choice): the parsers
                # see them as output, the counts and logprobs as the prompt they were.
                forced, self._forced_prefix_ids = self._forced_prefix_ids, []
                events += self._segments_to_events(self._feed(forced, None, sampled=False))
            events += self._segments_to_events(self._feed(entry.token_ids, entry.logprobs))
        elif isinstance(entry, FinishEntry):
            self.finish = entry
            events += self._segments_to_events(self._with_logprobs(self._parser.finish()))
            if self._reasoning_counter is not None:
                self._reasoning_counter.finish(self._parser.take_reasoning_spans())
                self.reasoning_tokens = self._reasoning_counter.count
            item_status: ItemStatus = "completed" if entry.finish_reason == "stop" else "incomplete"
            events += self._assembler.close(item_status)
        elif not isinstance(entry, StartEntry):  # pragma: no cover - exhaustive union
            raise TypeError(f"unexpected entry {entry!r}")
        return [self._emitter.emit(event) for event in events]

    def final_response(self, status: FinalStatus | None = None) -> Finished:
        """The final Response after the finish entry (``status`` overrides, e.g. ``cancelled``)."""
        finish = self.finish
        if finish is None:
            raise RuntimeError("final_response() before the finish entry")
        final_status = status or _STATUS_BY_FINISH[finish.finish_reason]
        response = {
            **self._template,
            "status": final_status,
            "output": self._assembler.items,
            "usage": build.usage(
                finish.prompt_tokens,
                finish.output_tokens,
                reasoning_tokens=self.reasoning_tokens,
                cached_tokens=finish.cached_tokens,
            ),
        }
        if final_status == "completed":
            response["completed_at"] = int(time.time())
        elif final_status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        elif final_status == "failed":
            response["error"] = {
                "code": "server_error",
                "message": finish.error or "The model failed to generate a response.",
            }
        return Finished(final_status, jsonutil.dumps(response))

    def terminal_event(self, status: str, response_json: bytes) -> EncodedEvent:
        """The last event, around the Response exactly as stored."""
        return self._emitter.emit_with_response_json(types.TERMINAL_BY_STATUS[status], response_json)

    # --- internals -----------------------------------------------------------------------------

    def _feed(
        self, token_ids: list[int], logprobs: list[float] | None, *, sampled: bool = True
    ) -> list[Segment]:
        counter = self._reasoning_counter
        aligner = self._logprobs
        if counter is None and aligner is None:
            text = self._detokenizer.feed(token_ids)
            self._output_length += len(text)
            return self._parser.feed(text)
        # One token at a time, so that each token's characters are known: the parser says which
        # of them are reasoning, and text segments say where they lie. The parser sees the same
        # chunks whatever the entry sizes, so the events are identical for any chunking too.
        segments: list[Segment] = []
        for index, token_id in enumerate(token_ids):
            text = self._detokenizer.feed([token_id])
            if aligner is not None and sampled and logprobs is not None and index < len(logprobs):
                aligner.add_token(self._output_length, token_id, text, logprobs[index])
            self._output_length += len(text)
            if counter is not None:
                counter.add_token(len(text), sampled=sampled)
            segments += self._parser.feed(text)
            if counter is not None:
                counter.settle(self._parser.take_reasoning_spans(), self._parser.resolved)
        if counter is not None:
            self.reasoning_tokens = counter.count
        return self._with_logprobs(segments)

    def _with_logprobs(self, segments: list[Segment]) -> list[Segment]:
        return self._logprobs.attach(segments) if self._logprobs is not None else segments

    def _segments_to_events(self, segments: list[Segment]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for segment in segments:
            events += self._assembler.add(segment)
        return events
