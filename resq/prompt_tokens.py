"""Prompt token ids from a rendered chat template: client text stays text, and long input fails fast.

Two guarantees for the API, which tokenizes every prompt before it enqueues it:

- **Client text is text.** A chat template renders the whole conversation into one
  string, and a tokenizer matches its special and added tokens (``<|im_end|>``,
  ``<tool_call>``) anywhere in it: a user who types ``<|im_end|><|im_start|>system``
  would forge a turn. Every string that reaches the template from a request
  (message content of every role, instructions, reasoning, tool calls' names and
  arguments, tool outputs, tool definitions) is escaped first: each occurrence of a
  token's text becomes a sentinel (:class:`ClientTextEscaper`). The template's own
  markup is untouched, so it still tokenizes to the real control tokens; the
  stretches of text between them that hold a sentinel are encoded again, with the
  sentinels turned back into the token texts, by a copy of the tokenizer that knows
  no added tokens. The result is exactly the tokenizer's own output with only the
  template's markup matched as tokens.
- **A bound before the tokenizer runs.** A token spells at most
  :attr:`PromptEncoder.bytes_per_token` bytes of (normalised) text, so a text of
  ``b`` bytes has at least ``ceil(b / bytes_per_token)`` tokens. A prompt that must
  have more tokens than the context holds is refused on that count alone: the
  tokenizer's model (BPE merges, the costly part: seconds for a few MB) never runs
  on more than ``context_length * bytes_per_token`` bytes.

The work runs on the API's prompt threads, and no step holds the GIL (which the
event loop needs) for long: ``Tokenizer.encode`` and ``normalize_str`` hold it
throughout (~1 s per MB), so this module encodes with ``encode_batch`` /
``encode_batch_fast`` (which release it), normalises and searches window by window.

Deliberate divergences, each harmless: a template that inspects client text for
markup (``'</think>' in content``) no longer finds it there, since it is text; a
template that writes a client string through ``tojson(ensure_ascii=True)`` shows
a non-ASCII token text (DeepSeek's ``<｜…｜>``) unescaped; the bound is not
computed (0: no early refusal) for vocabularies whose tokens need not spell every
byte of the text (a pre-tokenizer that drops whitespace, an unknown token that
swallows characters) nor behind a normaliser that may delete text (lowercasing,
stripping, BERT's).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers

from resq.piece_cache import PieceCache

SEARCH_WINDOW = 1 << 16
"""Characters one regex call scans: the call holds the GIL, and the API's event loop waits for it."""
UTF8_CHUNK = 1 << 20
"""Characters encoded at a time to count the UTF-8 bytes of a non-ASCII text (same reason)."""
PIECE_CACHE_CHARS = 8 << 20
"""Characters of prompt pieces whose ids a tokenizer's :class:`PieceCache` keeps, in each API process:
about 2 million tokens of histories (fifty agents at 40,000 tokens), in about 23 MB at most (measured
filled with 540-character pieces; 15 MB with 40-character ones, whose entries' overhead counts)."""
WINDOW_MARGIN_BYTES = 32
"""What normalising a text window by window can overcount per cut: a composing sequence cut
apart (a base and its marks, Hangul jamo) stays a few bytes longer than composed."""

_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}
)
"""Pre-tokenizers that keep every character (``Split`` / ``Punctuation`` unless their behaviour is
``Removed``); ``Whitespace``, ``WhitespaceSplit``, ``BertPreTokenizer``, ``CharDelimiterSplit`` drop some."""


class PromptTooLongError(ValueError):
    """The prompt has at least ``at_least`` tokens, more than allowed (counted without tokenizing)."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"the prompt has at least {at_least} tokens")
        self.at_least = at_least


def _trie_pattern(words: list[str]) -> str:
    """A regex matching any of ``words``, longest first, as a trie: linear time on any input.

    A plain alternation of hundreds of tokens (Llama 3 has 256) retries every one at
    each ``<`` of a hostile text; the trie tries one branch per character.
    """
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        branches = [re.escape(char) + build(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        ends_here = "" in node
        if len(branches) == 1 and not ends_here:
            return branches[0]
        # Greedy `?`: the longer token wins where one token is a prefix of another.
        return "(?:" + "|".join(branches) + ")" + ("?" if ends_here else "")

    return build(trie)


@dataclass
class Escaped:
    """Client data with every token text a sentinel (what :meth:`ClientTextEscaper.escape` returns)."""

    data: Any
    changed: bool = False
    whole: list[str] = field(default_factory=list)
    """Strings escaped whole: their normalised form spells a token text that the raw form does not."""


class ClientTextEscaper:
    """Replaces every token text in client strings by a sentinel, and turns sentinels back.

    A sentinel is ASCII letters and digits only, so it passes through the template
    unchanged whatever it does to a string (concatenation, ``trim``, ``tojson``) and
    never forms a token with its neighbours. Its random prefix is escaped in client
    text like a token, so every sentinel in a rendered prompt is one of ours.

    ``finds_token`` says whether the tokenizer itself would still find a token in an
    escaped string: where a normaliser folds text into a token text (``＜tool_call＞``
    under NFKC), the string becomes a single sentinel, encoded whole as text.
    ``ascii_is_plain``: ``finds_token`` is False for every ASCII string (the normal forms).
    """

    def __init__(
        self,
        token_texts: list[str],
        finds_token: Callable[[str], bool] | None = None,
        ascii_is_plain: bool = False,
    ) -> None:
        self._prefix = f"resq{secrets.token_hex(8)}s"
        self._texts = [*sorted(set(token_texts)), self._prefix]
        self._index = {text: index for index, text in enumerate(self._texts)}
        self._longest = max(len(text) for text in self._texts)
        self._pattern = re.compile(_trie_pattern(self._texts))
        self._sentinel = re.compile(re.escape(self._prefix) + r"(\d+)x")
        self._finds_token = finds_token
        self._ascii_is_plain = ascii_is_plain
        # JSON writes a string's characters as they are, except these: a token text without them
        # shows in the JSON of any data whose strings hold it (see `_surely_clean`).
        self._json_shows_texts = not any(
            char in '"\\' or ord(char) < 0x20 for text in self._texts for char in text
        )

    def escape(self, data: Any) -> Escaped:
        """``data`` (JSON-shaped: every string, keys too) escaped; ``data`` itself when nothing in it
        needs escaping (``changed`` False), which is most requests."""
        if self._surely_clean(data):
            return Escaped(data)
        escaped = Escaped(None)
        escaped.data = self._escape(data, escaped)
        return escaped

    def _surely_clean(self, data: Any) -> bool:
        """Whether no string of ``data`` holds a token text, nor needs escaping whole, told from one
        search of its JSON instead of one per string (an agent's history has thousands of strings:
        the walk took ~1.7 ms for 60 items, this ~0.1 ms). False when unsure: the walk decides."""
        if not self._json_shows_texts:
            return False
        try:
            encoded = json.dumps(data, ensure_ascii=False, check_circular=False, allow_nan=True)
        except (TypeError, ValueError):
            return False
        # A match here may span JSON's punctuation and name no string's text: only a miss is sure.
        if next(self._occurrences(encoded), None) is not None:
            return False
        return self._finds_token is None or (self._ascii_is_plain and encoded.isascii())

    def has_sentinel(self, text: str) -> bool:
        """Whether ``text`` holds a sentinel (client text that named a token)."""
        return self._prefix in text

    def restore(self, text: str, whole: list[str]) -> str:
        """``text`` with every sentinel turned back into what it stands for (``whole``: see :class:`Escaped`)."""
        count = len(self._texts)

        def original(match: re.Match[str]) -> str:
            index = int(match.group(1))
            return self._texts[index] if index < count else whole[index - count]

        return self._sentinel.sub(original, text)

    def _escape(self, data: Any, escaped: Escaped) -> Any:
        if isinstance(data, str):
            return self._escape_text(data, escaped)
        if isinstance(data, list):
            return [self._escape(value, escaped) for value in data]
        if isinstance(data, dict):
            return {self._escape(key, escaped): self._escape(value, escaped) for key, value in data.items()}
        return data

    def _escape_text(self, text: str, escaped: Escaped) -> str:
        pieces: list[str] = []
        done = 0
        for start, end in self._occurrences(text):
            pieces.append(text[done:start])
            pieces.append(self._sentinel_for(self._index[text[start:end]]))
            done = end
        result = text
        if pieces:
            pieces.append(text[done:])
            result = "".join(pieces)
        if self._finds_token is not None and self._finds_token(result):
            escaped.whole.append(text)
            result = self._sentinel_for(len(self._texts) + len(escaped.whole) - 1)
        escaped.changed = escaped.changed or result is not text
        return result

    def _sentinel_for(self, index: int) -> str:
        return f"{self._prefix}{index}x"

    def _occurrences(self, text: str) -> Iterator[tuple[int, int]]:
        """Leftmost-longest matches, as the tokenizer finds them, one bounded window at a time."""
        position = 0
        while position < len(text):
            window_end = position + SEARCH_WINDOW
            # A match that starts in the window ends within `_longest - 1` characters after it.
            search_end = min(len(text), window_end + self._longest - 1)
            resume = window_end
            for match in self._pattern.finditer(text, position, search_end):
                if match.start() >= window_end:
                    break  # found again, whole, by the next window
                yield match.start(), match.end()
                resume = max(resume, match.end())
            position = resume


_FINDER_UNKNOWN = "\x00resq-text\x00"


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    # Without offsets: twice as fast, and the GIL stays free (`encode` holds it ~60 ms per MB).
    return list(tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids)


def _utf8_length(text: str) -> int:
    if text.isascii():
        return len(text)
    return sum(len(text[start : start + UTF8_CHUNK].encode()) for start in range(0, len(text), UTF8_CHUNK))


def _keeps_every_character(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(part) for part in pre_tokenizer.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _uses_byte_level(state: dict[str, Any]) -> bool:
    def kinds(component: dict[str, Any] | None) -> set[str]:
        if component is None:
            return set()
        nested = component.get("pretokenizers") or component.get("decoders") or []
        return {str(component.get("type"))}.union(*(kinds(part) for part in nested))

    return "ByteLevel" in kinds(state.get("pre_tokenizer")) | kinds(state.get("decoder"))


_NORMAL_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


def _normalizer_kinds(normalizer: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The normalisers of a (possibly nested) ``Sequence``, in order."""
    if normalizer is None:
        return []
    if normalizer.get("type") == "Sequence":
        return [kind for part in normalizer.get("normalizers") or [] for kind in _normalizer_kinds(part)]
    return [normalizer]


def _never_shrinks(normalizer: dict[str, Any]) -> bool:
    """Prepend, and Replace of a string by one at least as long (SentencePiece's " " -> "▁")."""
    kind = normalizer.get("type")
    if kind == "Prepend":
        return True
    pattern = (normalizer.get("pattern") or {}).get("String")
    content = normalizer.get("content")
    return (
        kind == "Replace" and isinstance(pattern, str) and len(str(content).encode()) >= len(pattern.encode())
    )


def _state(component: Any) -> dict[str, Any] | None:
    """The JSON state of a tokenizer component (normaliser, pre-tokenizer, decoder), None for none."""
    return None if component is None else dict(json.loads(component.__getstate__()))


def _pre_tokenizer_from_state(state: dict[str, Any]) -> Any:
    """A pre-tokenizer built from its JSON state (the bindings build components only this way)."""
    holder: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": state,
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"x": 0}, "unk_token": "x"},
    }
    return Tokenizer.from_str(json.dumps(holder)).pre_tokenizer


def _never_prepend(component: Any) -> Any:
    """A pre-tokenizer state with Metaspace's ``prepend_scheme: first`` turned to ``never``."""
    if isinstance(component, dict):
        changed = {key: _never_prepend(value) for key, value in component.items()}
        if changed.get("type") == "Metaspace" and changed.get("prepend_scheme") == "first":
            changed["prepend_scheme"] = "never"
        return changed
    if isinstance(component, list):
        return [_never_prepend(value) for value in component]
    return component


class PromptEncoder:
    """Encodes rendered prompts for one tokenizer: client text as text, with the length bound."""

    def __init__(self, tokenizer: Tokenizer, piece_cache_chars: int = PIECE_CACHE_CHARS) -> None:
        self._tokenizer = tokenizer
        self._added = tokenizer.get_added_tokens_decoder()
        self.pieces = PieceCache(piece_cache_chars)
        """Ids of the prompt pieces encoded lately, by owner (:meth:`prompt_ids`' ``cache_owner``)."""

    @cached_property
    def escaper(self) -> ClientTextEscaper:
        """The escaper for this vocabulary's special and added tokens (and its normaliser, if any)."""
        texts = [token.content for token in self._added.values()]
        if self._tokenizer.normalizer is None:
            return ClientTextEscaper(texts)  # tokens match the raw text: the escaper finds them all
        ascii_stable = all(kind.get("type") in _NORMAL_FORMS for kind in self._normalizers)
        unknown = self._finder_unknown_id

        def finds_token(text: str) -> bool:
            # NFC and its kin leave ASCII alone (the common case, skipped); other folding may not.
            if ascii_stable and text.isascii():
                return False
            found = self._markup_finder.encode_batch([text], add_special_tokens=False)[0].ids
            return any(token_id != unknown for token_id in found)

        return ClientTextEscaper(texts, finds_token, ascii_is_plain=ascii_stable)

    @cached_property
    def _normalizers(self) -> list[dict[str, Any]]:
        return _normalizer_kinds(_state(self._tokenizer.normalizer))

    @cached_property
    def bytes_per_token(self) -> int | None:
        """The most bytes of normalised text one token spells; None when tokens need not spell it all."""
        model = self._tokenizer.model
        state = {
            "pre_tokenizer": _state(self._tokenizer.pre_tokenizer),
            "decoder": _state(self._tokenizer.decoder),
        }
        if not isinstance(model, models.BPE) or not _keeps_every_character(state["pre_tokenizer"]):
            return None
        vocab = self._tokenizer.get_vocab(with_added_tokens=False)
        if _uses_byte_level(state):
            # Byte-level pieces spell one byte per character; a missing byte would be dropped.
            if not set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys():
                return None
            longest = max(len(piece) for piece in vocab)
        elif model.byte_fallback:
            # SentencePiece-style: "▁" (3 bytes) spells a space, "<0x0A>" (6) one byte.
            longest = max(len(piece.encode()) for piece in vocab)
        else:
            return None  # an unknown token may stand for any number of characters
        added = [len(token.content.encode()) for token in self._added.values()]
        return max([longest, *added])

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text``, found in linear time (0: no bound)."""
        per_token = self.bytes_per_token
        if per_token is None or not text:
            return 0
        return -(-self._normalized_bytes(text) // per_token)

    def _normalized_bytes(self, text: str) -> int:
        """At most the UTF-8 length of ``text`` as the normaliser leaves it (0: unknown)."""
        kinds = self._normalizers
        if all(_never_shrinks(kind) for kind in kinds):
            return _utf8_length(text)
        if not all(kind.get("type") in _NORMAL_FORMS or _never_shrinks(kind) for kind in kinds):
            return 0  # lowercasing, stripping...: no cheap bound
        if text.isascii():
            return len(text)  # normal forms leave ASCII as it is; the rest only grows it
        # Normal forms can shrink text (NFKC: "𝐀" -> "A"). normalize_str holds the GIL, so a
        # window at a time; cut apart, a composing sequence may stay longer by a few bytes.
        normalizer = self._tokenizer.normalizer
        windows = range(0, len(text), SEARCH_WINDOW)
        measured = sum(
            _utf8_length(normalizer.normalize_str(text[start : start + SEARCH_WINDOW])) for start in windows
        )
        return max(0, measured - WINDOW_MARGIN_BYTES * (len(windows) - 1))

    def prompt_ids(
        self,
        render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        max_tokens: int | None = None,
        cache_owner: str | None = None,
    ) -> list[int]:
        """Token ids of ``render(messages, tools)`` with every client string encoded as text.

        Raises :class:`PromptTooLongError` when the rendered text must have more than
        ``max_tokens`` tokens, before any tokenizer model runs on it. ``cache_owner``: whose
        :attr:`pieces` the prompt's pieces are looked up in and kept in (None: encoded whole, nothing
        kept).
        """
        text = render(messages, tools)
        if max_tokens is not None:
            at_least = self.min_tokens(text)
            if at_least > max_tokens:
                raise PromptTooLongError(at_least)
        escaped = self.escaper.escape([messages, tools])
        if not escaped.changed:
            if cache_owner is not None and self._piece_splitter is not None:
                return self._ids_by_piece(text, cache_owner, self._piece_splitter)
            return _ids(self._tokenizer, text)
        escaped_messages, escaped_tools = escaped.data
        return self._encode_escaped(render(escaped_messages, escaped_tools), escaped.whole)

    @cached_property
    def _piece_splitter(self) -> _PieceSplitter | None:
        """Where a rendered prompt splits into pieces the tokenizer encodes independently; None when
        this tokenizer's pieces are not independent (see :class:`_PieceSplitter`)."""
        return _PieceSplitter.of(self._tokenizer, self._added)

    def _ids_by_piece(self, text: str, owner: str, splitter: _PieceSplitter) -> list[int]:
        """The ids ``_ids(tokenizer, text)`` gives, from the cached ids of the pieces seen before and
        one encode of the others (:mod:`resq.piece_cache`)."""
        parts = splitter.split(text)
        found: dict[str, Sequence[int]] = {}
        missing: list[str] = []
        for part in parts:
            if isinstance(part, str) and part not in found:
                cached = self.pieces.get(owner, part)
                if cached is None:
                    missing.append(part)
                    found[part] = ()
                else:
                    found[part] = cached
        if missing:
            # One call for all of them: it releases the GIL, as a whole prompt's encode does.
            for piece, encoding in zip(
                missing, self._tokenizer.encode_batch_fast(missing, add_special_tokens=False), strict=True
            ):
                ids = encoding.ids
                found[piece] = ids
                self.pieces.put(owner, piece, ids)
        token_ids: list[int] = []
        for part in parts:
            if isinstance(part, str):
                token_ids.extend(found[part])
            else:
                token_ids.append(part)
        return token_ids

    def _encode_escaped(self, text: str, whole: list[str]) -> list[int]:
        """Ids of a prompt whose client token texts are sentinels: markup as tokens, the rest as text.

        The tokenizer itself splits its input at added tokens and encodes each stretch in
        between on its own; so does this, with the stretches that hold a sentinel restored
        and encoded as text.
        """
        # encode_batch: Tokenizer.encode holds the GIL throughout (seconds for a few MB).
        markup = self._markup_finder.encode_batch([text], add_special_tokens=False)[0]
        ids: list[int] = []
        segment_start = 0
        for token_id, (start, end) in zip(markup.ids, markup.offsets, strict=True):
            if token_id == self._finder_unknown_id:
                continue  # a stretch of text between markup
            ids.extend(self._segment_ids(text[segment_start:start], segment_start == 0, whole))
            ids.append(token_id)
            segment_start = end
        ids.extend(self._segment_ids(text[segment_start:], segment_start == 0, whole))
        return ids

    def _segment_ids(self, segment: str, first: bool, whole: list[str]) -> list[int]:
        if not segment:
            return []
        if self.escaper.has_sentinel(segment):
            segment = self.escaper.restore(segment, whole)
        return self._text_ids(segment, first)

    def _text_ids(self, text: str, first: bool) -> list[int]:
        """Ids of ``text`` as text only: no added token, even where the vocabulary's merges spell one."""
        plain = self._plain_first if first else self._plain_later
        ids = _ids(plain, text)
        if not any(token_id in self._added for token_id in ids):
            return ids
        encoding = plain.encode_batch([text], add_special_tokens=False)[0]
        ids = []
        covered = 0  # offsets may leave out a leading space (byte-level `trim_offsets`): keep it
        for token_id, (_, end) in zip(encoding.ids, encoding.offsets, strict=True):
            added = self._added.get(token_id)
            piece = text[covered:end]
            # An added token's id that is an unknown character's `<unk>` is fine as it is.
            if added is None or added.content not in piece:
                ids.append(token_id)
            else:
                # A vocabulary trained on markup as text can merge it back into the control token's
                # id: spell it in two pieces instead, so that no control token comes from client text.
                cut = piece.index(added.content) + 1
                ids.extend(self._text_ids(piece[:cut], first and covered == 0))
                ids.extend(self._text_ids(piece[cut:], False))
            covered = max(covered, end)
        return ids

    @cached_property
    def _markup_finder(self) -> Tokenizer:
        """A tokenizer that only finds the added tokens, as this one does (same flags, same
        normaliser), and turns each stretch in between into one unknown token: the offsets of
        the markup without the cost of encoding (and converting the offsets of) every token."""
        vocab = {token.content: token_id for token_id, token in self._added.items()}
        vocab[_FINDER_UNKNOWN] = self._finder_unknown_id
        finder = Tokenizer(models.WordLevel(vocab, unk_token=_FINDER_UNKNOWN))
        finder.normalizer = self._tokenizer.normalizer
        tokens = list(self._added.values())
        finder.add_special_tokens([token for token in tokens if token.special])
        finder.add_tokens([token for token in tokens if not token.special])
        return finder

    @cached_property
    def _finder_unknown_id(self) -> int:
        return max(self._added, default=0) + 1

    @cached_property
    def _plain_first(self) -> Tokenizer:
        """The tokenizer without added tokens (the same model, normaliser, pre-tokenizer): text only."""
        plain = Tokenizer(self._tokenizer.model)
        if self._tokenizer.normalizer is not None:
            plain.normalizer = self._tokenizer.normalizer
        if self._tokenizer.pre_tokenizer is not None:
            plain.pre_tokenizer = self._tokenizer.pre_tokenizer
        return plain

    @cached_property
    def _plain_later(self) -> Tokenizer:
        """:attr:`_plain_first` for a segment that does not start the prompt (no ``first`` prefix)."""
        state = _state(self._tokenizer.pre_tokenizer)
        later = _never_prepend(state)
        if later == state:
            return self._plain_first
        plain = Tokenizer(self._tokenizer.model)
        if self._tokenizer.normalizer is not None:
            plain.normalizer = self._tokenizer.normalizer
        plain.pre_tokenizer = _pre_tokenizer_from_state(later)
        return plain


class _PieceSplitter:
    """Splits a prompt at its markup into pieces whose ids, concatenated, are the whole text's.

    The tokenizer itself first splits its input at its added tokens that are matched in the raw
    text (``normalized: false``), leftmost-longest, then normalises, pre-tokenizes and encodes each
    stretch in between on its own; so a stretch's ids do not depend on the rest of the prompt, and
    :meth:`split` cuts exactly there. Only where that holds: not when a pre-tokenizer treats the
    text's first stretch apart (Metaspace's ``prepend_scheme: first``), when an added token matches
    with ``lstrip``, ``rstrip`` or ``single_word`` (its match then depends on its neighbours), or when
    the tokenizer truncates or pads (per stretch instead of per prompt).
    """

    def __init__(self, pattern: re.Pattern[str], split_ids: dict[str, int]) -> None:
        self._pattern = pattern
        self._split_ids = split_ids

    @classmethod
    def of(cls, tokenizer: Tokenizer, added: dict[int, Any]) -> _PieceSplitter | None:
        """The splitter for ``tokenizer`` (``added``: its added tokens by id), or None where its
        stretches are not independent."""
        raw = {token_id: token for token_id, token in added.items() if not token.normalized}
        if not raw or tokenizer.truncation is not None or tokenizer.padding is not None:
            return None
        if any(token.lstrip or token.rstrip or token.single_word for token in added.values()):
            return None
        state = _state(tokenizer.pre_tokenizer)
        if _never_prepend(state) != state:
            return None
        split_ids = {token.content: token_id for token_id, token in raw.items()}
        return cls(re.compile(_trie_pattern(list(split_ids))), split_ids)

    def split(self, text: str) -> list[str | int]:
        """``text`` as its stretches (str) and the ids of the added tokens between them (int)."""
        parts: list[str | int] = []
        done = 0
        for match in self._pattern.finditer(text):
            if match.start() > done:
                parts.append(text[done : match.start()])
            parts.append(self._split_ids[match.group(0)])
            done = match.end()
        if done < len(text):
            parts.append(text[done:])
        return parts


__all__ = ["ClientTextEscaper", "Escaped", "PromptEncoder", "PromptTooLongError"]
