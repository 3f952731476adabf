"""The status vocabulary, in one place.

Response statuses (what the record and the API show) are one set of types; the
outcomes of a post-processing run ("done", "missing", "handed-over": what a
worker reports about its own work) are another, so that neither can be passed
where the other is meant.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
"""A response's status, as the record holds it and the Response shows it."""

FinalStatus = Literal["completed", "incomplete", "failed", "cancelled"]
"""The statuses a response can end with (never overwritten once the final record is written)."""

ItemStatus = Literal["in_progress", "completed", "incomplete"]
"""An output item's status."""

RunOutcome = Literal["done", "missing", "handed-over", "moved", "final"]
"""How a post-processing run ended when not with a status of its own: ``done`` (another run had
finished it), ``missing`` (the record is gone), ``handed-over`` (another post-processor took it
over), ``moved`` / ``final`` (what the failing script found: another writer logged further, or
finished it)."""

Protocol = Literal["responses", "chat"]
"""The wire protocol a response speaks (:mod:`resq.protocols`)."""

Endpoint = Literal["responses", "chat_completions"]
"""The API endpoint a generation came through (metrics and log labels)."""

TERMINAL_STATUSES: Final[frozenset[str]] = frozenset(get_args(FinalStatus))

ENDPOINT_OF_PROTOCOL: Final[dict[Protocol, Endpoint]] = {"responses": "responses", "chat": "chat_completions"}
