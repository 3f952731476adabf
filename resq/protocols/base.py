"""The interface every wire protocol implements (see :mod:`resq.protocols`)."""

from __future__ import annotations

from typing import Any, Protocol

from resq.events.builders import Event
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.postprocess.segments import Segment
from resq.status import FinalStatus
from resq.wire import FinishEntry


class WireProtocol(Protocol):
    """Segments in, one protocol's events and final object out, for one response.

    Deterministic: the same segments give the same events and the same final bytes
    (modulo timestamps fixed in the template), so a post-processor re-run after a crash
    rebuilds exactly what was logged.
    """

    stamps_sequence_numbers: bool
    """Whether events carry their ``sequence_number`` in their JSON (the log's entry ids always do)."""

    def started(self) -> list[Event]:
        """The events that open the answer (before its first segment)."""
        ...

    def leading(self) -> list[Event]:
        """Output made before generation, shown first (asked on every entry; given once)."""
        ...

    def add(self, segment: Segment) -> list[Event]:
        """The events one segment causes."""
        ...

    def close(self, finish: FinishEntry, status: FinalStatus, reasoning_tokens: int) -> list[Event]:
        """The events that end the answer (open items closed, a last chunk), before the terminal one."""
        ...

    def in_progress(self) -> dict[str, Any]:
        """The snapshot the record holds while generating."""
        ...

    def final(self, status: FinalStatus, finish: FinishEntry, reasoning_tokens: int) -> bytes:
        """The final object as the store keeps it and the non-streaming client receives it."""
        ...

    def unprocessable(self, message: str) -> bytes:
        """The final object of a response that could not be post-processed at all (``failed``)."""
        ...

    def terminal_event(self, emitter: EventEmitter, status: FinalStatus, final_json: bytes) -> EncodedEvent:
        """The last event of the log, around ``final_json`` exactly as stored."""
        ...
