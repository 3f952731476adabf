"""The served models, as GPU workers register them in Redis.

A GPU worker that loads a model publishes its *model card* (name, context
length, chat template, special tokens) and its ``tokenizer.json``. The API and
the post-process workers read both from Redis, so they need no model files, no
torch and no transformers: any replica anywhere can tokenize and detokenize for
any model a GPU worker serves.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, cast

from llguidance import LLTokenizer
from pydantic import BaseModel, ConfigDict
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from resq import keys
from resq.chat_template import render_chat
from resq.grammars import AcceptedGrammars
from resq.prompt_tokens import PromptEncoder
from resq.redis_types import optional_bytes, scored_members, texts

log = logging.getLogger(__name__)

WARM_UP_WAIT_S = 600.0
"""How long a starting API or post-process worker waits for a GPU worker to serve a model whose
tokenizer it builds ahead of its first request (as long as ``resq up`` waits for the stack to be
ready)."""
WARM_UP_POLL_S = 0.5
"""How often, meanwhile, it asks whether one does."""
CARD_REFRESH_S = 5.0
"""How long a process trusts its cached copy of a model card before re-reading it."""
SERVED_RECHECK_S = 1.0
"""How long the API reuses a "served now" answer before asking Redis again. The answer comes
from heartbeats (every ``RESQ_HEARTBEAT_S``, 2 s by default) judged against
``RESQ_WORKER_TTL_S``, so it is seconds old by nature; asking once per request cost the API a
Redis pipeline per request, a third of its CPU inside ``accept`` under load
(``docs/benchmarks.md``, B4). A model whose workers stopped is refused at most this much later."""
REFRESH_EVERY_S = SERVED_RECHECK_S / 2
"""How often the API renews both answers for every model it has served (:meth:`AsyncModelCatalog.keep_fresh`)."""


class ModelCard(BaseModel):
    """What every role needs to know about a served model, besides its weights."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    context_length: int
    chat_template: str
    special_tokens: dict[str, str]
    """``bos_token``, ``eos_token``... as strings: chat templates read them by these names."""
    eos_token_ids: list[int]
    tokenizer_sha256: str
    created: int
    source: str
    """Where the weights came from (a path or a hub id), for ``/v1/models`` and logs."""
    logprobs: bool = False
    """Whether the GPU worker computes each sampled token's log-probability."""
    structured_outputs: bool = False
    """Whether the GPU worker constrains decoding to grammars (``RESQ_STRUCTURED_OUTPUTS``)."""
    penalties: bool = False
    """Whether the GPU worker applies ``presence_penalty`` / ``frequency_penalty`` (not in a CUDA graph)."""
    default_temperature: float | None = None
    """The model's recommended ``temperature`` (``RESQ_SAMPLING_DEFAULTS``), for requests that set
    none; None: OpenAI's 1.0."""
    default_top_p: float | None = None
    """The model's recommended ``top_p``, likewise."""

    def renders_like(self, other: ModelCard) -> bool:
        """Whether ``other`` is the same model as far as a prompt goes (weights' source, tokenizer,
        template, context): what must match before a worker may serve requests rendered for it."""
        fields = ("source", "tokenizer_sha256", "chat_template", "context_length", "eos_token_ids")
        return all(getattr(self, name) == getattr(other, name) for name in fields)


@dataclass
class TextTokenizer:
    """Tokenizer and chat template of one model, usable without transformers."""

    card: ModelCard
    tokenizer: Tokenizer

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra_context: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``, ending with the assistant generation prompt.

        ``extra_context`` holds template variables such as ``enable_thinking``.
        """
        return render_chat(
            self.card.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=True,
            special_tokens=self.card.special_tokens,
            extra_context=extra_context,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of server text: every special and added token in it is a control token."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra_context: dict[str, Any] | None = None,
        max_tokens: int | None = None,
        cache_owner: str | None = None,
    ) -> list[int]:
        """Token ids of the prompt for ``messages``: the template's markup as control tokens, every
        string of ``messages`` and ``tools`` as text (:mod:`resq.prompt_tokens`).

        Raises :class:`resq.prompt_tokens.PromptTooLongError`, without tokenizing, when the rendered
        prompt must have more than ``max_tokens`` tokens. ``cache_owner``: the caller whose pieces
        encoded before are reused (:mod:`resq.piece_cache`); None encodes the whole prompt.
        """
        return self._prompt_encoder.prompt_ids(
            lambda chat, offered: self.render(chat, offered, extra_context),
            messages,
            tools,
            max_tokens,
            cache_owner,
        )

    @cached_property
    def _prompt_encoder(self) -> PromptEncoder:
        return PromptEncoder(self.tokenizer)

    def with_card(self, card: ModelCard) -> TextTokenizer:
        """This tokenizer under ``card``, a card of the same model (:meth:`ModelCard.renders_like`: the
        same vocabulary, template and end tokens) from another start of it: what was built from the
        vocabulary (the prompt encoder and its cached pieces, the grammar tokenizer) is kept."""
        twin = TextTokenizer(card=card, tokenizer=self.tokenizer)
        twin.__dict__.update(
            {name: value for name, value in vars(self).items() if name not in ("card", "tokenizer")}
        )
        return twin

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens skipped (for tests and logs)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    @cached_property
    def grammar_tokenizer(self) -> LLTokenizer:
        """The vocabulary as llguidance sees it, to check grammars against (built once, ~1 s for 150k tokens)."""
        return LLTokenizer(self.tokenizer.to_str(), eos_token=list(self.card.eos_token_ids) or None)

    @cached_property
    def grammar_checks(self) -> AcceptedGrammars:
        """Checks grammars against this vocabulary, remembering those it accepted."""
        return AcceptedGrammars(self.grammar_tokenizer)

    def special_token_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one token that llguidance treats as special (markup tags)."""
        token_id = self.tokenizer.token_to_id(text)
        if token_id is None or not self.grammar_tokenizer.is_special_token(token_id):
            return None
        return int(token_id)

    def decode_stream(self) -> DecodeStream:
        """A fresh incremental decoder (holds back bytes of an unfinished UTF-8 character)."""
        return DecodeStream(skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes ``token_id`` stands for, where the vocabulary says exactly; else None.

        Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, ...) spell every byte as
        one character, so a token that holds part of a UTF-8 character still has
        exact bytes. Other vocabularies (SentencePiece) answer None: the caller
        falls back to the decoded text.
        """
        added = self._added_tokens.get(token_id)
        if added is not None:
            return added
        if self._byte_decoder is None:
            return None
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        try:
            return bytes(self._byte_decoder[char] for char in piece)
        except KeyError:
            return None

    def spelling(self, token_id: int) -> str:
        """How ``token_id`` reads on its own, special tokens included (``<|im_end|>``); empty for an
        id outside the vocabulary (a model's logits may be padded past it)."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    @cached_property
    def _added_tokens(self) -> dict[int, bytes]:
        # Special tokens never reach the text (decoding skips them): they stand for no bytes.
        return {
            token_id: b"" if token.special else token.content.encode()
            for token_id, token in self.tokenizer.get_added_tokens_decoder().items()
        }

    @cached_property
    def _byte_decoder(self) -> dict[str, int] | None:
        decoder = self.tokenizer.decoder
        if decoder is None:
            return None
        state = json.loads(decoder.__getstate__())
        kinds = {state.get("type")} | {part.get("type") for part in state.get("decoders") or []}
        return _byte_level_alphabet() if "ByteLevel" in kinds else None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: the character that spells each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in table.items()}


def tokenizer_sha256(tokenizer_json: str) -> str:
    """Content hash under which a ``tokenizer.json`` is stored."""
    return hashlib.sha256(tokenizer_json.encode()).hexdigest()


def register_model(redis: Redis, card: ModelCard, tokenizer_json: str) -> None:
    """Publish a model card and its tokenizer, and mark it served now (GPU worker, at start-up)."""
    pipe = redis.pipeline(transaction=True)
    pipe.set(keys.tokenizer(card.tokenizer_sha256), tokenizer_json)
    pipe.hset(keys.MODELS, card.name, card.model_dump_json())
    pipe.zadd(keys.MODELS_SERVED, {card.name: time.time()})
    pipe.execute()


def mark_served(redis: Redis, name: str) -> None:
    """Say that a GPU worker serves model ``name`` now (each heartbeat): its card stays listed."""
    redis.zadd(keys.MODELS_SERVED, {name: time.time()})


def served_now(last_beat: float | None, served_within_s: float, now: float | None = None) -> bool:
    """Whether a model whose serving worker last beat at ``last_beat`` counts as served."""
    return last_beat is not None and (time.time() if now is None else now) - last_beat <= served_within_s


@dataclass
class _Entry:
    tokenizer: TextTokenizer
    fetched_at: float = field(default_factory=time.monotonic)
    served_at: float = -SERVED_RECHECK_S
    """``time.monotonic()`` when the model was last found served (the API's catalog only)."""


def _build(card_json: bytes, tokenizer_json: bytes | None, cached: _Entry | None) -> _Entry | None:
    card = ModelCard.model_validate_json(card_json)
    if cached is not None and cached.tokenizer.card == card:
        cached.fetched_at = time.monotonic()
        return cached
    if cached is not None and cached.tokenizer.card.renders_like(card):
        # Another start of the same model (a GPU worker's restart, or what its engine can do): the
        # tokenizer stays, which a real vocabulary takes tens of milliseconds to build.
        return _Entry(cached.tokenizer.with_card(card))
    if tokenizer_json is None:
        return None
    return _Entry(TextTokenizer(card=card, tokenizer=Tokenizer.from_str(tokenizer_json.decode())))


class ModelCatalog:
    """Model cards and tokenizers read from Redis, cached per process (blocking client)."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._entries: dict[str, _Entry] = {}

    def served(self, served_within_s: float) -> list[str]:
        """The models a GPU worker serving them beat for within the last ``served_within_s``."""
        since = time.time() - served_within_s
        return texts(self._redis.zrangebyscore(keys.MODELS_SERVED, since, "+inf"))

    def get(self, name: str) -> TextTokenizer | None:
        """The tokenizer of model ``name``, or None when no GPU worker registered it."""
        cached = self._entries.get(name)
        if cached is not None and time.monotonic() - cached.fetched_at < CARD_REFRESH_S:
            return cached.tokenizer
        card_json = optional_bytes(self._redis.hget(keys.MODELS, name))
        if card_json is None:
            return None
        card = ModelCard.model_validate_json(card_json)
        tokenizer_json: bytes | None = None
        if cached is None or not cached.tokenizer.card.renders_like(card):
            tokenizer_json = optional_bytes(self._redis.get(keys.tokenizer(card.tokenizer_sha256)))
        entry = _build(card_json, tokenizer_json, cached)
        if entry is None:
            return None
        self._entries[name] = entry
        return entry.tokenizer


class AsyncModelCatalog:
    """The catalog the API serves from: only models a live GPU worker serves now.

    A card outlives the worker that registered it (a restart with another model leaves it in
    the hash); it counts only while some GPU worker serving it beat within ``served_within_s``
    (:data:`resq.keys.MODELS_SERVED`), so ``/v1/models`` lists what is served now and a request
    naming a model the workers no longer serve is a 404 (at most :data:`SERVED_RECHECK_S` after
    the card stopped counting), never rendered with a stale tokenizer.
    While no GPU worker is alive at all (a restart), the last cards stand: their requests wait
    for a worker, as a job does, and a worker that comes back with another model refuses them.
    """

    def __init__(self, redis: AsyncRedis, served_within_s: float) -> None:
        self._redis = redis
        self._served_within_s = served_within_s
        self._entries: dict[str, _Entry] = {}

    async def get(self, name: str) -> TextTokenizer | None:
        """The tokenizer of model ``name``, or None when no live GPU worker serves it."""
        cached = self._entries.get(name)
        now = time.monotonic()
        if cached is not None and now - cached.fetched_at < CARD_REFRESH_S:
            if now - cached.served_at < SERVED_RECHECK_S:
                return cached.tokenizer
            # The card is trusted for a while; whether its model is still served is asked again
            # (one round trip): a restart with another model must not be served its old name.
            pipe = self._redis.pipeline(transaction=False)
            pipe.zscore(keys.MODELS_SERVED, name)
            pipe.zrange(keys.MODELS_SERVED, -1, -1, withscores=True)
            last_beat, newest = await pipe.execute()
            if self._counts(last_beat, scored_members(newest)):
                cached.served_at = now
                return cached.tokenizer
            self._entries.pop(name, None)
            return None
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(keys.MODELS, name)
        pipe.zscore(keys.MODELS_SERVED, name)
        pipe.zrange(keys.MODELS_SERVED, -1, -1, withscores=True)
        raw_card, last_beat, newest = await pipe.execute()
        card_json = optional_bytes(raw_card)
        if card_json is None or not self._counts(last_beat, scored_members(newest)):
            self._entries.pop(name, None)
            return None
        card = ModelCard.model_validate_json(card_json)
        tokenizer_json: bytes | None = None
        if cached is None or not cached.tokenizer.card.renders_like(card):
            tokenizer_json = optional_bytes(await self._redis.get(keys.tokenizer(card.tokenizer_sha256)))
        entry = _build(card_json, tokenizer_json, cached)
        if entry is None:
            return None
        entry.served_at = now
        self._entries[name] = entry
        return entry.tokenizer

    async def refresh(self) -> None:
        """Renew every cached model's answers (its card, and whether a live GPU worker serves it) in
        one round trip, ahead of the requests that would otherwise renew them: a request after a
        quiet second waited for that round trip (an agent's turns come seconds apart; the first
        request after a start waited for it). A model no longer served, or whose card now names
        another model, is dropped, and :meth:`get` decides again for the next request, as it did; a
        card of another start of the same model replaces the old one, keeping its tokenizer."""
        entries = dict(self._entries)
        if not entries:
            return
        asked = time.monotonic()
        pipe = self._redis.pipeline(transaction=False)
        for name in entries:
            pipe.hget(keys.MODELS, name)
            pipe.zscore(keys.MODELS_SERVED, name)
        pipe.zrange(keys.MODELS_SERVED, -1, -1, withscores=True)
        *replies, raw_newest = await pipe.execute()
        newest = scored_members(raw_newest)
        for index, (name, entry) in enumerate(entries.items()):
            if self._entries.get(name) is not entry:
                continue  # a request rebuilt it meanwhile
            card_json = optional_bytes(replies[2 * index])
            last_beat = replies[2 * index + 1]
            # The same card, or another start's of the same model: nothing to fetch (None: another model).
            renewed = _build(card_json, None, entry) if card_json is not None else None
            if renewed is None or not self._counts(last_beat, newest):
                del self._entries[name]  # get() decides again, and builds another model's tokenizer
                continue
            entry = self._entries[name] = renewed
            entry.fetched_at = asked
            # Only a model a live worker serves is vouched for ahead of time. While no worker is
            # alive (a restart), the last cards stand for a request that asks, as before; renewed
            # here, a request in the second after another model's worker came up would still be
            # taken for the old one and wait for a worker that never comes.
            if served_now(last_beat, self._served_within_s):
                entry.served_at = asked

    async def keep_fresh(self) -> None:
        """:meth:`refresh` every :data:`REFRESH_EVERY_S` until cancelled (the API's lifespan). A refresh
        that fails (Redis away) changes nothing: :meth:`get` asks itself once the answers are old."""
        while True:
            try:
                await self.refresh()
            except Exception as error:
                log.debug("the model catalog was not refreshed: %s", error)
            await asyncio.sleep(REFRESH_EVERY_S)

    def _counts(self, last_beat: float | None, newest: list[tuple[bytes, float]]) -> bool:
        # Served now; or no model is (every GPU worker is down or restarting): then the last
        # cards stand, and their jobs wait for a worker as before (RESQ_GPU_LOST_TIMEOUT_S).
        if served_now(last_beat, self._served_within_s):
            return True
        return not newest or not served_now(newest[0][1], self._served_within_s)

    async def cards(self) -> list[ModelCard]:
        """The cards of the models a live GPU worker serves now."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(keys.MODELS)
        pipe.zrange(keys.MODELS_SERVED, 0, -1, withscores=True)
        raw, beats = await pipe.execute()
        last_beats = {name.decode(): score for name, score in scored_members(beats)}
        newest = sorted(scored_members(beats), key=lambda member: member[1])[-1:]
        return [
            ModelCard.model_validate_json(value)
            for name, value in cast(dict[bytes, bytes], raw).items()
            if self._counts(last_beats.get(name.decode()), newest)
        ]


def card_to_openai_model(card: ModelCard) -> dict[str, Any]:
    """The ``/v1/models`` entry for a card."""
    return {"id": card.name, "object": "model", "created": card.created, "owned_by": "resq"}


__all__ = [
    "AsyncModelCatalog",
    "ModelCard",
    "ModelCatalog",
    "TextTokenizer",
    "card_to_openai_model",
    "mark_served",
    "register_model",
    "served_now",
    "tokenizer_sha256",
]
