"""The ``POST /v1/chat/completions`` request body, validated as strictly as ``/v1/responses``.

Unknown fields are refused (``unknown_parameter``); fields OpenAI defines that resq
does not implement are refused with ``unsupported_parameter`` naming them. Chat
completions are never stored (``store: true`` and ``metadata`` belong to OpenAI's
stored-completions feature, which resq does not serve: 400 naming them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from api.schemas import (
    MAX_INPUT_ITEMS,
    TOP_LOGPROBS_MAX,
    JsonObjectFormat,
    NotServed,
    PlainTextFormat,
    PromptCacheBreakpoint,
    PromptCacheOptions,
    RefusedType,
    RefusingBranch,
    _Strict,
    check_bound,
    check_raw_body,
    object_parameters,
    unsupported,
)

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
"""Longest stop sequence: the post-processor checks each one against every chunk's tail."""


class ChatTextPart(_Strict):
    """``{"type": "text", "text": ...}``, with the SDK's optional ``prompt_cache_breakpoint``."""

    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class ChatRefusalPart(_Strict):
    """``{"type": "refusal", "refusal": ...}`` (assistant messages)."""

    type: Literal["refusal"]
    refusal: str


class ChatUnsupportedPart(RefusedType):
    """Images, audio and files: refused, naming the part's type."""

    refused_kind = "Content parts"


def _part_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "refusal") else "other"


UserPart = Annotated[
    Annotated[ChatTextPart, Tag("text")] | Annotated[ChatUnsupportedPart, Tag("other")],
    Discriminator(lambda value: "text" if _part_tag(value) == "text" else "other"),
]
AssistantPart = Annotated[
    Annotated[ChatTextPart, Tag("text")]
    | Annotated[ChatRefusalPart, Tag("refusal")]
    | Annotated[ChatUnsupportedPart, Tag("other")],
    Discriminator(_part_tag),
]


class _Message(_Strict):
    name: str | None = None


class SystemMessage(_Message):
    """``system`` (and ``developer``) messages: instructions."""

    role: Literal["system", "developer"]
    content: str | list[ChatTextPart]


class UserMessage(_Message):
    """A ``user`` message: text, or text parts."""

    role: Literal["user"]
    content: str | list[UserPart]


class CalledFunction(_Strict):
    """The function of an assistant's tool call."""

    name: str = Field(min_length=1)
    arguments: str


class ToolCall(_Strict):
    """One tool call of an earlier assistant message."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Message):
    """An earlier answer: text, tool calls, and its reasoning (``reasoning_content``, vLLM's name)."""

    role: Literal["assistant"]
    content: str | list[AssistantPart] | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    audio: NotServed = None
    function_call: NotServed = None

    @field_validator("audio", "function_call", mode="before")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: Any) -> Any:
        if value is None:
            return value
        raise unsupported(f"The message field {info.field_name!r}")


class ToolMessage(_Strict):
    """A tool's result, answering the call ``tool_call_id``."""

    role: Literal["tool"]
    tool_call_id: str = Field(min_length=1)
    content: str | list[ChatTextPart]


class UnsupportedMessage(RefusingBranch):
    """A role resq does not serve (``function``, the deprecated one)."""

    role: str

    @field_validator("role")
    @classmethod
    def _refuse(cls, value: str) -> str:
        if value == "function":
            raise unsupported("The deprecated 'function' role (use 'tool')")
        raise PydanticCustomError(
            "invalid_role",
            "Invalid role '{role}': expected system, developer, user, assistant or tool.",
            {"role": value},
        )


def _role_tag(value: Any) -> str:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    if role in ("system", "developer"):
        return "system"
    return role if role in ("user", "assistant", "tool") else "other"


ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("system")]
    | Annotated[UserMessage, Tag("user")]
    | Annotated[AssistantMessage, Tag("assistant")]
    | Annotated[ToolMessage, Tag("tool")]
    | Annotated[UnsupportedMessage, Tag("other")],
    Discriminator(_role_tag),
]


class FunctionDefinition(_Strict):
    """A function the model may call."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _object_parameters = field_validator("parameters")(classmethod(object_parameters))


class ChatFunctionTool(_Strict):
    """``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(_Strict):
    """The function ``tool_choice`` names."""

    name: str = Field(min_length=1)


class ChatFunctionToolChoice(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: this function must be called."""

    type: Literal["function"]
    function: ChosenFunction


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema``."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, strict=True)


class ChatJsonSchemaFormat(_Strict):
    """``{"type": "json_schema", "json_schema": {...}}``: answers follow the schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "json_object", "json_schema") else "other"


class UnsupportedFormat(RefusedType):
    """A ``response_format`` type resq does not know."""

    refused_kind = "response_format"


ResponseFormat = Annotated[
    Annotated[PlainTextFormat, Tag("text")]
    | Annotated[JsonObjectFormat, Tag("json_object")]
    | Annotated[ChatJsonSchemaFormat, Tag("json_schema")]
    | Annotated[UnsupportedFormat, Tag("other")],
    Discriminator(_format_tag),
]


class ChatStreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool | None = Field(None, strict=True)
    include_obfuscation: bool | None = None


CHAT_UNSUPPORTED_FIELDS = (
    "audio",
    "functions",
    "function_call",
    "modalities",
    "prediction",
    "web_search_options",
    "metadata",
)


class ChatCompletionRequest(_Strict):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"model": "resq-tiny", "messages": [{"role": "user", "content": "Say hello."}]},
                {
                    "model": "resq-tiny",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "stream": True,
                    "max_tokens": 8,
                },
            ]
        },
    )

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool | None = Field(None, strict=True)
    stream_options: ChatStreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0, le=2, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, strict=True)
    stop: Annotated[
        str | list[str] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {"type": "string", "minLength": 1, "maxLength": 256},
                    {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1, "maxLength": 256},
                        "maxItems": 4,
                    },
                    {"type": "null"},
                ]
            }
        ),
    ] = None
    seed: int | None = Field(None, strict=True)
    presence_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX, strict=True)
    """The most likely tokens at each position, with ``logprobs: true`` (a 400 without it)."""
    tools: list[ChatFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatFunctionToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    n: Annotated[
        int | None, WithJsonSchema({"anyOf": [{"type": "integer", "const": 1}, {"type": "null"}]})
    ] = Field(None, strict=True)
    store: Annotated[
        bool | None, WithJsonSchema({"anyOf": [{"type": "boolean", "const": False}, {"type": "null"}]})
    ] = Field(None, strict=True)
    logit_bias: Annotated[
        dict[str, float] | None,
        WithJsonSchema({"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]}),
    ] = None
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=128)
    prompt_cache_key: str | None = Field(None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    audio: NotServed = None
    functions: NotServed = None
    function_call: NotServed = None
    modalities: NotServed = None
    prediction: NotServed = None
    web_search_options: NotServed = None
    metadata: NotServed = None

    @model_validator(mode="before")
    @classmethod
    def _sane_body(cls, value: Any) -> Any:
        if isinstance(value, dict):
            check_bound(
                value.get("messages"),
                MAX_INPUT_ITEMS,
                "The request has {count} messages; at most {limit} are allowed.",
                "messages",
            )
        check_raw_body(value)
        return value

    @field_validator(*CHAT_UNSUPPORTED_FIELDS, mode="before")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: Any) -> Any:
        if value is None:
            return value
        if info.field_name == "metadata":
            raise unsupported("'metadata' (chat completions are not stored)")
        raise unsupported(f"The parameter {info.field_name!r}")

    @field_validator("stream_options")
    @classmethod
    def _options_of_a_stream(
        cls, value: ChatStreamOptions | None, info: ValidationInfo
    ) -> ChatStreamOptions | None:
        # OpenAI refuses them on a request that does not stream (so does vLLM): no client sends
        # them there on purpose, and accepting them would hide a request that meant to stream.
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError(
                "stream_options_without_stream", "it is only allowed when 'stream' is true.", {}
            )
        return value

    @field_validator("store")
    @classmethod
    def _never_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise unsupported("'store: true' (chat completions are not stored; use /v1/responses)")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise unsupported(f"n = {value} (resq returns one choice: n must be 1)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise unsupported("logit_bias")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        # As OpenAI's and vLLM's: alternatives come with the logprobs they belong to.
        if value and not info.data.get("logprobs"):
            raise ValueError("logprobs must be true when top_logprobs is set")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise PydanticCustomError(
                "stop_limit", "stop may hold at most {limit} sequences.", {"limit": MAX_STOP_SEQUENCES}
            )
        if any(not stop for stop in stops):
            raise PydanticCustomError("empty_stop", "stop sequences may not be empty.", {})
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise PydanticCustomError(
                "stop_limit", "stop sequences may be at most {limit} characters.", {"limit": MAX_STOP_CHARS}
            )
        return value

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """``stop`` as a tuple (a string is one sequence)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether the stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)
