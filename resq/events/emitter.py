"""The one place where events get their ``sequence_number`` and their bytes."""

from __future__ import annotations

from dataclasses import dataclass

from resq import jsonutil
from resq.events.builders import Event


@dataclass(frozen=True, slots=True)
class EncodedEvent:
    """An event ready for the event log: its number, its type and its JSON bytes."""

    sequence_number: int
    type: str
    data: bytes


class EventEmitter:
    """Numbers events 0, 1, 2... per response, with no gap and no repeat."""

    def __init__(self, next_sequence_number: int = 0, *, stamps: bool = True) -> None:
        self.next_sequence_number = next_sequence_number
        self._stamps = stamps
        """Whether the JSON carries ``sequence_number`` (Chat Completions chunks do not)."""

    def emit(self, event: Event) -> EncodedEvent:
        """Number ``event`` (stamping it, unless told not to) and encode it."""
        number = self.next_sequence_number
        self.next_sequence_number += 1
        if self._stamps:
            event["sequence_number"] = number
        # Responses events name their type; a chat chunk's is its "object" (chat.completion.chunk).
        event_type = event["type"] if "type" in event else event["object"]
        return EncodedEvent(number, event_type, jsonutil.dumps(event))

    def emit_with_response_json(self, event_type: str, response_json: bytes) -> EncodedEvent:
        """A response-level event around an already encoded Response, kept byte for byte.

        The terminal event embeds the Response exactly as the store holds it, so the
        streamed final object and ``GET /v1/responses/{id}`` are the same bytes.
        """
        number = self.next_sequence_number
        self.next_sequence_number += 1
        head = jsonutil.dumps({"type": event_type, "sequence_number": number})
        return EncodedEvent(number, event_type, head[:-1] + b',"response":' + response_json + b"}")
