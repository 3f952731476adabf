"""Per-response processing options, fixed by the API when it accepts a request.

They travel in the response record (not in worker settings) so that every
post-processor that ever handles the response, inline or in a worker, on this
host or another, builds exactly the same events.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ProcessingOptions(BaseModel):
    """What the post-processor needs to know about the request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    background: bool = False
    store: bool = True
    first_sequence_number: int = 1
    """Events the API logged itself (``response.created``, and ``response.queued`` when background)."""
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    tools_enabled: bool = False
    """False when the request offers no tools or says ``tool_choice: "none"``: markup stays text."""
    logprobs: bool = False
    top_logprobs: int = 0
