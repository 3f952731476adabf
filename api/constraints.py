"""The grammar of a constrained request, checked before anything is queued.

A schema llguidance cannot compile (invalid, an unsupported JSON Schema feature, a
bad regex ``pattern``, too large) is a 400 ``invalid_json_schema`` naming the field
it came from, so nothing the GPU worker would refuse ever reaches it. The whole
grammar is compiled once; only when that fails are the request's schemas compiled
one by one, to name the culprit. A grammar the model's vocabulary accepted recently
(an agent's tools, every turn) is not compiled again (:class:`resq.grammars.AcceptedGrammars`).
Runs in a worker thread: compiling a large schema takes milliseconds to a second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

from llguidance import LLMatcher

from api import metrics
from api.errors import OpenAIError, invalid_value
from api.generation_plan import GenerationPlan, answer_schema, custom_input_schema
from api.schemas import CreateResponseRequest, CustomTool, FunctionTool, NamespaceTool
from resq.catalog import TextTokenizer
from resq.grammars import GrammarError, build_grammar, check_grammar, regex_error, schema_grammar


def _parts(request: CreateResponseRequest) -> Iterator[tuple[Callable[[], str], str, str, str]]:
    """Each part of the grammar a request brings: (its grammar, its param, how a message names it, the code)."""
    schema = answer_schema(request)
    if schema is not None and request.text is not None:
        name = getattr(request.text.format, "name", None)
        what = f"Invalid schema for response_format '{name}'" if name else "Invalid schema for text.format"
        yield partial(schema_grammar, schema), "text.format.schema", what, "invalid_json_schema"
    for path, tool in _tools(request):
        if isinstance(tool, FunctionTool) and tool.strict and tool.parameters is not None:
            what = f"Invalid schema for function '{tool.name}'"
            yield (
                partial(schema_grammar, tool.parameters),
                f"{path}.parameters",
                what,
                "invalid_json_schema",
            )
        elif isinstance(tool, CustomTool) and (tool.regex is not None or tool.lark is not None):
            part = (
                partial(schema_grammar, custom_input_schema(tool))
                if tool.regex is not None
                else partial(LLMatcher.grammar_from_lark, tool.lark or "")
            )
            what = f"Invalid grammar for custom tool '{tool.name}'"
            yield part, f"{path}.format.definition", what, "invalid_value"


def _culprit(request: CreateResponseRequest, tokenizer: TextTokenizer) -> OpenAIError | None:
    for grammar, param, what, code in _parts(request):
        try:
            check_grammar(grammar(), tokenizer.grammar_tokenizer)
        except GrammarError as exc:
            return invalid_value(f"{what}: {exc}", param, code)
    return None


def _tools(request: CreateResponseRequest) -> Iterator[tuple[str, object]]:
    """Each tool of the request with its param path, a namespace's own tools in its place."""
    for index, tool in enumerate(request.tools or []):
        if isinstance(tool, NamespaceTool):
            for inner_index, inner in enumerate(tool.tools):
                yield f"tools[{index}].tools[{inner_index}]", inner
        else:
            yield f"tools[{index}]", tool


def _regex_tools(request: CreateResponseRequest) -> Iterator[tuple[str, CustomTool]]:
    """Each custom tool with a regex grammar, namespaced ones included, with its param path."""
    for path, tool in _tools(request):
        if isinstance(tool, CustomTool) and tool.regex is not None:
            yield path, tool


def _check_regexes(request: CreateResponseRequest) -> None:
    """400 for a custom tool's regex that does not compile on its own. The grammar wraps it
    (``^(?:...)$``, the whole input matches), and a wrapped ``a)|(.*`` compiles into a regex that
    matches anything: it must be checked before it is wrapped."""
    for path, tool in _regex_tools(request):
        error = regex_error(tool.regex or "")
        if error is not None:
            raise invalid_value(
                f"Invalid grammar for custom tool '{tool.name}': {error}", f"{path}.format.definition"
            )


def request_grammar(
    request: CreateResponseRequest, plan: GenerationPlan, tokenizer: TextTokenizer
) -> str | None:
    """The llguidance grammar the answer must follow, or None; 400 for a schema that cannot constrain."""
    shape = plan.answer_shape
    if shape is None:
        return None
    _check_regexes(request)
    try:
        grammar = build_grammar(shape, tokenizer.special_token_id)
        if grammar is not None:
            compiled = tokenizer.grammar_checks.check(grammar)
            metrics.GRAMMAR_CHECKS.labels("compiled" if compiled else "remembered").inc()
    except GrammarError as exc:
        culprit = _culprit(request, tokenizer)
        if culprit is not None:
            raise culprit from exc
        param = "text.format" if shape.calls is None else "tools"
        raise invalid_value(f"The request's output constraints cannot be enforced: {exc}", param) from exc
    return grammar
