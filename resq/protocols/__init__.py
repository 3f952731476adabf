"""Wire protocols: what the post-processor's neutral segments become on the wire.

The parsers, the GPU worker and crash recovery know nothing of protocols: they
produce and carry :mod:`resq.postprocess.segments` (text, reasoning, tool calls,
with their positions and logprobs). A protocol turns those segments into the
events of one response's event log and into its final object:

- ``responses`` (:mod:`.responses`): the Responses API's events and final ``Response``;
- ``chat`` (:mod:`.chat`): ``chat.completion.chunk`` events and the final ``chat.completion``.

Adding a protocol is one module implementing :class:`WireProtocol` and one row in
:data:`PROTOCOLS`. Which protocol a response speaks travels in its
:class:`~resq.options.ProcessingOptions`, so every post-processor that ever
handles it (inline, in a worker, after a takeover) speaks the same one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from resq.options import ProcessingOptions
from resq.protocols.base import WireProtocol
from resq.protocols.chat import ChatProtocol
from resq.protocols.responses import ResponsesProtocol
from resq.sealed import Sealer
from resq.status import Protocol as ProtocolName

__all__ = ["PROTOCOLS", "WireProtocol", "make_protocol"]

ProtocolFactory = Callable[[str, dict[str, Any], ProcessingOptions, "Sealer | None"], WireProtocol]

PROTOCOLS: dict[ProtocolName, ProtocolFactory] = {
    "responses": ResponsesProtocol,
    "chat": ChatProtocol,
}
"""Protocol name (``ProcessingOptions.protocol``) -> its implementation."""


def make_protocol(
    response_id: str, template: dict[str, Any], options: ProcessingOptions, sealer: Sealer | None = None
) -> WireProtocol:
    """The protocol of one response, around the snapshot the API recorded at creation."""
    return PROTOCOLS[options.protocol](response_id, template, options, sealer)
