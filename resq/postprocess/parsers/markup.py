"""Finding tags in streamed text whose chunks may cut a tag anywhere.

Every parser scans a buffer for a few fixed tags and must not release a chunk's
tail while it could still be the start of a tag: ``<tool_`` followed later by
``call>`` is one tag, and neither half may reach a client as text.
"""

from __future__ import annotations

from collections.abc import Sequence


def partial_tag_length(text: str, tags: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``tags``.

    Those characters must be held back until the next chunk says whether they
    complete a tag. A complete tag at the very end is not counted: the caller
    finds complete tags first.
    """
    longest = 0
    for tag in tags:
        # Only tails that start with the tag's first character can match; walk those from the
        # longest candidate down so the first hit is the answer for this tag.
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if tag.startswith(text[-size:]):
                longest = size
                break
    return longest


def find_first_tag(text: str, tags: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Position and text of the earliest complete tag in ``text`` at or after ``start``."""
    best: tuple[int, str] | None = None
    for tag in tags:
        index = text.find(tag, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, tag)
    return best


def split_leading_whitespace(text: str) -> tuple[str, str]:
    """``text`` as (its leading whitespace, the rest)."""
    rest = text.lstrip()
    return text[: len(text) - len(rest)], rest
