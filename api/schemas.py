"""The ``POST /v1/responses`` request body, validated strictly.

Unknown fields are refused (``unknown_parameter``), and fields OpenAI defines
but resq does not implement are refused with ``unsupported_parameter`` naming
them, rather than silently ignored. ``null`` counts as absent for optional
fields, as the SDK omits what the caller leaves out anyway.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, ClassVar, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from resq.grammars import client_grammar_reference

MAX_NESTING = 64
"""Deepest nesting of arrays and objects a request may use (JSON schemas of tools included):
deeper values would exhaust the recursion of the JSON encoders and the chat template."""
MAX_INPUT_ITEMS = 4096
"""Most input items a request may send. Validating an item costs the event loop about 4 us:
220,000 one-word messages (7.5 MB, under the body limit) held every stream of the replica for
about 2 s; this bound keeps validation near 15 ms, and is refused before anything else is walked."""
MAX_CONTENT_PARTS = 4 * MAX_INPUT_ITEMS
"""Content parts of all the input's items (or messages) together: each one is validated and
rendered on the API's event loop, so a body of 200,000 tiny parts stalled every other request
for 2 s (the items bound alone did not stop it)."""
MAX_TOOLS = 128
"""Tools in ``tools``, and in each namespace (OpenAI's bound): 45,000 tools held the API's event
loop for 23 s before the bound (and a quadratic name check) were there."""
MAX_ALLOWED_TOOLS = MAX_TOOLS * (MAX_TOOLS + 1)
"""Entries of ``tool_choice.tools`` (``allowed_tools``): each names a tool or a namespace's tool, of
which a request may have at most this many. Unbounded, 200,000 entries took 2.6 s to validate."""
SMALLEST_INT = -(2**63)
LARGEST_INT = 2**64 - 1
"""The integers a request may hold: what the JSON encoder of the stored objects (orjson, 64-bit
integers, signed or not) can write back. Python's JSON parser reads any integer; a larger one
would fail when the response, the job or a conversation item is stored."""
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


def not_utf8(text: str) -> bool:
    """Whether ``text`` cannot be written as UTF-8 (it holds a lone surrogate, which JSON allows)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\\ud800"), which JSON allows and UTF-8 does not
        return True
    return False


def _storable_number(value: int | float) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)  # NaN and infinities are not JSON (1e400 parses as infinity)
    return SMALLEST_INT <= value <= LARGEST_INT


SERVER_BUILT: Final = {"server_built": True}
"""The validation context of a create request the server builds itself (a compaction's summary,
:mod:`api.compaction`): its items were accepted before, and it may hold more than a client may
send (a whole conversation, and the summary's prompt after it)."""


def check_raw_body(body: Any, limit_items: bool = True) -> None:
    """Refuse what no field validator sees: too many input items (unless not ``limit_items``),
    text that is not valid Unicode, numbers that cannot be stored as JSON (integers past 64 bits,
    NaN, infinities) and excessive nesting.

    Walks the parsed JSON without recursion; the error's context names the culprit's path.
    """
    if limit_items and isinstance(body, dict):
        check_bound(
            body.get("input"),
            MAX_INPUT_ITEMS,
            "The input has {count} items; at most {limit} are allowed (compact or truncate the conversation).",
            "input",
        )
    if isinstance(body, dict):
        _check_counts(body)
    _check_values(body)


_Trail = tuple[Any, Any, bool] | None
"""Where a value sits: None for the body, else (its parent's trail, its key or index, whether an index)."""


def _path(trail: _Trail) -> str:
    """The dotted path of ``trail`` (``input[1].content``), built only for an error: building one per
    value took half of this check's time on an agent's history."""
    steps: list[tuple[Any, bool]] = []
    while trail is not None:
        trail, step, is_index = trail
        steps.append((step, is_index))
    path = ""
    for step, is_index in reversed(steps):
        path = f"{path}[{step}]" if is_index else (f"{path}.{step}" if path else str(step))
    return path


def _check_values(body: Any) -> None:
    """The walk of :func:`check_raw_body` over every value, without recursion."""
    stack: list[tuple[Any, int, _Trail]] = [(body, 0, None)]
    while stack:
        value, depth, trail = stack.pop()
        if depth > MAX_NESTING:
            raise PydanticCustomError(
                "nesting_limit",
                "The request nests arrays and objects deeper than {limit} levels.",
                {"limit": MAX_NESTING, "param": re.split(r"[.\[]", _path(trail), maxsplit=1)[0] or None},
            )
        if isinstance(value, str):
            if not value.isascii() and not_utf8(value):
                raise PydanticCustomError(
                    "invalid_unicode",
                    "The text at '{param}' is not valid Unicode (a lone surrogate).",
                    {"param": _path(trail) or None},
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not key.isascii() and not_utf8(key):
                    path = _path(trail)
                    where = "A key at '{param}'" if path else "A top-level key of the body"
                    raise PydanticCustomError(
                        "invalid_unicode", where + " is not valid Unicode.", {"param": path or None}
                    )
                stack.append((item, depth + 1, (trail, key, False)))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, (trail, index, True)) for index, item in enumerate(value))
        elif isinstance(value, (int, float)) and not _storable_number(value):
            raise PydanticCustomError(
                "number_range",
                "The number at '{param}' cannot be stored: integers must fit in 64 bits, and NaN "
                "and infinities are not JSON.",
                {"param": _path(trail) or None},
            )


def _check_counts(body: dict[str, Any]) -> None:
    """The bounds on content parts and tools, counted on the raw body before anything is validated."""
    for key in ("input", "messages", "items"):
        listed = body.get(key)
        if not isinstance(listed, list):
            continue
        parts = sum(
            len(content)
            for item in listed
            if isinstance(item, dict) and isinstance(content := item.get("content"), list)
        )
        if parts > MAX_CONTENT_PARTS:
            raise too_many(
                "'{param}' holds {count} content parts in all; at most {limit} are allowed.",
                parts,
                MAX_CONTENT_PARTS,
                key,
            )
    choice = body.get("tool_choice")
    check_bound(
        choice.get("tools") if isinstance(choice, dict) else None,
        MAX_ALLOWED_TOOLS,
        "'{param}' names {count} tools; at most {limit} are allowed.",
        "tool_choice.tools",
    )
    tools = body.get("tools")
    if not isinstance(tools, list):
        return
    lists = [("tools", tools)] + [
        (f"tools[{index}].tools", tool["tools"])
        for index, tool in enumerate(tools)
        if isinstance(tool, dict) and isinstance(tool.get("tools"), list)
    ]
    for param, listed in lists:
        check_bound(listed, MAX_TOOLS, "'{param}' has {count} tools; at most {limit} are allowed.", param)


def check_bound(listed: Any, limit: int, message: str, param: str) -> None:
    """Raise :func:`too_many` when ``listed`` is a list of more than ``limit`` entries."""
    if isinstance(listed, list) and len(listed) > limit:
        raise too_many(message, len(listed), limit, param)


def too_many(message: str, count: int, limit: int, param: str) -> PydanticCustomError:
    """The validation error for a list over its bound: a 400 ``invalid_value`` naming ``param``.
    ``message`` may use ``{count}``, ``{limit}`` and ``{param}``."""
    return PydanticCustomError("items_limit", message, {"count": count, "limit": limit, "param": param})


def unsupported(what: str) -> PydanticCustomError:
    """The validation error for a parameter resq does not implement."""
    return PydanticCustomError(
        "unsupported_parameter", "{what} is not supported by this server.", {"what": what}
    )


NotServed = Annotated[Any, WithJsonSchema({"type": "null"})]
"""A field OpenAI defines and resq refuses (a 400 naming it unless null): /openapi.json says null,
so that clients and fuzzers see what resq serves."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RefusingBranch(BaseModel):
    """A catch-all union branch that exists only to refuse, naming what is not served.

    /openapi.json shows it as matching nothing, so the schema lists only what resq serves
    (and a fuzzer's valid requests are valid).
    """

    model_config = ConfigDict(extra="allow")

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        """Matches nothing."""
        return {"not": {}}


class RefusedType(RefusingBranch):
    """A refusing branch picked by its ``type``: "<refused_kind> of type '<type>' is not supported"."""

    refused_kind: ClassVar[str]

    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: str) -> str:
        raise unsupported(f"{cls.refused_kind} of type {value!r}")


# --- content parts -------------------------------------------------------------------------------


class PromptCacheBreakpoint(_Strict):
    """``prompt_cache_breakpoint`` of a content part: where a reusable prefix ends (OpenAI's hint).

    resq's engine reuses every shared prefix it holds, in whole pages, breakpoint or not; with
    ``prompt_cache_options.mode: "explicit"``, a prompt with no breakpoint uses no cache at all.
    """

    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class PromptCacheOptions(_Strict):
    """``prompt_cache_options``: how a request uses the prompt cache (OpenAI's, for newer models).

    resq's engine caches every prompt prefix in whole pages, unasked, so ``mode: "implicit"`` is
    what it does anyway; ``mode: "explicit"`` with no ``prompt_cache_breakpoint`` anywhere in the
    prompt turns caching off for that request, as OpenAI's does (with breakpoints, resq still
    reuses every shared page, breakpoint or not). ``ttl`` is echoed, not enforced: blocks stay
    while the engine's KV cache has room. ``comparison_response_id`` is echoed; resq produces no
    cache diagnostics. ``prewarm: true`` prepares the cache without output: the GPU worker computes
    the prompt and generates nothing (:attr:`resq.wire.GenerationJob.prefill_only`), and the
    response completes, with no output, once the prompt's pages are cached.
    """

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    prewarm: bool | None = Field(None, strict=True)
    comparison_response_id: str | None = Field(None, max_length=256)

    def echo(self) -> dict[str, Any]:
        """What the Response says was applied (the SDK's ``Response.prompt_cache_options``)."""
        return {
            "mode": self.mode or "implicit",
            "ttl": self.ttl or "30m",
            "comparison_response_id": self.comparison_response_id,
        }

    def caches(self, has_breakpoint: bool) -> bool:
        """Whether a prompt, with or without an explicit breakpoint, may reuse and share cached pages."""
        return self.mode != "explicit" or has_breakpoint


class InputTextPart(_Strict):
    """``{"type": "input_text", "text": ...}``."""

    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class OutputTextPart(_Strict):
    """An ``output_text`` part, as clients echo earlier assistant output."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(_Strict):
    """A ``refusal`` part of an echoed assistant message."""

    type: Literal["refusal"]
    refusal: str


class UnsupportedPart(RefusedType):
    """Images, files and audio: resq serves text-only models."""

    refused_kind = "Content"


def _part_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("input_text", "output_text", "refusal") else "other"


ContentPart = Annotated[
    Annotated[InputTextPart, Tag("input_text")]
    | Annotated[OutputTextPart, Tag("output_text")]
    | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[UnsupportedPart, Tag("other")],
    Discriminator(_part_tag),
]


# --- input items ---------------------------------------------------------------------------------


class MessageItem(_Strict):
    """A message: easy form (no ``type``) or typed; content as text or parts."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Any = None


class FunctionCallItem(_Strict):
    """A ``function_call`` the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: str | None = None


class FunctionCallOutputItem(_Strict):
    """The caller's result of a ``function_call``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class SummaryTextPart(_Strict):
    """A reasoning summary part."""

    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(_Strict):
    """A raw reasoning text part."""

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """A ``reasoning`` item echoed back by the client."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ItemReference(_Strict):
    """``{"type": "item_reference", "id": ...}``: an item of an earlier stored response.

    The SDK's ``ItemReference`` makes ``type`` optional: ``{"id": ...}`` alone is one too.
    """

    type: Literal["item_reference"] = "item_reference"
    id: str = Field(min_length=1)

    @field_validator("type", mode="before")
    @classmethod
    def _implied(cls, value: Any) -> Any:
        return "item_reference" if value is None else value


class CompactionItem(_Strict):
    """A ``compaction`` item from ``POST /v1/responses/compact``: stands for every item before it."""

    type: Literal["compaction"]
    encrypted_content: str = Field(min_length=1)
    id: str | None = None
    created_by: str | None = None
    status: str | None = None
    """Not the SDK's, and ignored: earlier releases listed compaction items with a status, and
    conversations stored then hold them so (compacted again, they are validated again)."""


class UnsupportedItem(RefusedType):
    """Built-in tool calls and other items resq has no tools for."""

    refused_kind = "Input items"


class CustomToolCallItem(_Strict):
    """A ``custom_tool_call`` the model made in an earlier turn."""

    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    namespace: str | None = None


class CustomToolCallOutputItem(_Strict):
    """The caller's result of a ``custom_tool_call``."""

    type: Literal["custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


_ITEM_TAGS = (
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "item_reference",
    "compaction",
)


def _item_tag(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("type")
        if kind is None:
            # No type: a message (EasyInputMessage), or an item reference ({"id": ...} alone).
            bare_reference = "id" in value and "role" not in value and "content" not in value
            return "item_reference" if bare_reference else "message"
    else:
        kind = getattr(value, "type", None)
        if kind is None:
            return "message"
    return kind if kind in _ITEM_TAGS else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ItemReference, Tag("item_reference")]
    | Annotated[CompactionItem, Tag("compaction")]
    | Annotated[UnsupportedItem, Tag("other")],
    Discriminator(_item_tag),
]


# --- tools ---------------------------------------------------------------------------------------


def object_parameters(
    cls: type[BaseModel], value: dict[str, Any] | None, info: ValidationInfo
) -> dict[str, Any] | None:
    """A function tool's ``parameters`` validator: a call's arguments are a JSON object (the tool
    parser reads nothing else), so a schema of another type could never be called. OpenAI's own
    400, word for word."""
    kind = (value or {}).get("type", "object")
    if kind != "object":
        raise PydanticCustomError(
            "invalid_function_parameters",
            "Invalid schema for function '{name}': schema must be a JSON Schema of 'type: \"object\"', "
            "got 'type: {kind}'.",
            {"name": info.data.get("name", ""), "kind": json.dumps(kind)},
        )
    return value


class _ToolBase(_Strict):
    """What every tool the model may call has: a name, a description, how it may be called."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: str
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    defer_loading: bool | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    async_: bool | None = Field(None, alias="async")

    @field_validator("defer_loading", "async_")
    @classmethod
    def _refuse_true(cls, value: bool | None, info: Any) -> bool | None:
        if value:
            name = "async" if info.field_name == "async_" else info.field_name
            raise unsupported(f"{name}: true (tool search, asynchronous tools)")
        return value

    @field_validator("allowed_callers")
    @classmethod
    def _direct_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and "programmatic" in value:
            raise unsupported("Programmatic tool calling")
        return value


class FunctionTool(_ToolBase):
    """A function the model may call.

    With ``strict: true`` a call's arguments are constrained to ``parameters`` by
    constrained decoding (:mod:`resq.grammars`); otherwise they are any JSON object.
    """

    type: Literal["function"]
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    output_schema: dict[str, Any] | None = None

    @field_validator("output_schema")
    @classmethod
    def _refuse_output_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise unsupported("output_schema (chat templates cannot show it to the model)")
        return value

    _object_parameters = field_validator("parameters")(classmethod(object_parameters))


HOSTED_TOOL_TYPES = frozenset(
    {
        "apply_patch",
        "code_interpreter",
        "computer",
        "computer_use_preview",
        "file_search",
        "image_generation",
        "local_shell",
        "mcp",
        "programmatic_tool_calling",
        "shell",
        "tool_search",
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
    }
)
"""Tool types OpenAI runs on its side (the SDK's ``Tool`` union minus function, custom and namespace)."""


class HostedTool(BaseModel):
    """A tool OpenAI runs itself (web search, file search, code interpreter, ...).

    resq runs none of them: they are not offered to the model and are echoed in the
    Response as sent (``RESQ_HOSTED_TOOLS=refuse`` makes them a 400 instead). Their
    fields are kept as sent, whatever they are: they have no effect here.
    """

    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in HOSTED_TOOL_TYPES:
            raise PydanticCustomError(
                "unknown_tool_type",
                "Unknown tool type '{kind}'; expected 'function', 'custom', 'namespace' or a "
                "hosted tool type.",
                {"kind": value},
            )
        return value


class CustomTextFormat(_Strict):
    """``{"type": "text"}``: the custom tool's input is any text."""

    type: Literal["text"]


class CustomGrammarFormat(_Strict):
    """``{"type": "grammar", "syntax": "lark" | "regex", "definition"}``: the input follows the grammar."""

    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1)

    @field_validator("definition")
    @classmethod
    def _no_references(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("syntax") == "lark":
            reference = client_grammar_reference(value)
            if reference is not None:
                raise PydanticCustomError(
                    "grammar_reference",
                    "'{reference}' refers to a token or to another grammar (llguidance's extensions); a "
                    "custom tool's grammar may only describe its own text: write the text as a string",
                    {"reference": reference},
                )
        return value


class CustomTool(_ToolBase):
    """A custom (freeform) tool: the model calls it with text, not JSON arguments.

    The chat template sees it as a function with one string parameter, ``input``; a
    call comes back as a ``custom_tool_call`` whose ``input`` is that string.
    """

    type: Literal["custom"]
    format: Annotated[CustomTextFormat | CustomGrammarFormat, Field(discriminator="type")] | None = None

    def _definition(self, syntax: str) -> str | None:
        grammar = self.format
        return (
            grammar.definition
            if isinstance(grammar, CustomGrammarFormat) and grammar.syntax == syntax
            else None
        )

    @property
    def regex(self) -> str | None:
        """The regex the input must match, if the format is one."""
        return self._definition("regex")

    @property
    def lark(self) -> str | None:
        """The Lark grammar the input must follow, if the format is one."""
        return self._definition("lark")


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "custom", "namespace") else "other"


NamespacedTool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")],
    Discriminator(_tool_tag),
]


class NamespaceTool(_Strict):
    """``{"type": "namespace", name, description, tools}``: function and custom tools grouped under a name.

    The chat template sees them flattened, each as ``<namespace>:<name>`` (``:`` cannot
    occur in a tool name, so no flattened name can collide with another tool's); calls
    come back with ``name`` and ``namespace`` apart, as the client declared them.
    """

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str  # required, as the SDK types it (echoed without one, strict clients refused it)
    tools: list[NamespacedTool] = Field(min_length=1)


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[CustomTool, Tag("custom")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("other")],
    Discriminator(_tool_tag),
]


class FunctionToolChoice(_Strict):
    """``{"type": "function", "name": ...}``: the model must call this function."""

    type: Literal["function"]
    name: str = Field(min_length=1)


class CustomToolChoice(_Strict):
    """``{"type": "custom", "name": ...}``: the model must call this custom tool."""

    type: Literal["custom"]
    name: str = Field(min_length=1)


class AllowedToolRef(BaseModel):
    """One entry of ``allowed_tools.tools``: a tool of ``tools`` by type and name."""

    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None
    namespace: str | None = None


class AllowedToolsChoice(_Strict):
    """``{"type": "allowed_tools", "mode": "auto" | "required", "tools": [...]}``.

    Only the listed tools are offered to the model; ``required`` forces a call among them.
    """

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedToolRef]


class UnsupportedToolChoice(RefusedType):
    """Tool choices that name a hosted tool: resq cannot make the model call what it does not run."""

    refused_kind = "tool_choice"


def _tool_choice_tag(value: Any) -> str:
    if isinstance(value, str):
        return "mode"
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "custom", "allowed_tools") else "other"


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")]
    | Annotated[FunctionToolChoice, Tag("function")]
    | Annotated[CustomToolChoice, Tag("custom")]
    | Annotated[AllowedToolsChoice, Tag("allowed_tools")]
    | Annotated[UnsupportedToolChoice, Tag("other")],
    Discriminator(_tool_choice_tag),
]


# --- text, reasoning, stream options ------------------------------------------------------------


class PlainTextFormat(_Strict):
    """``{"type": "text"}``: free text (the default)."""

    type: Literal["text"]


class JsonSchemaFormat(_Strict):
    """``{"type": "json_schema", name, schema, strict, description}``: the message text follows ``schema``.

    Enforced by constrained decoding whatever ``strict`` says (resq has no unenforced mode).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = Field(None, strict=True)
    description: str | None = None


class JsonObjectFormat(_Strict):
    """``{"type": "json_object"}``: the message text is a JSON object."""

    type: Literal["json_object"]


TextFormat = Annotated[
    PlainTextFormat | JsonSchemaFormat | JsonObjectFormat,
    Field(discriminator="type"),
]


class TextConfig(_Strict):
    """``text``: output format and verbosity."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Strict):
    """``reasoning``: effort (thinking on or off, where the chat template has the switch), echoed.

    There is no summarizer: when a summary is asked for (any ``summary`` value), the
    reasoning itself is the summary: its text goes to ``summary`` as well as ``content``.
    """

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None

    @property
    def wants_summary(self) -> bool:
        """Whether the request asks for a reasoning summary (``summary`` or ``generate_summary``)."""
        return self.summary is not None or self.generate_summary is not None

    @field_validator("context")
    @classmethod
    def _template_decides(cls, value: str | None) -> str | None:
        if value not in (None, "auto"):
            raise unsupported(f"reasoning.context {value!r} (the chat template decides what is replayed)")
        return value

    @field_validator("mode")
    @classmethod
    def _standard_only(cls, value: str | None) -> str | None:
        if value not in (None, "standard"):
            raise unsupported(f"reasoning.mode {value!r}")
        return value


class StreamOptions(_Strict):
    """``stream_options``: resq never obfuscates, so ``include_obfuscation`` is moot."""

    include_obfuscation: bool | None = None


# --- the request ---------------------------------------------------------------------------------

UNSUPPORTED_FIELDS = (
    "access_programs",
    "background_options",
    "image",
    "moderation",
    "prompt",
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
SERVED_INCLUDES = frozenset({LOGPROBS_INCLUDE, ENCRYPTED_REASONING_INCLUDE})
"""The ``include`` values that change what resq sends. The other known ones name items resq never
produces (hosted tools' calls, which it echoes but does not run; input images, which it refuses):
accepted, with nothing to include, as OpenAI accepts them when no such item comes."""
CLIENT_METADATA_MAX_KEYS = 64
CLIENT_METADATA_MAX_CHARS = 16384
KNOWN_INCLUDES = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        ENCRYPTED_REASONING_INCLUDE,
        LOGPROBS_INCLUDE,
    }
)
TOP_LOGPROBS_MAX = 20


class ConversationRef(_Strict):
    """``conversation: {"id": ...}`` (the long form of ``conversation: "conv_..."``)."""

    id: str = Field(min_length=1)


class ContextManagement(_Strict):
    """``context_management: [{"type": "compaction", "compact_threshold": N}]``."""

    type: Literal["compaction"]
    compact_threshold: int | None = Field(None, ge=1, strict=True)
    """Rendered input tokens past which the conversation is compacted before generating
    (None: the model's context length minus the output budget)."""


class CreateResponseRequest(_Strict):
    """``POST /v1/responses``."""

    # Shown in /openapi.json; fuzzing starts from these (with the served model's name).
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"model": "resq-tiny", "input": "Say hello."},
                {"model": "resq-tiny", "input": "Say hello.", "stream": True, "max_output_tokens": 8},
                {"model": "resq-tiny", "input": [{"role": "user", "content": "Hi"}], "background": True},
            ]
        },
    )

    model: str = Field(min_length=1)
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    # Strict: JSON's types as they are (no `true` for 1, no "10" for 10, no 1 for true).
    stream: bool | None = Field(None, strict=True)
    stream_options: StreamOptions | None = None
    background: bool | None = Field(None, strict=True)
    store: bool | None = Field(None, strict=True)
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, strict=True)
    max_tool_calls: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0, le=2, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, strict=True)
    metadata: dict[str, str] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=128)
    prompt_cache_key: str | None = Field(None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # Every tier the SDK knows is accepted; resq has one, and the Response says "default".
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, strict=True)
    client_metadata: dict[str, Any] | None = None
    """Codex's per-request client details: accepted and logged at debug level, not stored."""

    access_programs: NotServed = None
    background_options: NotServed = None
    context_management: list[ContextManagement] | None = Field(None, max_length=1)
    conversation: str | ConversationRef | None = None
    image: NotServed = None
    moderation: NotServed = None
    prompt: NotServed = None
    prompt_cache_options: PromptCacheOptions | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _sane_body(cls, value: Any, info: ValidationInfo) -> Any:
        check_raw_body(value, limit_items=not (info.context or {}).get("server_built", False))
        return value

    @field_validator(*UNSUPPORTED_FIELDS, mode="before")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: Any) -> Any:
        if value is None:
            return value
        raise unsupported(f"The parameter {info.field_name!r}")

    @field_validator("include")
    @classmethod
    def _served_includes(cls, value: list[str] | None) -> list[str] | None:
        for entry in value or []:
            if entry not in KNOWN_INCLUDES:
                served = ", ".join(repr(name) for name in sorted(SERVED_INCLUDES))
                raise ValueError(f"unknown include {entry!r}; resq serves {served}")
        return value

    @property
    def conversation_id(self) -> str | None:
        """The id ``conversation`` names (a string or ``{"id"}``), if any."""
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation

    @property
    def compact_threshold(self) -> int | None:
        """The rendered-input size past which ``context_management`` compacts first; None: never."""
        for entry in self.context_management or []:
            return entry.compact_threshold
        return None

    @property
    def wants_logprobs(self) -> bool:
        """Whether ``include`` asks for ``output_text`` logprobs."""
        return LOGPROBS_INCLUDE in (self.include or [])

    @property
    def wants_encrypted_reasoning(self) -> bool:
        """Whether ``include`` asks for ``encrypted_content`` on reasoning items."""
        return ENCRYPTED_REASONING_INCLUDE in (self.include or [])

    @field_validator("client_metadata")
    @classmethod
    def _client_metadata_limits(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        if len(value) > CLIENT_METADATA_MAX_KEYS or len(repr(value)) > CLIENT_METADATA_MAX_CHARS:
            raise PydanticCustomError(
                "metadata_limit",
                "client_metadata may hold at most {keys} keys and {chars} characters.",
                {"keys": CLIENT_METADATA_MAX_KEYS, "chars": CLIENT_METADATA_MAX_CHARS},
            )
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > METADATA_MAX_KEYS:
            raise PydanticCustomError(
                "metadata_limit", "metadata may hold at most {limit} keys.", {"limit": METADATA_MAX_KEYS}
            )
        for key, item in value.items():
            if len(key) > METADATA_MAX_KEY_CHARS:
                raise PydanticCustomError(
                    "metadata_limit",
                    "metadata keys may be at most {limit} characters.",
                    {"limit": METADATA_MAX_KEY_CHARS},
                )
            if len(item) > METADATA_MAX_VALUE_CHARS:
                raise PydanticCustomError(
                    "metadata_limit",
                    "metadata values may be at most {limit} characters.",
                    {"limit": METADATA_MAX_VALUE_CHARS},
                )
        return value


class InputTokensRequest(CreateResponseRequest):
    """``POST /v1/responses/input_tokens``: a create body, counted instead of generated.

    ``model`` may be left out when the server serves one model.
    """

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"model": "resq-tiny", "input": "Say hello."}]},
    )

    model: str | None = Field(None, min_length=1)  # type: ignore[assignment]
    personality: str | None = None


class CompactRequest(_Strict):
    """``POST /v1/responses/compact``: the conversation to compact into one ``compaction`` item."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"model": "resq-tiny", "input": "Say hello."}]},
    )

    model: str = Field(min_length=1)
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = Field(None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = Field(None, max_length=128)
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    image: NotServed = None
    prompt_cache_options: PromptCacheOptions | None = None
    """The summary's generation uses the cache as these say; a prewarm (no output) is refused."""

    @model_validator(mode="before")
    @classmethod
    def _sane_body(cls, value: Any) -> Any:
        check_raw_body(value)
        return value

    @field_validator("prompt_cache_options")
    @classmethod
    def _no_prewarm(cls, value: PromptCacheOptions | None) -> PromptCacheOptions | None:
        if value is not None and value.prewarm:
            raise unsupported(
                "prompt_cache_options.prewarm on a compaction (which must generate its summary)"
            )
        return value

    @field_validator("image", mode="before")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: Any) -> Any:
        if value is None:
            return value
        raise unsupported(f"The parameter {info.field_name!r}")
