"""Log-probabilities of the tokens behind each piece of answer text.

The engine gives one logprob per sampled token; the parsers work on characters
and drop markup, reasoning and some whitespace. The processor records where each
token's text lies in the decoded output, and every text segment says where it
lies too (``TextSegment.start``): a segment gets the entries of the tokens whose
characters overlap it, each token once, in order. Tokens that show in no text
(tags, reasoning, call JSON) get no entry; a token partly in the text (``"\\n\\nThe"``
after ``</think>``, whose newlines were dropped) is reported whole.

An entry is ``{"token", "bytes", "logprob", "top_logprobs"}`` as the SDK's
``output_text`` logprobs read; ``top_logprobs`` lists the most likely tokens at the
token's position, each ``{"token", "bytes", "logprob"}``, when the request asked for them
(``top_logprobs``), else it is empty. An alternative that is a special token (the end of
the answer, most often) shows its own spelling, ``<|im_end|>``, where the sampled token
shows none: it never reaches the text. ``bytes`` are the token's own bytes where the
vocabulary knows them exactly (byte-level BPE): a token holding half of a UTF-8
character has its half, and ``token`` is those bytes with the invalid ones
backslash-escaped. The bytes of a text's entries then add up to the text (when no
token straddles dropped markup). Elsewhere the token's decoded text stands in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from resq.catalog import TextTokenizer
from resq.postprocess.segments import Segment, TextSegment

LOWEST_LOGPROB = -9999.0
"""What a logprob that is not a finite number is reported as (JSON has no infinity)."""


@dataclass(frozen=True, slots=True)
class _Token:
    start: int
    end: int
    token_id: int
    text: str
    logprob: float
    alternatives: list[tuple[int, float]] | None


class LogprobAligner:
    """Hands each text segment the logprob entries of the tokens it came from."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._pending: deque[_Token] = deque()

    def add_token(
        self,
        start: int,
        token_id: int,
        text: str,
        logprob: float,
        alternatives: list[tuple[int, float]] | None = None,
    ) -> None:
        """A sampled token whose decoded ``text`` starts at output offset ``start``; ``alternatives``:
        the most likely tokens at its position, (token id, logprob), when the request asked."""
        # A token that decodes to nothing yet (the first bytes of a character) belongs to the
        # character its bytes start: the next one.
        end = start + len(text) if text else start + 1
        self._pending.append(_Token(start, end, token_id, text, logprob, alternatives))

    def attach(self, segments: list[Segment]) -> list[Segment]:
        """``segments`` with the logprobs of their tokens on every text segment."""
        return [
            TextSegment(segment.text, self._take(segment), segment.start)
            if isinstance(segment, TextSegment)
            else segment
            for segment in segments
        ]

    def _take(self, segment: TextSegment) -> list[dict[str, Any]]:
        start = segment.start
        end = start + len(segment.text)
        entries: list[dict[str, Any]] = []
        # Text segments come in output order: tokens that start before this one ends are
        # either in it or in nothing shown, and are done with either way.
        while self._pending and self._pending[0].start < end:
            token = self._pending.popleft()
            if token.end > start:
                entries.append(self._entry(token))
        return entries

    def _entry(self, token: _Token) -> dict[str, Any]:
        data = self._tokenizer.token_bytes(token.token_id)
        if data is None:
            data = token.text.encode()
        return {
            "token": data.decode("utf-8", errors="backslashreplace"),
            "bytes": list(data),
            "logprob": _finite(token.logprob),
            "top_logprobs": [
                self._alternative(token_id, logprob) for token_id, logprob in token.alternatives or ()
            ],
        }

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        data = self._tokenizer.token_bytes(token_id) or self._tokenizer.spelling(token_id).encode()
        return {
            "token": data.decode("utf-8", errors="backslashreplace"),
            "bytes": list(data),
            "logprob": _finite(logprob),
        }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB
