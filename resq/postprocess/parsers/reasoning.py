"""The ``<think>...</think>`` reasoning parser (Qwen3, DeepSeek-R1) and exact reasoning-token counts.

Text between ``<think>`` and ``</think>`` becomes :class:`ReasoningSegment`\\ s; the rest
is answer text, passed on as :class:`TextSegment`\\ s to the next stage. The tags
themselves never reach any text, whichever way the chunks cut them.

Where generation starts
    A chat template may already have put ``<think>`` at the end of the prompt
    (DeepSeek-R1 and its distills, Qwen3 "thinking" variants): generation then
    starts inside reasoning and only ``</think>`` shows up. Guessing this from the
    output would mean holding the whole answer back until ``</think>`` does or does
    not appear, which breaks streaming. So it is a fixed per-parser setting,
    ``starts_in_reasoning``:

    - ``qwen3`` (False): the output is answer text unless it opens with ``<think>``
      (leading whitespace allowed). The only other way in is a ``</think>`` before
      any answer text at all (after optional whitespace): that is an empty reasoning
      block. While nothing but whitespace and a possible tag prefix has arrived,
      that text is held back; anything else is streamed at once. A model whose
      template opens ``<think>`` needs ``deepseek_r1`` instead: with ``qwen3`` its
      reasoning would stream as answer text (minus the stray ``</think>``).
    - ``deepseek_r1`` (True): the output starts as reasoning. A ``<think>`` the model
      writes anyway (older templates) is simply dropped, so both template styles
      parse the same.

Whitespace (the same result for any chunking)
    The only whitespace removed is whitespace that touches a think tag:

    - the reasoning of each block is trimmed at both ends (a block with only
      whitespace in it yields no reasoning at all, hence no empty reasoning item);
    - whitespace between ``</think>`` and the first other character of the answer
      is dropped, so ``output_text`` does not start with blank lines;
    - whitespace before an opening ``<think>`` at the very start is dropped.

    Everything else, reasoning inside and answer text, is kept exactly as generated.
    The fixture answer ``"<think>\\nTwo plus two equals four.\\n</think>\\n\\nThe answer is 4."``
    gives the reasoning ``"Two plus two equals four."`` and the answer ``"The answer is 4."``.

Stray tags
    ``<think>`` inside reasoning and ``</think>`` inside the answer are dropped (never
    shown as text); ``<think>`` in the middle of the answer opens a new reasoning block.
    Where a grammar constrains the answer (``reasoning_first_only``), reasoning can only
    come first (the grammar says so), and once the answer has started every tag is text:
    a JSON string holding ``"<think>"`` stays in the JSON.

Block ends
    A ``</think>`` that closes a block is followed by a :class:`ReasoningEnd`, so the
    reasoning item is complete as soon as its closing tag is generated (a limit that
    then cuts the answer leaves it ``completed``). An empty block, or the closing tag
    that opens the output, adds nothing to close.

Held-back text
    Trailing whitespace of reasoning is held until more reasoning follows (then it
    is released) or the block ends (then it is dropped); a tail that may be the start
    of a tag is held until the next chunk. At :meth:`ReasoningParser.finish` a
    partial tag is released as the text it is, and an unclosed block simply ends.

Reasoning tokens
    The parser also records which characters of the stream belong to reasoning
    (reasoning text, the whitespace trimmed from it, and every think tag), so that
    :class:`ReasoningTokenCounter` can count the tokens behind them exactly.
"""

from __future__ import annotations

from collections import deque
from enum import Enum

from resq.postprocess.parsers.markup import find_first_tag, partial_tag_length, split_leading_whitespace
from resq.postprocess.segments import ReasoningEnd, ReasoningSegment, Segment, TextSegment

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_TAGS = (THINK_OPEN, THINK_CLOSE)

Span = tuple[int, int]
"""A half-open range ``[start, end)`` of character offsets in the decoded output."""


class _Mode(Enum):
    START = "start"
    """Nothing decided yet: only whitespace and maybe the start of a tag have arrived."""
    REASONING = "reasoning"
    ANSWER = "answer"


class ReasoningParser:
    """Splits ``<think>`` blocks from the answer, for chunks of any size."""

    def __init__(self, *, starts_in_reasoning: bool = False, reasoning_first_only: bool = False) -> None:
        self._mode = _Mode.REASONING if starts_in_reasoning else _Mode.START
        self._reasoning_first_only = reasoning_first_only
        """Once the answer starts, everything is answer text (a grammar constrains the answer)."""
        self._buffer = ""
        """Text received but not yet classified; it starts at offset ``self.resolved``."""
        self.resolved = 0
        """How many characters of the output are classified (reasoning or not) so far."""
        self._spans: list[Span] = []
        self._block_has_text = False
        self._held_whitespace = ""
        """Reasoning whitespace that is released only if more reasoning text follows."""
        self._strip_answer = False
        """True right after ``</think>``, until the answer's first non-whitespace character."""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text fed so far ends inside a reasoning block."""
        return self._mode is _Mode.REASONING

    def feed(self, text: str) -> list[Segment]:
        """Segments that ``text`` (the next chunk) completes."""
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Segment]:
        """Everything still held back: a partial tag as text; an open block just ends."""
        segments = self._drain(final=True)
        self._end_block()
        return segments

    def take_reasoning_spans(self) -> list[Span]:
        """Character ranges classified as reasoning since the last call, in order."""
        spans, self._spans = self._spans, []
        return spans

    # --- internals -----------------------------------------------------------------------------

    def _drain(self, *, final: bool) -> list[Segment]:
        out: list[Segment] = []
        while True:
            if self._mode is _Mode.START:
                if not self._decide_start(final=final):
                    return out
            elif not self._scan(out, final=final):
                return out

    def _decide_start(self, *, final: bool) -> bool:
        """Leave START if the buffer allows; False while it must wait for more text."""
        whitespace, rest = split_leading_whitespace(self._buffer)
        if rest.startswith(THINK_OPEN):
            self._consume(len(whitespace), reasoning=False)
            self._consume(len(THINK_OPEN), reasoning=True)
            self._mode = _Mode.REASONING
            return True
        if rest.startswith(THINK_CLOSE):
            # An empty block whose <think> was in the prompt: the whitespace was its reasoning.
            self._consume(len(whitespace) + len(THINK_CLOSE), reasoning=True)
            self._mode = _Mode.ANSWER
            self._strip_answer = True
            return True
        could_be_tag = any(tag.startswith(rest) for tag in _TAGS)
        if could_be_tag and not final:
            return False
        # Plain answer text: leading whitespace included, as generated.
        self._mode = _Mode.ANSWER
        return True

    def _scan(self, out: list[Segment], *, final: bool) -> bool:
        """Process the buffer up to and including its first tag; False when it needs more text."""
        if self._mode is _Mode.ANSWER and self._reasoning_first_only:
            self._emit(out, self._buffer)
            return False
        found = find_first_tag(self._buffer, _TAGS)
        if found is None:
            keep = 0 if final else partial_tag_length(self._buffer, _TAGS)
            self._emit(out, self._buffer[: len(self._buffer) - keep])
            return False
        index, tag = found
        self._emit(out, self._buffer[:index])
        self._consume(len(tag), reasoning=True)
        if self._mode is _Mode.REASONING and tag == THINK_CLOSE:
            self._end_block()
            self._mode = _Mode.ANSWER
            self._strip_answer = True
            out.append(ReasoningEnd())
        elif self._mode is _Mode.ANSWER and tag == THINK_OPEN:
            self._mode = _Mode.REASONING
        # The other two cases are stray tags: dropped, the mode stays.
        return True

    def _emit(self, out: list[Segment], text: str) -> None:
        """Classify and release ``text`` (the buffer's head) in the current mode."""
        if not text:
            return
        start = self.resolved
        if self._mode is _Mode.REASONING:
            self._consume(len(text), reasoning=True)
            self._reasoning_text(out, text)
        else:
            self._consume(len(text), reasoning=False)
            self._answer_text(out, text, start)

    def _reasoning_text(self, out: list[Segment], text: str) -> None:
        text = self._held_whitespace + text
        if not self._block_has_text:
            text = text.lstrip()
        body = text.rstrip()
        # Trailing whitespace waits: it is dropped if </think> comes next.
        self._held_whitespace = text[len(body) :]
        if body:
            self._block_has_text = True
            out.append(ReasoningSegment(body))

    def _answer_text(self, out: list[Segment], text: str, start: int) -> None:
        if self._strip_answer:
            stripped = text.lstrip()
            start += len(text) - len(stripped)
            text = stripped
            if not text:
                return
            self._strip_answer = False
        out.append(TextSegment(text, start=start))

    def _end_block(self) -> None:
        self._block_has_text = False
        self._held_whitespace = ""

    def _consume(self, length: int, *, reasoning: bool) -> None:
        """Drop ``length`` characters from the buffer's head, recording whether they are reasoning."""
        if length == 0:
            return
        start = self.resolved
        self.resolved += length
        self._buffer = self._buffer[length:]
        if not reasoning:
            return
        if self._spans and self._spans[-1][1] == start:
            self._spans[-1] = (self._spans[-1][0], self.resolved)
        else:
            self._spans.append((start, self.resolved))


class ReasoningTokenCounter:
    """Counts the output tokens that are reasoning, from a :class:`ReasoningParser`'s spans.

    A token counts when any character of its text is reasoning or a think tag. A
    token whose text is empty (DecodeStream holds back the first bytes of a
    character split across tokens) belongs to the character its bytes start, i.e.
    the next character of the output. Tokens are settled as soon as the parser has
    classified their characters, so memory stays bounded by what is held back.
    """

    def __init__(self) -> None:
        self.count = 0
        """Reasoning tokens among those settled so far."""
        self._offset = 0
        self._tokens: deque[tuple[int, int, bool]] = deque()
        """(start, end, sampled) of each token not settled yet."""
        self._spans: deque[Span] = deque()

    def add_token(self, text_length: int, *, sampled: bool = True) -> None:
        """The next output token, by the length of the text it decoded to.

        A token the model did not sample (forced into the answer by the API) takes
        its place in the output but is never counted: usage counts sampled tokens.
        """
        start = self._offset
        self._offset += text_length
        # An empty token stands for the next character: give it a width of one.
        self._tokens.append((start, max(self._offset, start + 1), sampled))

    def settle(self, spans: list[Span], resolved: int) -> None:
        """Count the tokens that lie before ``resolved``, given the new reasoning ``spans``."""
        self._spans.extend(spans)
        while self._tokens and self._tokens[0][1] <= resolved:
            self._count(self._tokens.popleft())

    def finish(self, spans: list[Span]) -> None:
        """Count every remaining token (the output is complete)."""
        self._spans.extend(spans)
        while self._tokens:
            self._count(self._tokens.popleft())

    def _count(self, token: tuple[int, int, bool]) -> None:
        start, end, sampled = token
        # Spans that end before this token cannot reach any later token either.
        while self._spans and self._spans[0][1] <= start:
            self._spans.popleft()
        if sampled and self._spans and self._spans[0][0] < end:
            self.count += 1
