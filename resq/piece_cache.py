"""Token ids of prompt pieces already encoded, so that an agent's resent history is not encoded again.

An agent turn resends its whole history (Codex: 4-40k tokens of instructions and turns), and the
API rendered and encoded all of it every turn: about 3 ms per 12,000 characters on the 2-core test
machine, growing with the history. The rendered prompt splits at its markup tokens into pieces that
the tokenizer encodes independently of each other (:mod:`resq.prompt_tokens`), and most pieces of a
turn (the instructions, every earlier message) are the previous turn's again: their ids are kept
here and only the new pieces are encoded.

Entries are partitioned by owner (an API key's fingerprint), like the engine's prefix cache: how
fast a prompt is encoded must not tell one key what another sent. The cache is bounded by the
characters it holds (least recently used first out), so its memory does not depend on what clients
send; ids are kept as 32-bit arrays (4 bytes a token).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

ENTRY_OVERHEAD_CHARS = 128
"""What an entry is counted as on top of its text (the key tuple, the dict slot, the array header),
so that very many tiny pieces cannot hold more memory than the bound says."""


class PieceCache:
    """A bounded, thread-safe map of ``(owner, piece text)`` to that piece's token ids."""

    def __init__(self, max_chars: int) -> None:
        self._max_chars = max_chars
        self._entries: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        """Pieces found (for tests and the benchmark's notes)."""
        self.misses = 0
        """Pieces that had to be encoded."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def chars(self) -> int:
        """What the entries are counted as now (at most the bound)."""
        return self._chars

    def get(self, owner: str, piece: str) -> array[int] | None:
        """The ids of ``piece`` for ``owner`` (now the most recently used), or None."""
        key = (owner, piece)
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return ids

    def put(self, owner: str, piece: str, ids: list[int]) -> None:
        """Keep ``ids`` for ``(owner, piece)``, dropping the least recently used entries past the bound;
        a piece larger than the whole bound is not kept."""
        size = len(piece) + ENTRY_OVERHEAD_CHARS
        if size > self._max_chars:
            return
        key = (owner, piece)
        packed = array("i", ids)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            self._entries[key] = packed
            self._chars += size
            while self._chars > self._max_chars:
                (_, dropped), _ids = self._entries.popitem(last=False)
                self._chars -= len(dropped) + ENTRY_OVERHEAD_CHARS


__all__ = ["ENTRY_OVERHEAD_CHARS", "PieceCache"]
