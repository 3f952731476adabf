"""The Responses API protocol: output items and their events, the final ``Response``."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from resq import jsonutil, sealed
from resq.events import builders as build
from resq.events import types
from resq.events.assembler import OutputAssembler, ReasoningOutput
from resq.events.builders import Event
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.options import ProcessingOptions
from resq.postprocess.segments import Segment
from resq.sealed import Sealer
from resq.status import FinalStatus, ItemStatus
from resq.wire import FinishEntry


def _reasoning_output(options: ProcessingOptions, sealer: Sealer | None) -> ReasoningOutput:
    owner = options.seal_reasoning_for
    if owner is None:
        return ReasoningOutput(summary=options.reasoning_summary)
    if sealer is None:
        raise ValueError("the request asks for encrypted reasoning, and no sealer was given")
    return ReasoningOutput(
        summary=options.reasoning_summary, seal=partial(sealer.seal, sealed.REASONING, owner)
    )


class ResponsesProtocol:
    """``response.*`` events and the final Response of one response."""

    stamps_sequence_numbers = True

    def __init__(
        self,
        response_id: str,
        template: dict[str, Any],
        options: ProcessingOptions,
        sealer: Sealer | None = None,
    ) -> None:
        self._template = template
        self._in_progress_logged = options.in_progress_logged
        self._assembler = OutputAssembler(response_id, _reasoning_output(options, sealer))
        self._leading_output = [dict(item) for item in options.leading_output]

    def in_progress(self) -> dict[str, Any]:
        """The snapshot while generating (``response.in_progress`` and the record)."""
        return {**self._template, "status": "in_progress"}

    def started(self) -> list[Event]:
        """``response.in_progress``, unless the API logged it already (a foreground response)."""
        if self._in_progress_logged:
            return []
        return [build.response_event(types.IN_PROGRESS, self.in_progress())]

    def leading(self) -> list[Event]:
        """The items the API made before generation (a ``context_management`` compaction), once."""
        events: list[Event] = []
        leading, self._leading_output = self._leading_output, []
        for item in leading:
            events += self._assembler.add_finished(item)
        return events

    def add(self, segment: Segment) -> list[Event]:
        """The item events of one segment."""
        return self._assembler.add(segment)

    def close(self, finish: FinishEntry, status: FinalStatus, reasoning_tokens: int) -> list[Event]:
        """The open item closed: ``completed`` when the answer ended on its own."""
        item_status: ItemStatus = "completed" if status == "completed" else "incomplete"
        return self._assembler.close(item_status)

    def final(self, status: FinalStatus, finish: FinishEntry, reasoning_tokens: int) -> bytes:
        """The final Response."""
        response = {
            **self._template,
            "status": status,
            "output": self._assembler.items,
            "usage": build.usage(
                finish.prompt_tokens,
                finish.output_tokens,
                reasoning_tokens=reasoning_tokens,
                cached_tokens=finish.cached_tokens,
            ),
        }
        if status == "completed":
            response["completed_at"] = int(time.time())
        elif status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        elif status == "failed":
            response["error"] = {
                "code": finish.error_code,
                "message": finish.error or "The model failed to generate a response.",
            }
        return jsonutil.dumps(response)

    def unprocessable(self, message: str) -> bytes:
        """The created snapshot, ``failed`` with ``server_error``."""
        return jsonutil.dumps(
            {**self._template, "status": "failed", "error": {"code": "server_error", "message": message}}
        )

    def terminal_event(self, emitter: EventEmitter, status: FinalStatus, final_json: bytes) -> EncodedEvent:
        """``response.completed`` / ``.incomplete`` / ``.failed`` around the stored Response."""
        return emitter.emit_with_response_json(types.TERMINAL_BY_STATUS[status], final_json)
