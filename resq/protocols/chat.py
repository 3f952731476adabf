"""The Chat Completions protocol: ``chat.completion.chunk`` events and the final ``chat.completion``.

One choice (``n`` = 1). The stream is what OpenAI sends: a first chunk with the
role, then content / ``reasoning_content`` / ``tool_calls`` deltas, a last chunk with
``finish_reason``, and, with ``stream_options.include_usage``, a chunk with no choices
and the usage. Reasoning is ``reasoning_content`` on the deltas and on the message
(vLLM's and DeepSeek's convention). A tool call arrives whole (the parser releases
complete calls), so its delta carries ``id``, ``name`` and all of its ``arguments``.

The terminal event of the log is ``chat.completion.done`` around the final object,
or ``chat.completion.failed`` around an ``{"error": ...}`` body; the relay turns them
into ``data: [DONE]`` and a streamed error.
"""

from __future__ import annotations

from typing import Any, Final

from resq import jsonutil
from resq.events import types
from resq.events.builders import Event
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess.segments import (
    CustomToolCallSegment,
    ReasoningEnd,
    ReasoningSegment,
    Segment,
    TextSegment,
    ToolCallSegment,
)
from resq.sealed import Sealer
from resq.status import FinalStatus
from resq.wire import FailureCode, FinishEntry

CHUNK: Final = types.CHAT_CHUNK
DONE: Final = types.CHAT_DONE
FAILED: Final = types.CHAT_FAILED

_FINISH_REASON: Final[dict[FinalStatus, str]] = {
    "completed": "stop",
    "incomplete": "length",
    "failed": "stop",
    "cancelled": "stop",
}


def call_id(response_id: str, index: int) -> str:
    """The id of the ``index``-th tool call of a completion (stable across re-runs)."""
    return f"call_{response_id.removeprefix('resp_')}_{index}"


def error_body(message: str, code: FailureCode = "server_error") -> dict[str, Any]:
    """An OpenAI error envelope for a generation that failed: the server's fault, or the request's
    (``invalid_prompt``: its grammar could not be followed to the end), answered 400 when not streamed."""
    kind = "invalid_request_error" if code == "invalid_prompt" else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class ChatProtocol:
    """Chunks and the final completion of one chat completion."""

    stamps_sequence_numbers = False

    def __init__(
        self,
        response_id: str,
        template: dict[str, Any],
        options: ProcessingOptions,
        sealer: Sealer | None = None,
    ) -> None:
        self._response_id = response_id
        self._template = template
        """``id``, ``created``, ``model``, ``system_fingerprint``, ``service_tier``."""
        self._logprobs = options.logprobs
        self._include_usage = options.include_usage
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._token_logprobs: list[dict[str, Any]] = []
        self._role_sent = False

    # --- events --------------------------------------------------------------------------------

    def in_progress(self) -> dict[str, Any]:
        """The template (nothing of the answer is kept in the record before its end)."""
        return self._template

    def started(self) -> list[Event]:
        """Nothing yet: the role chunk goes out with the first answer chunk (so it times the first token)."""
        return []

    def leading(self) -> list[Event]:
        """Chat completions have no output made before generation."""
        return []

    def add(self, segment: Segment) -> list[Event]:
        """One delta chunk per segment (the first one after the role chunk)."""
        events = self._delta(segment)
        return self._with_role(events) if events else events

    def _with_role(self, events: list[Event]) -> list[Event]:
        if self._role_sent:
            return events
        self._role_sent = True
        return [self._chunk({"role": "assistant", "content": ""}), *events]

    def _delta(self, segment: Segment) -> list[Event]:
        if isinstance(segment, TextSegment):
            if not segment.text:
                return []
            self._content.append(segment.text)
            self._token_logprobs += segment.logprobs
            logprobs = {"content": segment.logprobs, "refusal": None} if self._logprobs else None
            return [self._chunk({"content": segment.text}, logprobs=logprobs)]
        if isinstance(segment, ReasoningEnd):
            return []  # a chat message's reasoning_content has no item to close
        if isinstance(segment, ReasoningSegment):
            if not segment.text:
                return []
            self._reasoning.append(segment.text)
            return [self._chunk({"reasoning_content": segment.text})]
        if isinstance(segment, CustomToolCallSegment):  # pragma: no cover - chat offers no custom tools
            raise TypeError("chat completions have no custom tools")
        return [self._chunk({"tool_calls": [self._call(segment)]})]

    def close(self, finish: FinishEntry, status: FinalStatus, reasoning_tokens: int) -> list[Event]:
        """The last chunk (``finish_reason``), then the usage chunk when asked."""
        events = self._with_role([self._chunk({}, finish_reason=self._finish_reason(status))])
        if self._include_usage:
            usage = self._usage(finish, reasoning_tokens)
            events.append({**self._envelope(CHUNK), "choices": [], "usage": usage})
        return events

    # --- final objects -------------------------------------------------------------------------

    def final(self, status: FinalStatus, finish: FinishEntry, reasoning_tokens: int) -> bytes:
        """The ``chat.completion``; an error body when the generation failed."""
        if status == "cancelled":
            return jsonutil.dumps(error_body("The completion was cancelled."))
        if status == "failed":
            failure = finish.error or "The model failed to generate a response."
            return jsonutil.dumps(error_body(failure, finish.error_code))
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self._content) if self._content or not self._calls else None,
            "refusal": None,
        }
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._calls:
            message["tool_calls"] = [
                {key: call[key] for key in ("id", "type", "function")} for call in self._calls
            ]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": {"content": self._token_logprobs, "refusal": None} if self._logprobs else None,
            "finish_reason": self._finish_reason(status),
        }
        completion = {
            **self._envelope("chat.completion"),
            "choices": [choice],
            "usage": self._usage(finish, reasoning_tokens),
        }
        return jsonutil.dumps(completion)

    def unprocessable(self, message: str) -> bytes:
        """An error body."""
        return jsonutil.dumps(error_body(message))

    def terminal_event(self, emitter: EventEmitter, status: FinalStatus, final_json: bytes) -> EncodedEvent:
        """``chat.completion.done`` / ``.failed`` around the stored final body (never sent as is)."""
        event_type = FAILED if status in ("failed", "cancelled") else DONE
        number = emitter.next_sequence_number
        emitter.next_sequence_number += 1
        return EncodedEvent(number, event_type, final_json)

    # --- internals -----------------------------------------------------------------------------

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {**self._template, "object": kind}

    def _chunk(
        self,
        delta: dict[str, Any],
        *,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> Event:
        chunk: Event = {
            **self._envelope(CHUNK),
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if self._include_usage:
            chunk["usage"] = None
        return chunk

    def _call(self, segment: ToolCallSegment) -> dict[str, Any]:
        index = len(self._calls)
        call = {
            "index": index,
            "id": call_id(self._response_id, index),
            "type": "function",
            "function": {"name": segment.name, "arguments": segment.arguments},
        }
        self._calls.append(call)
        return call

    def _finish_reason(self, status: FinalStatus) -> str:
        if status == "completed" and self._calls:
            return "tool_calls"
        return _FINISH_REASON[status]

    @staticmethod
    def _usage(finish: FinishEntry, reasoning_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": finish.prompt_tokens,
            "completion_tokens": finish.output_tokens,
            "total_tokens": finish.prompt_tokens + finish.output_tokens,
            "prompt_tokens_details": {"cached_tokens": finish.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }
