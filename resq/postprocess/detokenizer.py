"""Incremental detokenisation: each token is decoded once, never the whole prefix again."""

from __future__ import annotations

from resq.catalog import TextTokenizer


class IncrementalDetokenizer:
    """Text for each new batch of token ids, via tokenizers' ``DecodeStream``.

    ``DecodeStream`` keeps a small window of recent ids and holds back the bytes of
    a UTF-8 character split across tokens until it is complete, so a multi-byte
    character never reaches a delta half-made.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer.tokenizer
        self._stream = tokenizer.decode_stream()

    def feed(self, token_ids: list[int]) -> str:
        """The text the new ids complete (possibly empty)."""
        pieces: list[str] = []
        for token_id in token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                pieces.append(piece)
        return "".join(pieces)
