"""The post-processing state machine of one response: token-stream entries in, events out.

It does no I/O, so the same code runs in a Celery post-process worker, inline in
the API, and in unit tests. Its output depends only on the response's created
snapshot, its options and its token stream: a processor re-run from the start of
the stream after a crash produces the same events, byte for byte, and the
runner skips the ones already logged.

The processor is protocol-neutral: it detokenizes, parses (reasoning, tool calls),
cuts at stop sequences and aligns logprobs into :mod:`resq.postprocess.segments`;
the response's wire protocol (:mod:`resq.protocols`) turns segments into events
and the final object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from resq.catalog import TextTokenizer
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess.detokenizer import IncrementalDetokenizer
from resq.postprocess.logprobs import LogprobAligner
from resq.postprocess.parsers import ReasoningTokenCounter, make_parser
from resq.postprocess.segments import Segment, joined
from resq.postprocess.stops import StopSequences
from resq.protocols import WireProtocol, make_protocol
from resq.sealed import Sealer
from resq.status import FinalStatus
from resq.wire import FinishEntry, StartEntry, TokensEntry, TokenStreamEntry

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
        self.protocol: WireProtocol = make_protocol(response_id, created_response, options, sealer)
        self._emitter = EventEmitter(
            options.first_sequence_number, stamps=self.protocol.stamps_sequence_numbers
        )
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._parser = make_parser(options)
        self._reasoning_counter = ReasoningTokenCounter() if self._parser.tracks_reasoning else None
        self._logprobs = LogprobAligner(tokenizer) if options.logprobs else None
        self._forced_prefix_ids = list(options.forced_prefix_ids)
        self._output_length = 0
        """Characters of decoded output so far (where the next token's text starts)."""
        self._stops = StopSequences(options.stop) if options.stop else None
        self._sampled = 0
        """Sampled output tokens fed one at a time so far: every token once a request has stop
        sequences (its entries then go token by token), which the stop's cut counts."""
        self._sampled_at_stop: int | None = None
        """The output tokens of an answer a stop sequence ended: those up to the one that completed
        it. The engine goes on until it is told to stop, a number of tokens that depends on timing:
        usage counts the answer, the same for the same seeded request."""
        self._started = False
        self.reasoning_tokens = 0
        self.finish: FinishEntry | None = None

    @property
    def next_sequence_number(self) -> int:
        """The number the next event will get."""
        return self._emitter.next_sequence_number

    def in_progress_response(self) -> dict[str, Any]:
        """The snapshot while generating (the record's, until the final one)."""
        return self.protocol.in_progress()

    @property
    def stopped_early(self) -> bool:
        """Whether a stop sequence ended the answer (the engine may still be generating)."""
        return self._stops is not None and self._stops.stopped

    def on_entry(self, entry: TokenStreamEntry) -> list[EncodedEvent]:
        """The events one token-stream entry causes (the terminal event excluded)."""
        if self.finish is not None:
            return []
        events: list[dict[str, Any]] = []
        if not self._started and not (isinstance(entry, FinishEntry) and entry.output_tokens == 0):
            self._started = True
            events += self.protocol.started()
        # Output the API made before generation (a context_management compaction) comes first.
        events += self.protocol.leading()
        if isinstance(entry, TokensEntry):
            if self._forced_prefix_ids:
                # The answer starts with the tokens the API forced (tool_choice): the parsers
                # see them as output, the counts and logprobs as the prompt they were.
                forced, self._forced_prefix_ids = self._forced_prefix_ids, []
                events += self._segments_to_events(self._feed(forced, None, sampled=False))
            events += self._segments_to_events(
                self._feed(entry.token_ids, entry.logprobs, alternatives=entry.top_logprobs)
            )
        elif isinstance(entry, FinishEntry):
            if self._sampled_at_stop is not None and entry.finish_reason != "error":
                entry = dataclasses.replace(entry, output_tokens=self._sampled_at_stop)
            self.finish = entry
            events += self._segments_to_events(self._shown(self._parser.finish(), final=True))
            if self._reasoning_counter is not None:
                self._reasoning_counter.finish(self._parser.take_reasoning_spans())
                self.reasoning_tokens = self._reasoning_counter.count
            events += self.protocol.close(entry, self._status_of(entry), self.reasoning_tokens)
        elif not isinstance(entry, StartEntry):  # pragma: no cover - exhaustive union
            raise TypeError(f"unexpected entry {entry!r}")
        return [self._emitter.emit(event) for event in events]

    def final_response(self, status: FinalStatus | None = None) -> Finished:
        """The final Response after the finish entry (``status`` overrides, e.g. ``cancelled``)."""
        finish = self.finish
        if finish is None:
            raise RuntimeError("final_response() before the finish entry")
        final_status = status or self._status_of(finish)
        return Finished(final_status, self.protocol.final(final_status, finish, self.reasoning_tokens))

    def terminal_event(self, status: FinalStatus, response_json: bytes) -> EncodedEvent:
        """The last event, around the final object exactly as stored."""
        return self.protocol.terminal_event(self._emitter, status, response_json)

    def terminal_event_at(self, number: int, status: FinalStatus, response_json: bytes) -> EncodedEvent:
        """The terminal event as it would be numbered ``number`` (this processor's numbering untouched)."""
        return self.protocol.terminal_event(EventEmitter(number), status, response_json)

    # --- internals -----------------------------------------------------------------------------

    def _status_of(self, finish: FinishEntry) -> FinalStatus:
        if self.stopped_early and finish.finish_reason != "error":
            # The answer ended at a stop sequence; the engine went on (or was stopped) unseen.
            return "completed"
        return _STATUS_BY_FINISH[finish.finish_reason]

    def _shown(self, segments: list[Segment], *, final: bool = False) -> list[Segment]:
        """What of the parser's segments is shown: cut at a stop sequence, with logprobs."""
        if self._stops is not None:
            segments = self._stops.finish(segments) if final else self._stops.feed(segments)
        return self._with_logprobs(segments)

    def _feed(
        self,
        token_ids: list[int],
        logprobs: list[float] | None,
        *,
        sampled: bool = True,
        alternatives: list[list[tuple[int, float]]] | None = None,
    ) -> list[Segment]:
        if self.stopped_early:
            return []  # the answer ended at a stop sequence: what the engine wrote after is not shown
        counter = self._reasoning_counter
        aligner = self._logprobs
        stops = self._stops
        if counter is None and aligner is None and stops is None:
            text = self._detokenizer.feed(token_ids)
            self._output_length += len(text)
            return self._shown(self._parser.feed(text))
        # One token at a time, so that each token's characters are known: the parser says which
        # of them are reasoning, text segments say where they lie, and a stop sequence which
        # token completed it. The parser sees the same chunks whatever the entry sizes, so items
        # and counts are identical for any chunking; the segments of one entry are joined, so
        # deltas follow the entries (as without it).
        segments: list[Segment] = []
        shown: list[Segment] = []
        for index, token_id in enumerate(token_ids):
            text = self._detokenizer.feed([token_id])
            if aligner is not None and sampled and logprobs is not None and index < len(logprobs):
                top = alternatives[index] if alternatives is not None and index < len(alternatives) else None
                aligner.add_token(self._output_length, token_id, text, logprobs[index], top)
            self._output_length += len(text)
            if sampled:
                self._sampled += 1
            if counter is not None:
                counter.add_token(len(text), sampled=sampled)
            parsed = self._parser.feed(text)
            if counter is not None:
                counter.settle(self._parser.take_reasoning_spans(), self._parser.resolved)
            if stops is None:
                segments += parsed
                continue
            shown += self._shown(parsed)
            if stops.stopped:
                self._sampled_at_stop = self._sampled
                break
        if counter is not None:
            self.reasoning_tokens = counter.count
        return joined(shown if stops is not None else self._shown(segments))

    def _with_logprobs(self, segments: list[Segment]) -> list[Segment]:
        return self._logprobs.attach(segments) if self._logprobs is not None else segments

    def _segments_to_events(self, segments: list[Segment]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for segment in segments:
            events += self.protocol.add(segment)
        return events
