"""Per-response processing options, fixed by the API when it accepts a request.

They travel in the response record (not in worker settings) so that every
post-processor that ever handles the response, inline or in a worker, on this
host or another, builds exactly the same events.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from resq.status import Protocol


class ProcessingOptions(BaseModel):
    """What the post-processor needs to know about the request."""

    # Unknown keys are ignored: a record an older API wrote (with fields since removed) still
    # parses in a newer post-processor during a rolling upgrade.
    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str
    protocol: Protocol = "responses"
    """The wire protocol of the events and the final object (:mod:`resq.protocols`)."""
    first_sequence_number: int = 1
    """Events the API logged itself (``response.created``, then ``response.queued`` when background or
    ``response.in_progress`` when not)."""
    in_progress_logged: bool = False
    """The API logged ``response.in_progress`` with ``response.created`` (a foreground response, whose
    status is ``in_progress`` from its creation): the start of generation logs nothing more."""
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    tools_enabled: bool = False
    """False when the request offers no tools or says ``tool_choice: "none"``: markup stays text."""
    custom_tools: tuple[str, ...] = ()
    """Names of custom tools: their calls become ``custom_tool_call`` items (the ``input`` argument)."""
    raw_input_tools: tuple[str, ...] = ()
    """Custom tools with a Lark grammar: called in the raw-input form (the input as it is)."""
    answer_constrained: bool = False
    """A grammar constrains the answer (``text.format`` JSON, strict tools, grammar tools): reasoning
    comes first only and calls' JSON is well-formed, so markup text the answer's JSON strings hold
    (``"<think>"``, ``"</tool_call>"``) is text, not a tag."""
    max_function_calls: int | None = None
    """At most this many calls (1 for ``parallel_tool_calls: false``); the answer ends after the last."""
    forced_prefix_ids: tuple[int, ...] = ()
    """Token ids the API put at the end of the prompt so that the answer starts with them
    (``tool_choice`` enforcement): part of the answer, though the model did not sample them."""
    logprobs: bool = False
    """Attach each text token's log-probability to ``output_text`` (``include``)."""
    reasoning_summary: bool = False
    """The request asked for a reasoning summary: reasoning items mirror their text into ``summary``."""
    seal_reasoning_for: str | None = None
    """``include: ["reasoning.encrypted_content"]``: seal each reasoning item's text for this owner
    (the caller's fingerprint, the blob's associated data); None: no ``encrypted_content``."""
    conversation_id: str | None = None
    """The ``conversation`` the response belongs to: its input and output items are appended to it
    once, when it ends ``completed`` or ``incomplete``."""
    stop: tuple[str, ...] = ()
    """Stop sequences: the answer text ends before the first one (Chat Completions' ``stop``)."""
    include_usage: bool = False
    """Chat streams: a last chunk with the usage (``stream_options.include_usage``)."""
    leading_output: tuple[dict[str, Any], ...] = ()
    """Output items made before generation, shown first (the compaction item of
    ``context_management``)."""
