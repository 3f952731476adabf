"""The grammar of a constrained request, checked before anything is queued.

A schema llguidance cannot compile (invalid, an unsupported JSON Schema feature, a
bad regex ``pattern``, too large) is a 400 ``invalid_json_schema`` naming the field
it came from, so nothing the GPU worker would refuse ever reaches it. The whole
grammar is compiled once; only when that fails are the request's schemas compiled
one by one, to name the culprit. A grammar the model's vocabulary accepted recently
(an agent's tools, every turn) is not compiled again (:class:`resq.grammars.AcceptedGrammars`).
Runs in a worker thread: compiling a large schema takes milliseconds to a second.

A new grammar's parts that can refer back to themselves (a schema with a ``$ref``, a custom
tool's Lark grammar) are also each checked at their own start, for the model's vocabulary: one
that refers to itself before producing any text compiles, and would fail the response at the
GPU worker as soon as the answer reached it (after reasoning, or a call's opening). It is a 400
naming the part instead. Parts without references cannot do that and cost nothing more.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from llguidance import LLMatcher

from api import metrics
from api.errors import OpenAIError, invalid_value
from api.generation_plan import GenerationPlan, answer_schema, custom_input_schema
from api.schemas import CreateResponseRequest, CustomTool, FunctionTool, NamespaceTool
from resq.catalog import TextTokenizer
from resq.grammars import (
    GrammarError,
    build_grammar,
    check_first_step,
    check_grammar,
    regex_error,
    schema_grammar,
)


@dataclass(frozen=True)
class _Part:
    """One part of the grammar a request brings."""

    grammar: Callable[[], str]
    param: str
    what: str
    """How a message names it."""
    code: str
    may_refer_back: bool
    """Whether it can refer back to itself (a schema with a ``$ref``, a Lark grammar)."""

    def error(self, exc: GrammarError) -> OpenAIError:
        """The 400 naming this part."""
        return invalid_value(f"{self.what}: {exc}", self.param, self.code)


def _parts(request: CreateResponseRequest) -> Iterator[_Part]:
    """Each part of the grammar a request brings."""
    schema = answer_schema(request)
    if schema is not None and request.text is not None:
        name = getattr(request.text.format, "name", None)
        what = f"Invalid schema for response_format '{name}'" if name else "Invalid schema for text.format"
        yield _Part(
            partial(schema_grammar, schema),
            "text.format.schema",
            what,
            "invalid_json_schema",
            _refers(schema),
        )
    for path, tool in _tools(request):
        if isinstance(tool, FunctionTool) and tool.strict and tool.parameters is not None:
            what = f"Invalid schema for function '{tool.name}'"
            yield _Part(
                partial(schema_grammar, tool.parameters),
                f"{path}.parameters",
                what,
                "invalid_json_schema",
                _refers(tool.parameters),
            )
        elif isinstance(tool, CustomTool) and (tool.regex is not None or tool.lark is not None):
            grammar = (
                partial(schema_grammar, custom_input_schema(tool))
                if tool.regex is not None
                else partial(LLMatcher.grammar_from_lark, tool.lark or "")
            )
            what = f"Invalid grammar for custom tool '{tool.name}'"
            yield _Part(grammar, f"{path}.format.definition", what, "invalid_value", tool.lark is not None)


def _refers(schema: dict[str, Any]) -> bool:
    # The schema as sent was parsed from JSON: its text holds the key wherever a reference is
    # (a property or a string that spells it costs one more check, no more).
    return '"$ref"' in json.dumps(schema)


def _culprit(request: CreateResponseRequest, tokenizer: TextTokenizer) -> OpenAIError | None:
    """The first part that does not compile on its own."""
    for part in _parts(request):
        try:
            check_grammar(part.grammar(), tokenizer.grammar_tokenizer)
        except GrammarError as exc:
            return part.error(exc)
    return None


def _check_first_steps(request: CreateResponseRequest, tokenizer: TextTokenizer) -> None:
    """400 for the first part that may refer back to itself and cannot take its first step."""
    for part in _parts(request):
        if part.may_refer_back:
            try:
                check_first_step(part.grammar(), tokenizer.grammar_tokenizer)
            except GrammarError as exc:
                raise part.error(exc) from exc


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
            compiled = tokenizer.grammar_checks.check(
                grammar, then=partial(_check_first_steps, request, tokenizer)
            )
            metrics.GRAMMAR_CHECKS.labels("compiled" if compiled else "remembered").inc()
    except GrammarError as exc:
        culprit = _culprit(request, tokenizer)
        if culprit is not None:
            raise culprit from exc
        param = "text.format" if shape.calls is None else "tools"
        raise invalid_value(f"The request's output constraints cannot be enforced: {exc}", param) from exc
    return grammar
