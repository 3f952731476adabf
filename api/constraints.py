"""The grammar of a constrained request, checked before anything is queued.

A schema llguidance cannot compile (invalid, an unsupported JSON Schema feature, a
bad regex ``pattern``, too large) is a 400 ``invalid_request_error`` naming the
field it came from, so nothing the GPU worker would refuse ever reaches it. Runs
in a worker thread: compiling a large schema takes milliseconds to a second.
"""

from __future__ import annotations

from typing import Any

from api.errors import OpenAIError, invalid_value
from api.generation_plan import GenerationPlan, answer_schema
from api.schemas import CreateResponseRequest, FunctionTool
from resq.catalog import TextTokenizer
from resq.grammars import GrammarError, build_grammar, check_grammar, check_schema


def _refused(message: str, param: str) -> OpenAIError:
    # OpenAI's code for a schema it refuses; anything else is a plain invalid value.
    code = "invalid_json_schema" if param.endswith(("schema", "parameters")) else "invalid_value"
    return invalid_value(message, param, code)


def _check_schema(schema: dict[str, Any], tokenizer: TextTokenizer, param: str, what: str) -> None:
    try:
        check_schema(schema, tokenizer.grammar_tokenizer)
    except GrammarError as exc:
        raise _refused(f"Invalid schema for {what}: {exc}", param) from exc


def request_grammar(
    request: CreateResponseRequest, plan: GenerationPlan, tokenizer: TextTokenizer
) -> str | None:
    """The llguidance grammar the answer must follow, or None; 400 for a schema that cannot constrain."""
    shape = plan.answer_shape
    if shape is None:
        return None
    schema = answer_schema(request)
    if schema is not None and request.text is not None:
        name = getattr(request.text.format, "name", None)
        what = f"response_format '{name}'" if name else "text.format"
        _check_schema(schema, tokenizer, "text.format.schema", what)
    for index, tool in enumerate(request.tools or []):
        if isinstance(tool, FunctionTool) and tool.strict and tool.parameters is not None:
            _check_schema(tool.parameters, tokenizer, f"tools[{index}].parameters", f"function '{tool.name}'")
    param = "text.format" if shape.calls is None else "tools"
    try:
        grammar = build_grammar(shape, tokenizer.special_token_id)
        if grammar is not None:
            check_grammar(grammar, tokenizer.grammar_tokenizer)
    except GrammarError as exc:
        raise _refused(f"The request's output constraints cannot be enforced: {exc}", param) from exc
    return grammar
