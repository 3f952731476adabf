"""The Hermes tool-call parser: ``<tool_call>{json}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3).

A block whose JSON (whitespace around it allowed) is an object with a non-empty
string ``name`` and an ``arguments`` object, or a JSON string holding one, becomes
a :class:`ToolCallSegment` whose ``arguments`` is the object's JSON text as the model wrote
it (or the string's content). Text outside blocks goes on as :class:`TextSegment`\\ s.

Nothing that is not a valid call is lost or invented:

- a block with invalid JSON, a missing or empty ``name``, or ``arguments`` that
  are not an object is released as plain text, the raw markup included, exactly
  as generated (no phantom call);
- a block still open when the output ends (cut off) is released the same way, except
  where a grammar constrains the calls: there it can only be a call that
  ``max_output_tokens`` cut, and it is dropped (the response is ``incomplete``);
- a stray ``</tool_call>`` outside a block is plain text too.

Raw-input calls: a tool whose input follows a Lark grammar (a custom tool) is called
as ``<tool_call>\\n{"name": ...}\\n`` + the input as it is + ``\\n</tool_call>`` (the JSON
form could only carry it as an escaped string). For the names in ``raw_input_tools``, a
block whose first line is ``{"name": <that name>}`` alone becomes a
:class:`CustomToolCallSegment` whose input is the rest of the block, less the newline
before the closing tag. Such an input cannot itself contain ``</tool_call>``.

Where a grammar constrains the calls (``well_formed_json``), a block's JSON is well-formed,
so a ``</tool_call>`` inside one of its strings (arguments quoting the chat format) is text of
that string, not the block's end: the end is the first ``</tool_call>`` after the block's JSON
value (:class:`JsonValueEnd`). Without a grammar a model may write broken JSON, and the first
``</tool_call>`` ends the block, as before, so that one broken call cannot swallow the rest.

Whitespace: a run of text between two calls, or between a call and the start or
end of the output, that is whitespace only (the ``"\\n"`` between two calls) is
dropped, so it never opens an empty message. Any run with a visible character is
kept exactly, its whitespace included (``"Let me check.\\n"`` before a call).

Streaming: text is released as soon as it cannot be part of a tag (a tail such
as ``<tool_`` waits for the next chunk), except that a run's leading whitespace
waits for its first visible character, and a block waits for its ``</tool_call>``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from resq.postprocess.parsers.markup import partial_tag_length
from resq.postprocess.segments import CustomToolCallSegment, Segment, TextSegment, ToolCallSegment

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


class HermesToolParser:
    """Finds ``<tool_call>`` blocks in answer text of any chunking."""

    def __init__(self, raw_input_tools: frozenset[str] = frozenset(), well_formed_json: bool = False) -> None:
        self._raw_input_tools = raw_input_tools
        self._well_formed_json = well_formed_json
        self._body_value = JsonValueEnd()
        """Where the open block's JSON value ends (read only with ``well_formed_json``)."""
        self._buffer = ""
        self._offset = 0
        """Where the buffer starts in the text fed so far (text segments say where they come from)."""
        self._in_call = False
        self._open_at = 0
        """Where the open block's ``<tool_call>`` starts."""
        self._scanned = 0
        """In a block: how much of the buffer is known to hold no ``</tool_call>``."""
        self._run_has_text = False
        """Whether the current text run (since the start or the last call) showed a visible character."""
        self._held_whitespace = ""
        """The current run's text while it is whitespace only."""
        self._held_at = 0
        self._after_call = False

    def feed(self, text: str) -> list[Segment]:
        """Segments that ``text`` (the next chunk of answer text) completes."""
        self._buffer += text
        out: list[Segment] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Segment]:
        """Release everything held back; the parser is then ready for new text, as if new.

        The chain also calls this where a reasoning block interrupts the answer, so no
        call is ever assembled across reasoning.
        """
        out: list[Segment] = []
        if self._in_call:
            self._in_call = False
            if not self._well_formed_json:
                self._text(out, CALL_OPEN + self._buffer, self._open_at)
            # Under a grammar an open block can only be a call cut off (max_output_tokens): it
            # is no text of the answer, and its markup must not reach output_text.
        else:
            held = partial_tag_length(self._buffer, (CALL_OPEN,))
            if self._well_formed_json and (held > 1 or (held and self._after_call)):
                # Under a grammar, "<tool_c" at the end is a call cut off in its opening tag, and
                # so is a lone "<" after a call (the grammar allows no text after one).
                self._text(out, self._buffer[: len(self._buffer) - held], self._offset)
            else:
                self._text(out, self._buffer, self._offset)
        if self._held_whitespace and not self._after_call:
            out.append(TextSegment(self._held_whitespace, start=self._held_at))
        self._offset += len(self._buffer)
        self._buffer = ""
        self._run_has_text = False
        self._held_whitespace = ""
        self._after_call = False
        return out

    # --- internals -----------------------------------------------------------------------------

    def _step(self, out: list[Segment]) -> bool:
        """Process the buffer up to its next tag; False when it needs more text."""
        if self._in_call:
            value_end = 0
            if self._well_formed_json:
                found_end = self._body_value.scan(self._buffer)
                if found_end is None:
                    return False  # still inside the block's JSON: no close tag counts yet
                value_end = found_end
            end = self._buffer.find(CALL_CLOSE, max(self._scanned, value_end))
            if end < 0:
                # Rescan only the tail where a close tag could still be completed.
                self._scanned = max(value_end, len(self._buffer) - len(CALL_CLOSE) + 1)
                return False
            body = self._buffer[:end]
            self._advance(end + len(CALL_CLOSE))
            self._in_call = False
            self._close_block(out, body)
            return True
        start = self._buffer.find(CALL_OPEN)
        if start < 0:
            release = len(self._buffer) - partial_tag_length(self._buffer, (CALL_OPEN,))
            self._text(out, self._buffer[:release], self._offset)
            self._advance(release)
            return False
        self._text(out, self._buffer[:start], self._offset)
        self._open_at = self._offset + start
        self._advance(start + len(CALL_OPEN))
        self._in_call = True
        self._scanned = 0
        self._body_value = JsonValueEnd()
        return True

    def _close_block(self, out: list[Segment], body: str) -> None:
        call: Segment | None = parse_call(body)
        if call is None and self._raw_input_tools:
            call = parse_raw_input_call(body, self._raw_input_tools)
        if call is None:
            self._text(out, CALL_OPEN + body + CALL_CLOSE, self._open_at)
            return
        # Whitespace-only text right before a call is dropped with it.
        self._held_whitespace = ""
        out.append(call)
        self._run_has_text = False
        self._after_call = True

    def _advance(self, length: int) -> None:
        """Drop ``length`` characters from the buffer's head."""
        self._buffer = self._buffer[length:]
        self._offset += length

    def _text(self, out: list[Segment], text: str, start: int) -> None:
        """Release ``text``, found at offset ``start`` of the input, as answer text."""
        if not text:
            return
        if not self._run_has_text:
            if self._held_whitespace:
                # The held whitespace ends where `text` starts: the two are one slice.
                start = self._held_at
            text = self._held_whitespace + text
            if text.isspace():
                self._held_whitespace = text
                self._held_at = start
                return
            self._held_whitespace = ""
            self._run_has_text = True
        out.append(TextSegment(text, start=start))


class JsonValueEnd:
    """Finds, incrementally, where a text's leading JSON object ends (strings and escapes
    followed, so a brace or a tag inside a string does not count). A text that does not start
    with ``{`` (after whitespace) ends at once: there is no value to skip."""

    def __init__(self) -> None:
        self._at = 0
        self._depth = 0
        self._started = False
        self._in_string = False
        self._escaped = False
        self._end: int | None = None

    def scan(self, text: str) -> int | None:
        """Where the value ends in ``text`` (the same text, grown, at every call), or None while
        it has not ended."""
        at, end = self._at, self._end
        while end is None and at < len(text):
            char = text[at]
            at += 1
            if not self._started:
                if char.isspace():
                    continue
                if char != "{":
                    end = at - 1
                    break
                self._started, self._depth = True, 1
            elif self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = at
        self._at, self._end = at, end
        return end


def forced_call_opening(name: str | None) -> str:
    """The start of a call, for a model that must call: of any function, or of ``name``.

    It ends where the model's own tokens would start a new pre-token (after ``"`` or
    after ``":``), so the model continues it with the tokens it would have chosen
    had it written the opening itself.
    """
    opening = CALL_OPEN + '\n{"name": "'
    if name is None:
        return opening
    return opening + json.dumps(name, ensure_ascii=False)[1:-1] + '", "arguments":'


def _reject_constant(name: str) -> Any:
    # NaN and Infinity are not JSON: json.dumps would write them back out as invalid arguments.
    raise ValueError(f"not JSON: {name}")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _skip_whitespace(text: str, at: int) -> int:
    """Where the JSON whitespace from ``at`` on ends."""
    found = _WHITESPACE.match(text, at)
    return at if found is None else found.end()


def _members(text: str) -> dict[str, tuple[Any, str]] | None:
    """The members of the JSON object ``text`` is (whitespace around it allowed), each value with
    its text as written; None when ``text`` is no JSON object. (The last of a repeated key wins,
    as ``json.loads`` has it.)"""
    members: dict[str, tuple[Any, str]] = {}
    at = _skip_whitespace(text, 0)
    if not text.startswith("{", at):
        return None
    at = _skip_whitespace(text, at + 1)
    if text.startswith("}", at):
        at += 1
    else:
        while True:
            if not text.startswith('"', at):
                return None
            key, at = _DECODER.raw_decode(text, at)  # a JSON string, as the quote says
            at = _skip_whitespace(text, at)
            if not text.startswith(":", at):
                return None
            at = _skip_whitespace(text, at + 1)
            value, end = _DECODER.raw_decode(text, at)
            members[key] = (value, text[at:end])
            at = _skip_whitespace(text, end)
            if text.startswith(",", at):
                at = _skip_whitespace(text, at + 1)
            elif text.startswith("}", at):
                at += 1
                break
            else:
                return None
    return members if _skip_whitespace(text, at) == len(text) else None


def parse_call(body: str) -> ToolCallSegment | None:
    """The call a block's body describes, or None when it is not a valid call.

    Its ``arguments`` are the model's JSON text, as written: parsed and written again, a number
    past a float's range became ``Infinity`` (no JSON: a strict tool's arguments failed to parse
    in the client) and others lost their digits.
    """
    try:
        members = _members(body)
        if members is None:
            return None
        name = members.get("name", (None, ""))[0]
        arguments, arguments_text = members.get("arguments", (None, ""))
        if isinstance(arguments, str):  # a JSON string holding the object
            arguments_text = arguments
            is_object = _members(arguments_text) is not None
        else:
            is_object = isinstance(arguments, dict)
    except (ValueError, RecursionError):
        return None
    if not isinstance(name, str) or not name or not is_object:
        return None
    return ToolCallSegment(name, arguments_text.strip())


def parse_raw_input_call(body: str, names: frozenset[str]) -> CustomToolCallSegment | None:
    """The raw-input call a block's body describes (a name in ``names``), or None."""
    header, newline, text = body.removeprefix("\n").partition("\n")
    if not newline:
        return None
    try:
        obj = _loads(header)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or set(obj) != {"name"} or obj["name"] not in names:
        return None
    return CustomToolCallSegment(obj["name"], text.removesuffix("\n"))
