"""Grammars for constrained decoding: what an answer may look like, as one llguidance grammar.

The API builds one grammar per constrained request (``text.format`` json_schema or
json_object, strict function tools, ``tool_choice`` that forces a strict call) and
checks it before anything is queued; the GPU worker compiles it into one matcher
for that request and masks the request's logits with it at every step
(:mod:`gpu_worker.constraints`). Grammars are llguidance's Lark dialect, with JSON
schemas inlined as ``%json {...}``: one library for JSON Schema, regex and Lark,
no per-schema compile step, used by OpenAI itself.

The grammar covers the whole answer, in the chat format the parsers read:

- **Reasoning runs free.** With a reasoning parser, ``<think> ... </think>`` comes
  first (optional where generation starts outside reasoning, as with ``qwen3``;
  required, without the opening tag, where the template already opened it, as
  with ``deepseek_r1``); its text is anything that does not close it. The
  constraint starts where the answer starts, so no JSON lands in the reasoning
  and no reasoning in the JSON.
- **The answer** is the ``text.format`` JSON, or free text, or tool calls in the
  tool parser's envelope (hermes: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``),
  whose ``name`` is one of the offered functions and whose ``arguments`` follow that
  function's ``parameters`` when it is strict (any JSON object otherwise).
- **It ends.** Once the grammar has nothing left to accept, the only token allowed
  is the model's end token, so generation stops (``finish_reason: stop``).

Markup tags (``<think>``, ``<tool_call>``) are single added tokens in Qwen-style
vocabularies, and llguidance sees such tokens as special: a tag is accepted both as
that token and as its plain text, however the model spells it.

JSON is written the way ``json.dumps`` writes it (``", "`` and ``": "``, no other
whitespace), so a model cannot pad an answer with endless blanks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher, LLTokenizer

JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
"""llguidance's JSON options for every inlined schema (``x-guidance``)."""
MAX_GRAMMAR_CHARS = 512 * 1024
"""The largest grammar (schemas included) a request may need: a bigger one gets a 400."""
ANY_OBJECT: dict[str, Any] = {"type": "object"}

SpecialTokenId = Callable[[str], int | None]
"""The id of the single special token spelled ``text``, or None (then the tag is plain text)."""


class GrammarError(ValueError):
    """A schema or grammar that cannot constrain decoding; ``str()`` says why."""


@dataclass(frozen=True)
class ReasoningMarkup:
    """How the reasoning parser delimits reasoning."""

    open_tag: str
    close_tag: str
    starts_inside: bool
    """The chat template opened reasoning already: the answer starts with reasoning text."""


@dataclass(frozen=True)
class CallEnvelope:
    """How the tool parser delimits one call: ``open_tag`` + "\\n" + JSON + "\\n" + ``close_tag``."""

    open_tag: str
    close_tag: str


@dataclass(frozen=True)
class CallableFunction:
    """A function the answer may call, with the schema its arguments must follow."""

    name: str
    arguments_schema: dict[str, Any]


@dataclass(frozen=True)
class CallsShape:
    """The calls an answer may (or must) make."""

    envelope: CallEnvelope
    functions: tuple[CallableFunction, ...]
    required: bool
    """The answer is calls only (``tool_choice`` required or a named function)."""
    single: bool
    """At most one call (``parallel_tool_calls: false``)."""


@dataclass(frozen=True)
class AnswerShape:
    """Everything a grammar needs to know about one request's answer."""

    reasoning: ReasoningMarkup | None
    json_schema: dict[str, Any] | None
    """The schema of the message text (``text.format``); None: free text."""
    calls: CallsShape | None


def styled(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with resq's JSON layout options (the caller's own ``x-guidance`` is replaced)."""
    return {**schema, "x-guidance": JSON_STYLE}


def _literal(text: str) -> str:
    return json.dumps(text)


def tag_expression(text: str, special_token_id: SpecialTokenId) -> str:
    """A Lark expression accepting the tag ``text``: as its special token where it is one, and as text."""
    token_id = special_token_id(text)
    if token_id is None:
        return _literal(text)
    return f"(<[{token_id}]> | {_literal(text)})"


def _not_containing(text: str) -> str:
    # Any text (at least one character) that does not contain `text`: llguidance's regexes
    # support `&` (and) and `~` (not), so "free text up to a tag" needs no lookahead.
    escaped = "".join(f"\\x{ord(c):02x}" if ord(c) < 128 else c for c in text)
    return f"/(.|\\n)+/ & ~/(.|\\n)*{escaped}(.|\\n)*/"


def _call_schema(shape: CallsShape) -> dict[str, Any]:
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": function.name}, "arguments": function.arguments_schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for function in shape.functions
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def build_grammar(shape: AnswerShape, special_token_id: SpecialTokenId) -> str | None:
    """The llguidance grammar of ``shape``; None when nothing constrains the answer."""
    if shape.json_schema is None and (shape.calls is None or not shape.calls.functions):
        return None
    rules = ["%llguidance {}"]
    start = "answer"
    if shape.reasoning is not None:
        markup = shape.reasoning
        opening = tag_expression(markup.open_tag, special_token_id)
        closing = tag_expression(markup.close_tag, special_token_id)
        # Whitespace after the closing tag is the chat format's (the parser drops it); bounded.
        if markup.starts_inside:
            rules.append(f"think: {opening}? THINK_TEXT? {closing} /[ \\n]{{0,4}}/")
            start = "think answer"
        else:
            rules.append(f"think: {opening} THINK_TEXT? {closing} /[ \\n]{{0,4}}/")
            start = "think? answer"
        rules.append(f"THINK_TEXT: {_not_containing(markup.close_tag)}")
    alternatives: list[str] = []
    calls = shape.calls
    if shape.json_schema is not None:
        rules.append(f"json_answer: %json {json.dumps(styled(shape.json_schema))}")
        alternatives.append("json_answer")
    if calls is not None and calls.functions:
        envelope = calls.envelope
        rules.append(
            f'call: {tag_expression(envelope.open_tag, special_token_id)} "\\n" call_body "\\n" '
            f"{tag_expression(envelope.close_tag, special_token_id)}"
        )
        rules.append(f"call_body: %json {json.dumps(styled(_call_schema(calls)))}")
        rules.append("calls: call" if calls.single else 'calls: call ("\\n"? call)*')
        if calls.required:
            alternatives = ["calls"]
        elif shape.json_schema is not None:
            alternatives.append("calls")
        else:
            rules.append(f"FREE_TEXT: {_not_containing(envelope.open_tag)}")
            alternatives = ["FREE_TEXT", "FREE_TEXT? calls"]
            start += "?"  # free text may be empty
    rules.insert(1, f"start: {start}")
    rules.append(f"answer: {' | '.join(alternatives)}")
    grammar = "\n".join(rules) + "\n"
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"The schemas of this request make a grammar of {len(grammar)} characters; "
            f"at most {MAX_GRAMMAR_CHARS} are allowed."
        )
    return grammar


def check_schema(schema: dict[str, Any], tokenizer: LLTokenizer | None = None) -> None:
    """Raise :class:`GrammarError` when llguidance cannot constrain output to ``schema``."""
    if len(json.dumps(schema)) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"The schema is larger than {MAX_GRAMMAR_CHARS} characters.")
    try:
        grammar = LLMatcher.grammar_from_json_schema(styled(schema))
    except ValueError as exc:
        raise GrammarError(f"The schema is not a valid JSON object: {exc}") from exc
    check_grammar(grammar, tokenizer)


def check_grammar(grammar: str, tokenizer: LLTokenizer | None = None) -> None:
    """Raise :class:`GrammarError` when ``grammar`` does not compile (for ``tokenizer``, when given)."""
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:
        raise GrammarError(_first_line(messages[0] if messages else "the grammar does not compile"))


def _first_line(message: str) -> str:
    # llguidance's messages end with a caret diagram of the grammar: the first line says it.
    return message.strip().splitlines()[0].removeprefix("at 1(8): ").strip()
