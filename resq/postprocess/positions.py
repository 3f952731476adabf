"""Reading a token stream by position, not by read cursor.

Each tokens entry says where its tokens start in the generated output
(:attr:`resq.wire.TokensEntry.start`). A stream can move back in time: Redis loses
its last second of writes (``appendfsync everysec`` and a crash) and the GPU worker
regenerates the lost tokens, or a resumed GPU worker publishes again from what the
stream holds. A reader that trusted its cursor would then read those tokens twice.
:class:`ConsumedTokens` keeps the tokens fed to the processor and tells, per entry:

- the part not consumed yet (tokens before ``consumed`` are dropped: already read);
- :class:`TokensRewrittenError` when a token at an already consumed position differs
  (sampling regenerated other tokens than those already turned into events: no text
  can follow both; the runner fails the response);
- :class:`TokenGapError` when an entry starts past ``consumed`` (or a finish entry counts
  more tokens): tokens between are missing from what this read returned. Appends are
  position-checked (:mod:`resq.recovery.generations`), so they are in the stream, below
  the cursor (entry ids are Redis' clock, which may have gone back across the loss):
  the runner reads again from the stream's start, and fails the response only if the
  gap is still there then.

Entries without ``start`` (GPU workers older than the field, in a rolling upgrade)
are taken to follow what was consumed, as before.
"""

from __future__ import annotations

from resq.wire import FinishEntry, TokensEntry


class TokenGapError(Exception):
    """The entry starts past the tokens consumed so far."""

    def __init__(self, consumed: int, start: int) -> None:
        super().__init__(f"tokens {consumed}..{start - 1} are missing before this entry")
        self.consumed = consumed


class TokensRewrittenError(Exception):
    """A token at an already consumed position is another token than the one consumed."""

    def __init__(self, position: int) -> None:
        super().__init__(f"token {position} differs from the one already consumed")
        self.position = position


class ConsumedTokens:
    """The generated tokens fed to a response's processor so far, by position."""

    def __init__(self) -> None:
        self._ids: list[int] = []
        self.all_placed = True
        """False once an entry without ``start`` was taken: reading again from the stream's
        start could not tell its tokens from new ones."""

    @property
    def count(self) -> int:
        """How many tokens were consumed (the position of the next one)."""
        return len(self._ids)

    def take(self, entry: TokensEntry) -> TokensEntry | None:
        """The part of ``entry`` not consumed yet, now consumed (None: nothing new)."""
        consumed = len(self._ids)
        if entry.start is None:
            self.all_placed = False
        start = consumed if entry.start is None else entry.start
        if start > consumed:
            raise TokenGapError(consumed, start)
        overlap = min(consumed - start, len(entry.token_ids))
        for offset in range(overlap):
            if entry.token_ids[offset] != self._ids[start + offset]:
                raise TokensRewrittenError(start + offset)
        if overlap == len(entry.token_ids):
            return None
        fresh = entry.token_ids[overlap:]
        self._ids += fresh
        if overlap == 0:
            return entry
        logprobs = entry.logprobs[overlap:] if entry.logprobs is not None else None
        return TokensEntry(fresh, logprobs, start=consumed)

    def check_finish(self, entry: FinishEntry) -> None:
        """Raise :class:`TokenGapError` when ``entry`` counts tokens not consumed."""
        if entry.output_tokens > len(self._ids):
            raise TokenGapError(len(self._ids), entry.output_tokens)
