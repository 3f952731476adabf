"""Grammars for constrained decoding: what an answer may look like, as one llguidance grammar.

The API builds one grammar per constrained request (``text.format`` json_schema or
json_object, strict function tools, custom tools with a grammar, ``tool_choice``
that forces such a call) and checks it before anything is queued; the GPU worker
compiles it into one matcher for that request and masks the request's logits with it
at every step (:mod:`gpu_worker.constraints`). A grammar is llguidance's top-level
JSON form, ``{"grammars": [...]}``: the answer in llguidance's Lark dialect, with JSON
schemas inlined as ``%json {...}``, then each Lark custom tool's own grammar, which
the answer references by name. One library for JSON Schema, regex and Lark, no
per-schema compile step, used by OpenAI itself.

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
  function's ``parameters`` when it is strict (any JSON object otherwise). A tool whose
  input follows a Lark grammar (a custom tool) is called in the raw-input form instead,
  ``<tool_call>\\n{"name": ...}\\n`` + the input as it is + ``\\n</tool_call>``: JSON
  could only carry the input as an escaped string, which a context-free grammar cannot
  constrain. Its grammar is a grammar of its own, referenced by name (``@tool_0``).
- **It ends.** Once the grammar has nothing left to accept, the only token allowed
  is the model's end token, so generation stops (``finish_reason: stop``).

Markup tags (``<think>``, ``<tool_call>``) are single added tokens in Qwen-style
vocabularies, and llguidance sees such tokens as special: a tag is accepted both as
that token and as its plain text, however the model spells it.

JSON is written the way ``json.dumps`` writes it (``", "`` and ``": "``, no other
whitespace), so a model cannot pad an answer with endless blanks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from resq.deep_stack import on_deep_stack

JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
"""llguidance's JSON options for every inlined schema (``x-guidance``)."""
MAX_GRAMMAR_CHARS = 512 * 1024
"""The largest grammar (schemas included) a request may need: a bigger one gets a 400."""
ANY_OBJECT: dict[str, Any] = {"type": "object"}
ACCEPTED_GRAMMARS_KEPT = 256
"""How many distinct grammars a vocabulary remembers having accepted (:class:`AcceptedGrammars`)."""

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
class RawInputTool:
    """A tool called with raw input that must follow a Lark grammar (the raw-input form)."""

    name: str
    lark_grammar: str


@dataclass(frozen=True)
class CallsShape:
    """The calls an answer may (or must) make."""

    envelope: CallEnvelope
    functions: tuple[CallableFunction, ...]
    required: bool
    """The answer is calls only (``tool_choice`` required or a named function)."""
    single: bool
    """At most one call (``parallel_tool_calls: false``)."""
    raw_input_tools: tuple[RawInputTool, ...] = ()
    """Tools called in the raw-input form, their input following a Lark grammar."""


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


CALL_HEAD = '\n{"name": "'
"""What follows the envelope's opening tag in both call forms, up to the name."""
JSON_CALL_AFTER_NAME = '", "arguments": '
"""A JSON call after its name: the arguments object follows, then ``}``."""
RAW_CALL_AFTER_NAME = '"}\n'
"""A raw-input call after its name: the input follows as it is, then the closing newline."""


def _call_rules(shape: CallsShape, special_token_id: SpecialTokenId) -> list[str]:
    """``call``: the envelope, then one alternative per tool, each starting with its name.

    Spelling the name out per alternative (rather than one JSON schema over all calls)
    lets raw-input calls and JSON calls share the opening ``{"name": "``: the name's
    literal decides which form follows. Names cannot hold quotes (request validation).
    """
    opening = tag_expression(shape.envelope.open_tag, special_token_id)
    closing = tag_expression(shape.envelope.close_tag, special_token_id)
    alternatives: list[str] = []
    arguments: list[str] = []
    for index, function in enumerate(shape.functions):
        json_start = _literal(function.name + JSON_CALL_AFTER_NAME)
        alternatives.append(f'{json_start} arguments_{index} "}}"')
        arguments.append(f"arguments_{index}: %json {json.dumps(styled(function.arguments_schema))}")
    for index, tool in enumerate(shape.raw_input_tools):
        raw_start = _literal(tool.name + RAW_CALL_AFTER_NAME)
        alternatives.append(f"{raw_start} @{raw_input_grammar_name(index)}")
    return [
        f'call: {opening} {_literal(CALL_HEAD)} call_tail "\\n" {closing}',
        f"call_tail: {' | '.join(alternatives)}",
        *arguments,
    ]


_LARK_LITERALS = re.compile(r'//[^\n]*|"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*')
"""A Lark grammar's comments, strings and regexes, whose text may hold anything."""
_LLGUIDANCE_REFERENCES = re.compile(r"<\[[^\]]*\]>|<[^\s<>\"/]+>|@[A-Za-z_][A-Za-z0-9_]*")
"""llguidance's extensions that reach outside a grammar: token references (``<[0]>``, a special
token by name, ``<|endoftext|>``) and other grammars by name (``@tool_0``)."""


@functools.lru_cache(maxsize=ACCEPTED_GRAMMARS_KEPT)
def client_grammar_reference(lark_grammar: str) -> str | None:
    """The first token or grammar reference a client's Lark grammar makes outside its strings,
    regexes and comments, or None. Such a grammar reaches beyond its input: a token reference
    writes the model's end token or markup into it (a call that can never close), and a grammar
    reference names resq's other grammars (the next tool's, its own). Remembered per grammar: an
    agent sends the same tools every turn."""
    found = _LLGUIDANCE_REFERENCES.search(_LARK_LITERALS.sub(" ", lark_grammar))
    return found.group(0) if found else None


def raw_input_grammar_name(index: int) -> str:
    """The name the main grammar references the ``index``-th raw-input tool's grammar by."""
    return f"tool_{index}"


def build_grammar(shape: AnswerShape, special_token_id: SpecialTokenId) -> str | None:
    """The llguidance grammar of ``shape``; None when nothing constrains the answer."""
    calls = shape.calls
    offered = calls is not None and bool(calls.functions or calls.raw_input_tools)
    if shape.json_schema is None and not offered:
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
    if shape.json_schema is not None:
        rules.append(f"json_answer: %json {json.dumps(styled(shape.json_schema))}")
        alternatives.append("json_answer")
    if calls is not None and offered:
        envelope = calls.envelope
        rules += _call_rules(calls, special_token_id)
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
    grammars: list[dict[str, str]] = [{"lark_grammar": "\n".join(rules) + "\n"}]
    for index, tool in enumerate(calls.raw_input_tools if calls is not None else ()):
        grammars.append({"name": raw_input_grammar_name(index), "lark_grammar": tool.lark_grammar})
    grammar = json.dumps({"grammars": grammars})
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"The schemas of this request make a grammar of {len(grammar)} characters; "
            f"at most {MAX_GRAMMAR_CHARS} are allowed."
        )
    return grammar


def schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of output that follows ``schema`` (resq's JSON layout)."""
    if len(json.dumps(schema)) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"The schema is larger than {MAX_GRAMMAR_CHARS} characters.")
    try:
        return LLMatcher.grammar_from_json_schema(styled(schema))
    except ValueError as exc:
        raise GrammarError(f"The schema is not a valid JSON object: {exc}") from exc


@functools.lru_cache(maxsize=ACCEPTED_GRAMMARS_KEPT)
def regex_error(regex: str) -> str | None:
    """Why ``regex`` does not compile on its own, or None. Remembered per regex: an agent sends
    the same tools every turn."""
    try:
        check_grammar(LLMatcher.grammar_from_regex(regex))
    except GrammarError as exc:
        return str(exc)
    return None


def check_grammar(grammar: str, tokenizer: LLTokenizer | None = None) -> None:
    """Raise :class:`GrammarError` when ``grammar`` does not compile (for ``tokenizer``, when given)."""
    # llguidance's compiler recurses as deep as the grammar's chains of rules (resq.deep_stack).
    failed, messages = on_deep_stack(LLMatcher.validate_grammar_with_warnings, grammar, tokenizer)
    if failed:
        raise GrammarError(_first_line(messages[0] if messages else "the grammar does not compile"))


def check_first_step(grammar: str, tokenizer: LLTokenizer) -> None:
    """Raise :class:`GrammarError` when ``grammar`` does not compile for ``tokenizer`` or cannot take
    its first step: a grammar that refers back to itself before any text (a schema's ``$ref``
    leading to itself, a Lark rule defined by itself) compiles, and the GPU worker's first mask
    failed the response with llguidance's NoExtensionBias. (A limit of the parser reached later
    in an answer cannot be foreseen without generating it: that response fails, as it must.)
    About 0.7 ms a small schema on a 2k vocabulary, where a compile alone is 0.2-0.4 ms."""
    error = on_deep_stack(_first_step_error, grammar, tokenizer)
    if error is not None:
        raise GrammarError(_first_line(error))


def _first_step_error(grammar: str, tokenizer: LLTokenizer) -> str | None:
    # A matcher, as the GPU worker builds it (its compile fails with validate_grammar's messages).
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if not matcher.is_error():
        return None
    error = str(matcher.get_error())
    return NO_PROGRESS_MESSAGE if NO_PROGRESS_ERROR in error else error


NO_PROGRESS_ERROR = "NoExtensionBias"
"""llguidance's error for a grammar whose start can produce no token."""
NO_PROGRESS_MESSAGE = (
    "It can produce no text: it refers back to itself before producing any (a schema whose $ref "
    "leads back to itself, a rule defined by itself)."
)


class AcceptedGrammars:
    """Checks grammars against one vocabulary, remembering the last ones it accepted.

    An agent sends the same tools (strict ones constrain its calls) and the same ``text.format``
    on every turn, and compiling their grammar to check it took 1-10 ms of the API's CPU per
    turn with a handful to twenty tools (more for large schemas) before the request was queued.
    A grammar accepted before is accepted again at once (the GPU worker keeps its compiled
    matchers likewise, :data:`gpu_worker.constraints.COMPILED_GRAMMARS_KEPT`). Only accepted
    grammars are remembered, by digest (bounded memory whatever their size); a refused one is
    compiled each time, to say why. Thread-safe: checks run in worker threads.
    """

    def __init__(self, tokenizer: LLTokenizer | None, kept: int = ACCEPTED_GRAMMARS_KEPT) -> None:
        """``tokenizer``: the vocabulary to check against (None: the grammar alone)."""
        self._tokenizer = tokenizer
        self._kept = kept
        self._accepted: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def remembers(self, grammar: str) -> bool:
        """Whether ``grammar`` was accepted recently (it counts as used again)."""
        digest = _digest(grammar)
        with self._lock:
            if digest in self._accepted:
                self._accepted.move_to_end(digest)
                return True
        return False

    def check(self, grammar: str, then: Callable[[], None] | None = None) -> bool:
        """Raise :class:`GrammarError` when ``grammar`` does not compile; True when it was compiled
        now, False when it had been accepted before. ``then``: more checks of a grammar that
        compiled, run before it is remembered (whatever they raise, it is not)."""
        if self.remembers(grammar):
            return False
        digest = _digest(grammar)
        check_grammar(grammar, self._tokenizer)
        if then is not None:
            then()
        with self._lock:
            self._accepted[digest] = None
            while len(self._accepted) > self._kept:
                self._accepted.popitem(last=False)
        return True


def _digest(grammar: str) -> bytes:
    return hashlib.blake2b(grammar.encode(), digest_size=16).digest()


def _first_line(message: str) -> str:
    """llguidance's message as one sentence. Its messages end with a caret diagram of the grammar,
    so the first line says it, except that a regex's first line only opens the regex parser's
    own report ("regex parse error:"), whose last line (``error: ...``) says why."""
    lines = [line.strip() for line in message.strip().splitlines()]
    first = lines[0].removeprefix("at 1(8): ").strip()
    if first.endswith(":"):
        why = next((line.removeprefix("error:").strip() for line in lines if line.startswith("error:")), "")
        first = f"{first} {why}" if why else first.removesuffix(":")
    return first if first.endswith(".") else first + "."
