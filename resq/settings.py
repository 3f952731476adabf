"""Every setting of every role, read from ``RESQ_*`` environment variables.

One class serves all roles so that ``resq up`` can hand the same resolved values
to each child process, and so that the documentation table is generated from a
single source.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from resq.faults import FAULT_POINTS, FaultPoint
from resq.postprocess.parsers import REASONING_FORMATS, REASONING_PARSERS, TOOL_CALL_FORMATS, TOOL_PARSERS

MAX_TTL_S = 10 * 365 * 86400
"""The longest TTL a setting may give (Redis refuses an expiry past its 64-bit milliseconds)."""
MAX_PERIOD_S = 30 * 86400
"""The longest period or timeout in seconds a setting may give (a timer's wait overflows past it)."""
SECONDS_FIELDS = (
    "websocket_max_s",
    "shutdown_grace_s",
    "sse_ping_s",
    "cancel_wait_s",
    "heartbeat_s",
    "worker_ttl_s",
    "postprocess_lease_s",
    "reaper_interval_s",
    "dispatch_timeout_s",
    "gpu_lost_timeout_s",
    "gpu_stall_timeout_s",
)

BUILTIN_MODEL = "builtin"
"""Value of ``RESQ_MODEL`` (and its default) that selects the built-in tiny model."""


class Settings(BaseSettings):
    """Configuration shared by the API, the GPU worker and the post-process workers."""

    # No inf or nan: an infinite period or TTL overflowed a timer or a Redis EXPIRE at run time.
    model_config = SettingsConfigDict(
        env_prefix="RESQ_", extra="ignore", validate_default=True, allow_inf_nan=False
    )

    # --- network -------------------------------------------------------------------------------
    host: str = Field(
        "127.0.0.1",
        min_length=1,  # empty, uvicorn listened on every interface
        description="Interface the API (and a worker's metrics port) listens on.",
    )
    port: int = Field(8000, ge=1, le=65535, description="Port the API listens on.")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description=(
            "Redis for the Celery broker, token streams, event logs and the store: `redis://`, "
            "`rediss://` (TLS) or a Unix socket, `unix:///path/redis.sock?db=0`."
        ),
    )

    # --- model ---------------------------------------------------------------------------------
    model: str = Field(
        BUILTIN_MODEL,
        description=(
            "A local Hugging Face model directory, or a hub id already in the local HF cache. "
            "`builtin` builds a tiny random model for smoke runs."
        ),
    )
    model_name: str | None = Field(
        None, description="Name clients send as `model`; default: derived from RESQ_MODEL."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the GPU worker runs the model.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; `auto` is bfloat16 on CUDA and float32 on CPU."
    )
    builtin_model_dir: Path | None = Field(
        None, description="Cache folder of the built-in model; default: the user's cache dir."
    )

    # --- engine --------------------------------------------------------------------------------
    max_batch: int = Field(32, ge=1, description="Most sequences the engine decodes in one step.")
    max_batch_tokens: int = Field(
        512, ge=16, description="Most tokens (prefill chunks plus decodes) in one engine step."
    )
    kv_cache_tokens: int | None = Field(
        None,
        ge=64,
        description=(
            "KV-cache capacity in tokens. Unset: 16384 on CPU; on CUDA the engine sizes it from "
            "RESQ_GPU_MEMORY_FRACTION."
        ),
    )
    gpu_memory_fraction: float = Field(
        0.85, gt=0, le=0.99, description="Share of free GPU memory the KV cache may take (CUDA only)."
    )
    kv_page_size: int = Field(64, ge=8, description="Tokens per KV-cache page.")
    default_max_output_tokens: int = Field(
        1024, ge=1, description="Generation limit when a request sets no `max_output_tokens`."
    )
    compaction_max_output_tokens: int = Field(
        512,
        ge=16,
        description=(
            "Output budget of the summary `POST /v1/responses/compact` (and `context_management` "
            "compaction) has the served model write."
        ),
    )
    websocket_max_s: float = Field(
        3600.0,
        gt=0,
        description=(
            "How long a WebSocket (`GET /v1/responses` upgraded) lives: then, between responses, it gets an "
            "`error` `websocket_connection_limit_reached` and is closed (the Open Responses limit)."
        ),
    )
    prefix_caching: bool = Field(
        True,
        description=(
            "The engine shares the KV blocks of prompt prefixes other requests computed (transformers' "
            "block sharing), and `usage.input_tokens_details.cached_tokens` reports the tokens it reused."
        ),
    )
    decode_attention: bool = Field(
        True,
        description=(
            "On a CPU without a flash kernel, the engine attends each request to its own keys instead of "
            "the whole batch's keys under a block mask, in decode steps and, where it pays, in prefill and "
            "mixed steps (gpu_worker/decode_attention.py); false keeps transformers' path."
        ),
    )
    seed: int | None = Field(None, description="Sampling seed of the engine; unset: random.")
    sampling_defaults: Literal["model", "openai"] = Field(
        "model",
        description=(
            "The `temperature` and `top_p` of a request that sets none: `model`, the values the model's "
            "`generation_config.json` recommends where it sets them (as vLLM does), else 1.0; `openai`: "
            "always 1.0, OpenAI's defaults. The Response echoes the values used."
        ),
    )
    logprobs: bool = Field(
        True,
        description=(
            "The engine computes each sampled token's log-probability, so requests may ask for "
            '`include: ["message.output_text.logprobs"]`; off: such requests get a 400.'
        ),
    )
    structured_outputs: bool = Field(
        True,
        description=(
            "Constrained decoding (`text.format` json_schema / json_object, strict tools) in the GPU "
            "worker. On CUDA it turns off CUDA graphs and asynchronous batching, which would skip the "
            "grammar masks; off: such requests get a 400."
        ),
    )

    stream_interval_ms: int = Field(
        50,
        ge=0,
        le=1000,
        description=(
            "Shortest time between two token appends of one request: the GPU worker sends what a request "
            "generated meanwhile as one chunk (one delta event per item it touches), so the post-processors, "
            "the API and Redis work per chunk instead of per token. A request's first tokens and its end are never held. "
            "0: every engine step's tokens go out with that step."
        ),
    )

    shutdown_grace_s: float = Field(
        10.0, ge=0, description="On SIGTERM, how long the GPU worker lets running requests finish."
    )

    # --- post-processing -----------------------------------------------------------------------
    reasoning_parser: str | None = Field(
        None,
        description=(
            "How the model marks reasoning: "
            + ", ".join(f"`{name}`" for name in REASONING_PARSERS)
            + "; unset: no reasoning items, the output is all text."
        ),
    )
    tool_parser: str | None = Field(
        None,
        description=(
            "How the model writes function calls: "
            + ", ".join(f"`{name}`" for name in TOOL_PARSERS)
            + "; unset: requests with `tools` get a 400."
        ),
    )
    postprocess_workers: int = Field(
        2,
        ge=0,
        description="Post-process worker processes `resq up` starts; 0: the API post-processes inline.",
    )
    postprocess_concurrency: int = Field(
        64, ge=1, description="Responses one post-process worker (or the inline API) handles at once."
    )

    # --- API -----------------------------------------------------------------------------------
    sse_ping_s: float = Field(
        15.0,
        gt=0,
        description="Seconds between SSE comment pings on every open stream (they keep idle ones alive through proxies).",
    )
    sse_coalesce_after: int = Field(
        16,
        ge=0,
        description=(
            "When more than this many events wait for a stream's client (SSE or WebSocket) at once, each run "
            "of consecutive deltas of one item among them is sent as one event (same text, the run's last "
            "`sequence_number`); what was logged before the stream opened (a replay) is sent as logged. "
            "0: never merge."
        ),
    )
    transient_ttl_s: int = Field(
        3600,
        ge=60,
        le=MAX_TTL_S,
        description="TTL of the keys of a response in flight, and of `store=false` responses.",
    )
    store_ttl_s: int = Field(
        30 * 86400, ge=60, le=MAX_TTL_S, description="TTL of stored responses (`store=true`)."
    )
    max_pending: int = Field(
        256,
        ge=1,
        description=(
            "Most generations queued or running across the cluster; a request past it gets a 429 "
            "(`rate_limit_exceeded`) with `Retry-After`, instead of waiting in an unbounded queue."
        ),
    )
    max_pending_per_key: int = Field(
        0,
        ge=0,
        description=(
            "Most generations one API key may have queued or running (0: no bound of its own, only "
            "`RESQ_MAX_PENDING`); past it that key gets a 429 while others are still admitted, so one "
            "key cannot take every slot. Applies only with `RESQ_API_KEYS`."
        ),
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description=(
            "Largest request body the API reads; larger ones get a 413. "
            "A WebSocket message over it closes its socket (1009, message too big)."
        ),
    )
    max_output_tokens_cap: int = Field(
        32768, ge=1, description="Largest `max_output_tokens` a request may ask for; above it, a 400."
    )
    cancel_wait_s: float = Field(
        10.0,
        ge=0,
        description=(
            "How long `POST /v1/responses/{id}/cancel` waits for the final cancelled Response "
            "before answering with the current snapshot (status `cancelled`)."
        ),
    )

    # --- security (docs/security.md) ------------------------------------------------------------
    api_keys: SecretStr | None = Field(
        None,
        description=(
            "API keys clients send as `Authorization: Bearer <key>` on `/v1/*`: a comma-separated list, "
            "or `@/path/to/file` with one key per line (`#` comments and blank lines ignored). "
            "Unset or empty: the API is open (a warning is logged at start-up)."
        ),
    )
    owner_secret: SecretStr | None = Field(
        None,
        description=(
            "HMAC key of the fingerprints that record which API key owns a response; unset: a fixed "
            "built-in key. Changing it orphans every stored response."
        ),
    )
    content_secret: SecretStr | None = Field(
        None,
        description=(
            "Key of the `encrypted_content` blobs (reasoning items) clients carry between turns "
            "(AES-256-GCM); unset: derived from `RESQ_OWNER_SECRET`, or a built-in key when that is "
            "unset too. Every API replica and post-process worker needs the same value; changing it "
            "makes earlier blobs a 400."
        ),
    )
    hosted_tools: Literal["ignore", "refuse"] = Field(
        "ignore",
        description=(
            "What to do with hosted tools (`web_search`, `file_search`, `mcp`, ...) that resq does not "
            "run: `ignore` echoes them and does not offer them to the model; `refuse` answers 400."
        ),
    )
    rate_limit_rpm: int = Field(
        0,
        ge=0,
        description=(
            "Requests per minute each API key may send to `/v1/*` (token bucket; each WebSocket "
            "message is a request, its handshake is not); 0: no limit."
        ),
    )

    # --- liveness ------------------------------------------------------------------------------
    heartbeat_s: float = Field(2.0, gt=0, description="Seconds between worker heartbeats.")
    worker_ttl_s: float = Field(
        10.0, gt=0, description="A worker whose last heartbeat is older than this counts as gone."
    )

    # --- recovery ------------------------------------------------------------------------------
    postprocess_lease_s: float = Field(
        10.0,
        gt=0,
        description=(
            "Lease of a post-processor on a response, renewed every third of it; when it lapses "
            "(the owner died) another post-processor takes the response over."
        ),
    )
    reaper_interval_s: float = Field(
        1.0, gt=0, description="Seconds between passes of the reaper that finds lost work."
    )
    dispatch_timeout_s: float = Field(
        15.0,
        gt=0,
        description=(
            "A generation job that no GPU worker has claimed and that is not waiting in the "
            "`generate:<model>` queue counts as lost after this long and is dispatched again."
        ),
    )
    gpu_lost_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "A response whose GPU worker was lost (or that no live GPU worker can take) fails with "
            "`server_error` when no GPU worker resumes it within this long."
        ),
    )
    fault_point: FaultPoint | None = Field(
        None,
        description=(
            "Testing only: the process ends itself (as kill -9 would) when it reaches this point "
            f"({', '.join(FAULT_POINTS)}); unset in production."
        ),
    )
    gpu_stall_timeout_s: float = Field(
        300.0,
        gt=0,
        description=(
            "A generation whose GPU worker is alive but has neither claimed it again nor appended a "
            "token for this long is released and resumed elsewhere, counting as a loss (a watchdog; "
            "keep it above the longest prefill and the longest wait for room in the engine)."
        ),
    )
    gpu_max_losses: int = Field(
        3,
        ge=1,
        description=(
            "A response whose GPU worker was lost this many times fails instead of resuming again "
            "(guards against a request that brings down every worker it reaches)."
        ),
    )

    # --- operations ----------------------------------------------------------------------------
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="`text` for people; `json`: one JSON object a line, with `response_id` on lines about a response.",
    )
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=(
            "Port on which a worker process serves Prometheus metrics; unset: none. The API serves "
            "`/metrics` on RESQ_PORT. `resq up` gives each worker its own port from this one up."
        ),
    )
    celery_events: bool = Field(
        False,
        description="Send Celery task events and worker heartbeats (what Flower shows); off, they cost Redis traffic.",
    )

    @field_validator(*SECONDS_FIELDS)
    @classmethod
    def _a_period_a_timer_takes(cls, value: float) -> float:
        if value > MAX_PERIOD_S:
            raise ValueError(f"at most {MAX_PERIOD_S} seconds (30 days)")
        return value

    @field_validator("worker_ttl_s")
    @classmethod
    def _outlives_a_heartbeat(cls, value: float, info: Any) -> float:
        heartbeat = info.data.get("heartbeat_s")
        if heartbeat is not None and value <= heartbeat:
            # A live worker would count as gone between two heartbeats, and its work be taken over.
            raise ValueError(
                f"must be longer than RESQ_HEARTBEAT_S ({heartbeat} s): a worker is gone after it"
            )
        return value

    @field_validator("model", "builtin_model_dir", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value == "":
            raise ValueError("must not be empty (an empty path is the working directory)")
        return value

    @field_validator("reasoning_parser", "tool_parser", mode="before")
    @classmethod
    def _known_parser(cls, value: Any, info: Any) -> Any:
        if value is None or value == "":
            return None
        # The registry's rows as they are now (a format registered after import counts too).
        known = tuple(REASONING_FORMATS if info.field_name == "reasoning_parser" else TOOL_CALL_FORMATS)
        if value not in known:
            raise ValueError(
                f"{value!r} is not a parser resq knows; use one of {', '.join(known)}, "
                "or leave it unset for no parsing"
            )
        return value

    @property
    def served_model_name(self) -> str:
        """The name clients send in ``model``."""
        if self.model_name:
            return self.model_name
        if self.model == BUILTIN_MODEL:
            return "resq-tiny"
        path = Path(self.model).expanduser()
        if path.exists():
            return path.resolve().name
        return self.model

    def to_env(self) -> dict[str, str]:
        """These settings as ``RESQ_*`` variables, so child processes resolve the same values."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, SecretStr):  # children need the secret itself, not its mask
                value = value.get_secret_value()
            env[f"RESQ_{name.upper()}"] = str(value)
        return env


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with explicit (command-line) overrides winning."""
    clean = {key: value for key, value in overrides.items() if value is not None}
    return Settings(**clean)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
