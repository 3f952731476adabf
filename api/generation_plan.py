"""What a request asks of generation besides its messages: tools, tool_choice, thinking, logprobs.

Every option is either enforced or refused with a 400 naming it; none is ignored.

- ``tools`` are offered to the chat template (``{"type": "function", "function":
  {name, description, parameters}}``) when a tool parser is configured; without one
  the server could only return the model's call markup as text, so it refuses them.
- ``tool_choice``: ``none`` offers no tools and keeps any call markup as text;
  ``auto`` lets the model choose; ``required`` and ``{"type": "function", "name"}``
  force a call (of any function, or of the named one; ``required`` with a single
  tool names it). When any offered function is ``strict``, or ``text.format``
  constrains the message, the answer is constrained by a grammar
  (:mod:`resq.grammars`): the JSON or calls in the tool parser's envelope, strict
  functions' arguments following their ``parameters`` (any object for the others),
  and for a forced choice nothing but calls. A forced choice is such a grammar
  too wherever the GPU worker constrains decoding (``RESQ_STRUCTURED_OUTPUTS``, on
  by default): a name among those it allows, any object for a tool that is not
  strict. Only a GPU worker that does not constrain decoding gets the old
  enforcement: the assistant turn prefilled with the opening of a call (the
  prefill is part of the answer: the post-processor parses it as output), which
  a model may still leave with something that is no call. ``auto`` leaves the
  answer free.
- ``namespace`` tools are flattened: each function or custom tool inside is offered as
  ``<namespace>:<name>`` (``:`` cannot occur in a declared name, so nothing collides);
  its calls come back with ``namespace`` and ``name`` apart.
- hosted tools (``web_search``, ``file_search``, ``mcp``, ...) run on OpenAI's side: they
  are not offered to the model, only echoed (``RESQ_HOSTED_TOOLS=refuse``: a 400).
- ``tool_choice`` ``{"type": "allowed_tools", mode, tools}`` offers only the listed tools;
  mode ``required`` forces a call among them, as ``required`` does.
- ``custom`` tools reach the template as functions with one string parameter, ``input``;
  their calls come back as ``custom_tool_call`` items. A ``regex`` grammar constrains the
  input (a grammar like a strict function's); a ``lark`` grammar makes the call use the
  raw-input form (the input as it is, not a JSON string: :mod:`resq.grammars`), which the
  grammar then constrains; ``{"type": "custom", "name"}`` forces one.
- ``text.format`` ``json_schema`` / ``json_object``: the message text is constrained to
  the schema (to any JSON object), after reasoning runs free.
- ``parallel_tool_calls: false``: the answer ends after its first call; where the
  call's closing tag is a single token, generation stops right there too.
- ``reasoning.effort``: Qwen3-style templates read ``enable_thinking``; ``none``
  turns thinking off, any other effort on. A template without the switch cannot
  turn reasoning off, so ``none`` is refused when reasoning is parsed.
- ``include: ["message.output_text.logprobs"]`` needs a GPU worker that computes
  logprobs (``RESQ_LOGPROBS``), which its model card says.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from api.errors import OpenAIError, invalid_value
from api.schemas import (
    AllowedToolsChoice,
    CreateResponseRequest,
    CustomTool,
    CustomToolChoice,
    FunctionTool,
    FunctionToolChoice,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamespaceTool,
)
from resq.catalog import ModelCard
from resq.conversation import CUSTOM_INPUT, flat_tool_name
from resq.grammars import ANY_OBJECT, AnswerShape, CallableFunction, CallsShape, RawInputTool
from resq.postprocess.parsers import call_end_tag, call_envelope, forced_call_prefix, reasoning_markup

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The parameters of a function that declares none (what the template shows, what strict allows)."""
THINKING_SWITCH = "enable_thinking"
"""The chat-template variable Qwen3-style templates read to turn reasoning on or off."""


@dataclass(frozen=True)
class GenerationPlan:
    """How the request's tools, choice, thinking and logprobs shape the prompt and the parse."""

    template_tools: list[dict[str, Any]] | None = None
    """Tools for the chat template; None: none offered."""
    tools_enabled: bool = False
    """Whether the post-processor turns call markup into function calls."""
    forced_prefix: str = ""
    """Text appended to the prompt that the answer must start with."""
    stop_after: str | None = None
    """Text after which generation may stop (the end of the one call allowed)."""
    max_calls: int | None = None
    template_context: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    custom_tools: tuple[str, ...] = ()
    """Names of the offered custom tools: their calls come back as ``custom_tool_call`` items."""
    raw_input_tools: tuple[str, ...] = ()
    """The custom tools with a Lark grammar, called in the raw-input form."""
    calls: CallsShape | None = None
    """The calls a grammar must allow (some function is strict); None: calls are not constrained."""
    answer_shape: AnswerShape | None = None
    """What constrained decoding enforces; None: the answer is unconstrained."""


def unsupported(message: str, param: str) -> OpenAIError:
    """A 400 for something the request asks that this server cannot do."""
    return OpenAIError(400, message, param=param, code="unsupported_parameter")


OfferedTool = FunctionTool | CustomTool
"""A tool the model may call; a namespace's tools are offered flattened (``namespace:name``)."""


def _all_offerable(request: CreateResponseRequest) -> list[OfferedTool]:
    """Every function and custom tool of ``tools``, namespaces flattened (hosted tools are not run)."""
    offered: list[OfferedTool] = []
    for tool in request.tools or []:
        if isinstance(tool, FunctionTool | CustomTool):
            offered.append(tool)
        elif isinstance(tool, NamespaceTool):
            offered.extend(
                inner.model_copy(update={"name": flat_tool_name(tool.name, inner.name)})
                for inner in tool.tools
            )
    return offered


def _allowed(choice: AllowedToolsChoice, tools: list[OfferedTool]) -> list[OfferedTool]:
    """The tools ``allowed_tools`` lets the model call, in ``tools`` order; 400 for a ref to no tool."""
    by_name = {tool.name: tool for tool in tools}
    wanted: set[str] = set()
    for index, ref in enumerate(choice.tools):
        if ref.type == "namespace" and ref.name is not None:
            prefix = flat_tool_name(ref.name, "")
            matches = {name for name in by_name if name.startswith(prefix)}
        elif ref.type in ("function", "custom") and ref.name is not None:
            name = ref.name if ref.namespace is None else flat_tool_name(ref.namespace, ref.name)
            tool = by_name.get(name)
            matches = {name} if tool is not None and tool.type == ref.type else set()
        else:
            continue  # a hosted tool: never offered here, allowed or not
        if not matches:
            raise invalid_value(
                f"tool_choice.tools[{index}] names a tool that is not in tools.",
                f"tool_choice.tools[{index}]",
            )
        wanted |= matches
    return [tool for tool in tools if tool.name in wanted]


def _functions(request: CreateResponseRequest) -> list[OfferedTool]:
    tools = _all_offerable(request)
    if isinstance(request.tool_choice, AllowedToolsChoice):
        return _allowed(request.tool_choice, tools)
    return tools


def hosted_tool_types(request: CreateResponseRequest) -> list[str]:
    """The types of the hosted tools in ``tools`` (resq offers none of them to the model)."""
    return [
        tool.type
        for tool in request.tools or []
        if not isinstance(tool, FunctionTool | CustomTool | NamespaceTool)
    ]


def custom_input_schema(tool: CustomTool) -> dict[str, Any]:
    """The JSON schema of a custom tool's ``input`` (the whole text matches its regex, if any)."""
    schema: dict[str, Any] = {"type": "string"}
    if tool.regex is not None:
        schema["pattern"] = (
            f"^(?:{tool.regex})$"  # JSON Schema patterns match anywhere; the input is all of it
        )
    return schema


def _parameters(tool: OfferedTool) -> dict[str, Any]:
    if isinstance(tool, FunctionTool):
        return tool.parameters or NO_PARAMETERS
    return {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string"}},
        "required": [CUSTOM_INPUT],
    }


def _template_tool(tool: OfferedTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = _parameters(tool)
    return {"type": "function", "function": function}


def _forced_function(request: CreateResponseRequest, functions: list[OfferedTool]) -> str | None:
    """The tool the answer must call, if the choice names one (or only one is offered)."""
    choice = request.tool_choice
    if isinstance(choice, FunctionToolChoice | CustomToolChoice):
        kind = FunctionTool if isinstance(choice, FunctionToolChoice) else CustomTool
        noun = "function" if kind is FunctionTool else "custom tool"
        names = [tool.name for tool in functions if isinstance(tool, kind)]
        if choice.name not in names:
            raise invalid_value(
                f"tool_choice names the {noun} {choice.name!r}, which is not in tools "
                f"({', '.join(repr(name) for name in names)}).",
                "tool_choice",
            )
        return choice.name
    return functions[0].name if len(functions) == 1 else None


def _constrains(tool: OfferedTool) -> bool:
    """Whether the tool's calls must be constrained: a strict function, or a custom tool with a grammar."""
    if isinstance(tool, FunctionTool):
        return bool(tool.strict)
    return tool.regex is not None or tool.lark is not None


def _callable(tool: OfferedTool) -> CallableFunction:
    if isinstance(tool, CustomTool):
        arguments = {
            "type": "object",
            "properties": {CUSTOM_INPUT: custom_input_schema(tool)},
            "required": [CUSTOM_INPUT],
            "additionalProperties": False,
        }
        return CallableFunction(tool.name, arguments)
    if not tool.strict:
        return CallableFunction(tool.name, ANY_OBJECT)
    return CallableFunction(tool.name, tool.parameters or NO_PARAMETERS)


def _constrained_calls(
    request: CreateResponseRequest,
    functions: list[OfferedTool],
    tool_parser: str,
    forcing: bool,
    constrain_forced: bool,
) -> CallsShape | None:
    """The calls' grammar when some tool constrains its calls, ``text.format`` constrains the
    answer (its grammar must then leave room for calls, of non-strict tools too), or the choice
    forces a call and the GPU worker constrains decoding (``constrain_forced``); None: calls
    stay unconstrained."""
    constrained = (
        (forcing and constrain_forced)
        or answer_schema(request) is not None
        or any(_constrains(tool) for tool in functions)
    )
    if not constrained:
        return None
    offered = functions
    if forcing:
        forced = _forced_function(request, functions)
        if isinstance(request.tool_choice, FunctionToolChoice | CustomToolChoice) and forced is not None:
            offered = [tool for tool in functions if tool.name == forced]
    json_calls: list[OfferedTool] = []
    raw_input: list[RawInputTool] = []
    for tool in offered:
        lark = tool.lark if isinstance(tool, CustomTool) else None
        if lark is None:
            json_calls.append(tool)
        else:
            raw_input.append(RawInputTool(tool.name, lark))
    return CallsShape(
        envelope=call_envelope(tool_parser),
        functions=tuple(_callable(tool) for tool in json_calls),
        required=forcing,
        single=request.parallel_tool_calls is False,
        raw_input_tools=tuple(raw_input),
    )


def _refuse_hosted(request: CreateResponseRequest) -> None:
    hosted = hosted_tool_types(request)
    if hosted:
        index = next(
            index
            for index, tool in enumerate(request.tools or [])
            if not isinstance(tool, FunctionTool | CustomTool | NamespaceTool)
        )
        raise unsupported(
            f"Tools of type {hosted[0]!r} are run by OpenAI, not by this server (RESQ_HOSTED_TOOLS "
            "is 'refuse'); send the request without them.",
            f"tools[{index}]",
        )


def plan_tools(
    request: CreateResponseRequest,
    tool_parser: str | None,
    reasoning_parser: str | None,
    refuse_hosted: bool = False,
    constrain_forced: bool = False,
) -> GenerationPlan:
    """The tool part of the plan (400 for what cannot be honoured).

    ``constrain_forced``: the GPU worker constrains decoding, so a forced choice is a grammar of
    calls (a name among those allowed, any object for a tool that is not strict) rather than a
    prefilled opening the model may still leave: prefilled, a model that wrote no JSON object
    after it answered "completed" with the call's markup as its text and no call.
    """
    if refuse_hosted:
        _refuse_hosted(request)
    names = [tool.name for tool in _all_offerable(request)]
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise invalid_value(
            f"Tool names must be unique; {', '.join(repr(name) for name in repeated)} appears more than once.",
            "tools",
        )
    functions = _functions(request)
    choice = request.tool_choice or "auto"
    if choice == "none":
        return GenerationPlan()
    forcing = (
        choice == "required"
        or isinstance(choice, FunctionToolChoice | CustomToolChoice)
        or (isinstance(choice, AllowedToolsChoice) and choice.mode == "required")
    )
    if not functions:
        if forcing:
            raise invalid_value(
                "tool_choice asks for a function call, but the request has no tools.", "tool_choice"
            )
        return GenerationPlan()
    if tool_parser is None:
        raise unsupported(
            "This server has no tool-call parser configured (RESQ_TOOL_PARSER), so it cannot return "
            "function calls; send the request without tools, or with tool_choice 'none'.",
            "tools",
        )
    calls = _constrained_calls(request, functions, tool_parser, forcing, constrain_forced)
    forced_prefix = ""
    if forcing and calls is None:
        forced_prefix = forced_call_prefix(
            reasoning_parser, tool_parser, _forced_function(request, functions)
        )
    single_call = request.parallel_tool_calls is False
    return GenerationPlan(
        template_tools=[_template_tool(tool) for tool in functions],
        tools_enabled=True,
        forced_prefix=forced_prefix,
        stop_after=call_end_tag(tool_parser) if single_call else None,
        max_calls=1 if single_call else None,
        calls=calls,
        custom_tools=tuple(tool.name for tool in functions if isinstance(tool, CustomTool)),
        raw_input_tools=tuple(call.name for call in calls.raw_input_tools) if calls is not None else (),
    )


def answer_schema(request: CreateResponseRequest) -> dict[str, Any] | None:
    """The JSON schema ``text.format`` asks the message text to follow; None for free text."""
    text_format = request.text.format if request.text else None
    if isinstance(text_format, JsonSchemaFormat):
        return text_format.json_schema
    if isinstance(text_format, JsonObjectFormat):
        return dict(ANY_OBJECT)
    return None


def answer_shape(
    request: CreateResponseRequest,
    plan: GenerationPlan,
    reasoning_parser: str | None,
    template_context: dict[str, Any] | None = None,
) -> AnswerShape | None:
    """What constrained decoding must enforce for ``request``; None when nothing is constrained.

    Reasoning is allowed before the answer unless the chat template was told to turn it off.
    """
    schema = answer_schema(request)
    if schema is None and plan.calls is None:
        return None
    if plan.forced_prefix:
        # A prefilled call (no strict function): the answer is that call, whatever text.format says.
        return None
    thinking_off = (template_context or {}).get(THINKING_SWITCH) is False
    reasoning = (
        reasoning_markup(reasoning_parser) if reasoning_parser is not None and not thinking_off else None
    )
    return AnswerShape(reasoning=reasoning, json_schema=schema, calls=plan.calls)


def thinking_context(
    request: CreateResponseRequest, card: ModelCard, reasoning_parser: str | None
) -> dict[str, Any]:
    """Chat-template variables for ``reasoning.effort``."""
    effort = request.reasoning.effort if request.reasoning else None
    if effort is None:
        return {}
    if THINKING_SWITCH in card.chat_template:
        return {THINKING_SWITCH: effort != "none"}
    if effort == "none" and reasoning_parser is not None:
        raise unsupported(
            "reasoning.effort 'none' cannot be honoured: this model's chat template has no switch "
            f"({THINKING_SWITCH}) to turn reasoning off.",
            "reasoning.effort",
        )
    return {}


def wants_logprobs(request: CreateResponseRequest, card: ModelCard) -> bool:
    """Whether to return logprobs (400 when asked and the GPU worker does not compute them)."""
    if not request.wants_logprobs:
        return False
    if not card.logprobs:
        raise unsupported(
            "This server's GPU worker does not compute logprobs (RESQ_LOGPROBS is off), so "
            "include 'message.output_text.logprobs' cannot be served.",
            "include",
        )
    return True


def plan_generation(
    request: CreateResponseRequest,
    card: ModelCard,
    tool_parser: str | None,
    reasoning_parser: str | None,
    refuse_hosted: bool = False,
) -> GenerationPlan:
    """Everything the request asks of generation besides its messages."""
    plan = plan_tools(request, tool_parser, reasoning_parser, refuse_hosted, card.structured_outputs)
    context = thinking_context(request, card, reasoning_parser)
    shape = answer_shape(request, plan, reasoning_parser, context)
    if shape is not None and not card.structured_outputs:
        raise unsupported(
            "This server's GPU worker does not constrain decoding (RESQ_STRUCTURED_OUTPUTS is off), so "
            "text.format json_schema / json_object and strict tools cannot be served.",
            "text.format" if shape.calls is None else "tools",
        )
    penalised = [
        name
        for name in ("presence_penalty", "frequency_penalty")
        if getattr(request, name) not in (None, 0, 0.0)
    ]
    if penalised and not card.penalties:
        raise unsupported(
            f"This server's GPU worker runs its step in a CUDA graph, which cannot apply penalties, so "
            f"{penalised[0]} other than 0 cannot be served (RESQ_STRUCTURED_OUTPUTS=true runs it eagerly).",
            penalised[0],
        )
    return replace(
        plan,
        template_context=context,
        logprobs=wants_logprobs(request, card),
        answer_shape=shape,
    )
