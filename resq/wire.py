"""What travels between roles: Celery job payloads and token-stream entries.

Celery carries one JSON message per response and role, never one per token.
Tokens travel through the response's Redis stream (``keys.tokens``); each entry
is one of three kinds:

- ``start``: the engine admitted the request (carries the prompt length);
- ``tokens``: token ids produced since the previous entry (and their logprobs), with
  ``start``, the position of the first of them in the generated output: a reader goes
  by position, so a stream that moved back in time (Redis lost its last writes, a GPU
  worker regenerated them) is never read twice;
- ``finish``: the last entry, with ``finish_reason`` and the token counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from resq import jsonutil
from resq.redis_types import StreamFields

FinishReason = Literal["stop", "length", "cancelled", "error"]
FailureCode = Literal["server_error", "invalid_prompt"]
"""Why a generation ended ``error``, as the Responses API's ``error.code`` says it: the server's
fault, or the request's own (a grammar the constrained decoder could not follow to the end)."""


class GenerationJob(BaseModel):
    """The payload of one ``resq.generate`` task: everything the engine needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    response_id: str
    model: str
    prompt_token_ids: list[int] = Field(min_length=1)
    max_output_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    """OpenAI's ``presence_penalty``: subtracted once from the logit of every token this request
    has already generated (the prompt does not count); negative values favour repetition."""
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    """OpenAI's ``frequency_penalty``: subtracted from a token's logit once per time this request
    has already generated it (the prompt does not count); negative values favour repetition."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Tokens that end this request, besides the model's end-of-sequence tokens."""
    logprobs: bool = False
    """Publish each sampled token's log-probability with the tokens."""
    top_logprobs: int = Field(0, ge=0, le=20)
    """With ``logprobs``: also publish, for each token, this many most likely tokens at its position
    and their log-probabilities (:mod:`gpu_worker.top_logprobs`); 0: none."""
    grammar: str | None = None
    """The llguidance grammar every generated token must follow (:mod:`resq.grammars`); None: free."""
    seed: int | None = None
    """The request's sampling seed (:mod:`gpu_worker.seeds`); None: the engine's shared stream."""
    affinity_keys: list[str] = Field(default_factory=list)
    """The affinity keys the GPU worker that claims this job sets to itself (:mod:`resq.affinity`)."""
    cache_owner: str = ""
    """The caller's key fingerprint: the engine shares prompt blocks only among its requests
    (:mod:`gpu_worker.prefix_cache`); empty without auth."""
    prefill_only: bool = False
    """Compute the prompt and publish no token (``prompt_cache_options.prewarm``): the prompt's pages
    stay in the engine's prefix cache for the next turn; the job ends ``stop`` with 0 output tokens."""


@dataclass(frozen=True, slots=True)
class StartEntry:
    """The engine admitted the request."""

    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class TokensEntry:
    """New token ids, in generation order."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    start: int | None = None
    """How many tokens of the output precede these (the first one's position); None in
    entries of GPU workers older than the field (a reader then trusts the stream's order)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """For each token, the most likely tokens at its position, (token id, logprob), most likely
    first; None when the request asks for none."""


@dataclass(frozen=True, slots=True)
class FinishEntry:
    """Generation ended; always the last entry of a token stream."""

    finish_reason: FinishReason
    prompt_tokens: int
    output_tokens: int
    error: str | None = None
    cached_tokens: int = 0
    """Prompt tokens the engine did not compute: their KV blocks were reused from an earlier request
    (transformers' prefix sharing), as the engine reported it."""
    error_code: FailureCode = "server_error"
    """Whose fault an ``error`` finish is (absent from the stream entry when the server's, as in
    entries of GPU workers older than the field)."""


TokenStreamEntry = StartEntry | TokensEntry | FinishEntry


def encode_entry(entry: TokenStreamEntry) -> StreamFields:
    """Fields of the Redis stream entry for ``entry``."""
    if isinstance(entry, TokensEntry):
        fields: StreamFields = {"type": "tokens", "ids": jsonutil.dumps(entry.token_ids)}
        if entry.logprobs is not None:
            fields["logprobs"] = jsonutil.dumps(entry.logprobs)
        if entry.start is not None:
            fields["start"] = entry.start
        if entry.top_logprobs is not None:
            fields["top"] = jsonutil.dumps(entry.top_logprobs)
        return fields
    if isinstance(entry, StartEntry):
        return {"type": "start", "prompt_tokens": entry.prompt_tokens}
    fields = {
        "type": "finish",
        "finish_reason": entry.finish_reason,
        "prompt_tokens": entry.prompt_tokens,
        "output_tokens": entry.output_tokens,
    }
    if entry.error is not None:
        fields["error"] = entry.error
    if entry.cached_tokens:
        fields["cached_tokens"] = entry.cached_tokens
    if entry.error_code != "server_error":
        fields["error_code"] = entry.error_code
    return fields


def decode_entry(fields: dict[bytes, bytes]) -> TokenStreamEntry:
    """The entry a Redis stream entry's fields describe."""
    kind = fields[b"type"]
    if kind == b"tokens":
        logprobs = fields.get(b"logprobs")
        start = fields.get(b"start")
        top = fields.get(b"top")
        return TokensEntry(
            token_ids=jsonutil.loads(fields[b"ids"]),
            logprobs=jsonutil.loads(logprobs) if logprobs is not None else None,
            start=int(start) if start is not None else None,
            top_logprobs=(
                [[(int(token), float(logprob)) for token, logprob in row] for row in jsonutil.loads(top)]
                if top is not None
                else None
            ),
        )
    if kind == b"start":
        return StartEntry(prompt_tokens=int(fields[b"prompt_tokens"]))
    if kind == b"finish":
        error = fields.get(b"error")
        cached = fields.get(b"cached_tokens")
        reason = fields[b"finish_reason"].decode()
        if reason not in ("stop", "length", "cancelled", "error"):
            raise ValueError(f"unknown finish_reason {reason!r}")
        return FinishEntry(
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=int(fields[b"prompt_tokens"]),
            output_tokens=int(fields[b"output_tokens"]),
            error=error.decode() if error is not None else None,
            cached_tokens=int(cached) if cached is not None else 0,
            error_code=_failure_code(fields.get(b"error_code")),
        )
    raise ValueError(f"unknown token-stream entry type {kind!r}")


def _failure_code(raw: bytes | None) -> FailureCode:
    # An unknown code (a newer GPU worker's) reads as the server's fault rather than failing the read.
    return "invalid_prompt" if raw == b"invalid_prompt" else "server_error"
