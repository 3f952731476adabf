"""The Redis layout: every key resq reads or writes is named here and nowhere else.

The keys of one response share the hash tag ``{resp_...}`` so that a Redis
Cluster keeps them on one slot: the Lua scripts and MULTI blocks that touch
several of them stay legal there.

Event-log entries use explicit stream ids ``0-<sequence_number + 1>``: a resumed
stream is an ``XRANGE`` from the next id, and Redis itself rejects an append
whose id is not above the last one, which makes re-running a post-processor
safe (a duplicate event is refused, never stored twice).
"""

from __future__ import annotations

import hashlib

PREFIX = "resq"

# Celery queues
GENERATE_QUEUE = "generate"
"""The prefix of the generation queues: one per served model (:func:`generate_queue`)."""
POSTPROCESS_QUEUE = "postprocess"

# Celery task names (roles register them; senders use the names only)
GENERATE_TASK = "resq.generate"
POSTPROCESS_TASK = "resq.postprocess"

# Global keys
MODELS = f"{PREFIX}:models"
"""Hash: served model name -> JSON model card (without the tokenizer)."""

MODELS_SERVED = f"{PREFIX}:models:served"
"""Sorted set: model name -> unix time a GPU worker serving it last beat (cards expire with it)."""

GPU_WORKERS = f"{PREFIX}:workers:gpu"
"""Sorted set: GPU worker id -> unix time of its last heartbeat."""

POSTPROCESS_WORKERS = f"{PREFIX}:workers:postprocess"
"""Sorted set: post-process worker id -> unix time of its last heartbeat."""

GENERATIONS = f"{PREFIX}:generations"
"""Sorted set: response id -> unix time it was accepted, for every generation not yet ended.

The reaper walks it to find generations whose GPU worker died or whose job was lost.
"""

# The two post-process lease keys share the hash tag ``{leases}``, so that the scripts
# that update both stay legal on a Redis Cluster.
POSTPROCESS_LEASES = f"{PREFIX}:{{leases}}:postprocess"
"""Sorted set: response id -> when its post-processing lease lapses (Redis time, ms)."""

POSTPROCESS_LEASE_HOLDERS = f"{PREFIX}:{{leases}}:postprocess:holders"
"""Hash: response id -> id of the post-processor holding its lease (empty: not yet taken)."""

REAPER_LOCK = f"{PREFIX}:reaper:lock"
"""String: held (with a short expiry) by the process running the current reaper pass."""


def rate_limit(caller: str) -> str:
    """Hash: the token bucket (``tokens``, ``at`` ms) of one API key's fingerprint; expires once full."""
    return f"{PREFIX}:ratelimit:{caller}"


def tokenizer(sha256: str) -> str:
    """String: a ``tokenizer.json`` by content hash (shared by all models that use it)."""
    return f"{PREFIX}:tokenizer:{sha256}"


def worker_info(role: str, worker_id: str) -> str:
    """String: JSON details of one worker (model, pid, host), expiring with its heartbeat."""
    return f"{PREFIX}:workers:{role}:{worker_id}"


def api_wakeup(hub_id: str) -> str:
    """Stream: nudges one API process's event hub to re-issue its blocking read (new followers)."""
    return f"{PREFIX}:api:{hub_id}:wakeup"


def postprocess_wakeup(hub_id: str) -> str:
    """Stream: nudges one post-process worker's token hub to re-issue its blocking read (new streams)."""
    return f"{PREFIX}:postprocess:{hub_id}:wakeup"


def _response(response_id: str, suffix: str) -> str:
    return f"{PREFIX}:{{{response_id}}}:{suffix}"


def tokens(response_id: str) -> str:
    """Stream: token chunks the GPU worker publishes for one response."""
    return _response(response_id, "tokens")


def events(response_id: str) -> str:
    """Stream: the response's OpenAI events, entry id ``0-<sequence_number + 1>``."""
    return _response(response_id, "events")


def record(response_id: str) -> str:
    """Hash: status, Response snapshot, request options and ownership of one response."""
    return _response(response_id, "response")


def input_items(response_id: str) -> str:
    """String: JSON ``{"items"}``: the response's own input items (with ids, as ``input_items``
    lists them), and ``conversation_id`` when it belongs to a conversation. (Responses stored
    before turns existed, and a stored one continuing a WebSocket's unstored response, also hold
    ``conversation``: every item they were generated from, sealed reasoning as it was sent.)"""
    return _response(response_id, "input")


def turn(response_id: str) -> str:
    """Hash: the response's turn in its ``previous_response_id`` chain (:mod:`resq.turns`):
    ``parent``, ``input`` and ``output`` items, ``children``, ``deleted``. Outlives the response
    while a later turn continues it."""
    return _response(response_id, "turn")


def cancel(response_id: str) -> str:
    """String: present when the generation of the response must stop."""
    return _response(response_id, "cancel")


def generation(response_id: str) -> str:
    """Hash: the generation job, which GPU worker owns it, and its fencing epoch."""
    return _response(response_id, "generation")


def all_keys(response_id: str) -> tuple[str, ...]:
    """Every key of one response (what ``DELETE`` removes)."""
    return (
        tokens(response_id),
        events(response_id),
        record(response_id),
        input_items(response_id),
        cancel(response_id),
        generation(response_id),
    )


def pending_of(owner: str) -> str:
    """Sorted set: the generations of ``owner`` (an API key's fingerprint) admitted and maybe still
    in :data:`GENERATIONS` (``RESQ_MAX_PENDING_PER_KEY``; entries that left it are pruned at the
    key's next admission)."""
    return f"{PREFIX}:pending:{owner}"


def _item_digest(item_id: str) -> str:
    # Hashed: a client chooses its input items' ids, of any length.
    return hashlib.blake2b(item_id.encode(), digest_size=16).hexdigest()


def item_holders(owner: str, item_id: str) -> str:
    """List of ``"<response_id> <o|i>"``, latest first: the stored responses whose output (``o``)
    or input (``i``) holds the item ``item_id`` of ``owner`` (:mod:`resq.item_index`)."""
    return f"{PREFIX}:itemholders:{owner}:{_item_digest(item_id)}"


def item_ref(owner: str, item_id: str) -> str:
    """String: ``"<response_id> <o|i>"``, the one holder the index kept before
    :func:`item_holders` (entries written by earlier versions, read until they expire with the
    response they name)."""
    return f"{PREFIX}:itemref:{owner}:{_item_digest(item_id)}"


def event_entry_id(sequence_number: int) -> str:
    """The stream id of the event with this ``sequence_number``."""
    return f"0-{sequence_number + 1}"


def sequence_number_of(entry_id: bytes | str) -> int:
    """The ``sequence_number`` of an event-log entry id."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[1]) - 1


def generate_queue(model: str) -> str:
    """The Celery queue of the generation jobs of ``model``: only GPU workers serving it consume it."""
    return f"{GENERATE_QUEUE}:{model}"


def worker_generate_queue(model: str, worker_id: str) -> str:
    """The Celery queue of one GPU worker's own jobs of ``model`` (cache-aware routing)."""
    return f"{generate_queue(model)}@{worker_id}"


def celery_queue(queue: str) -> str:
    """List: messages waiting in a Celery queue (kombu's Redis transport names it after the queue)."""
    return queue


# The keys of one conversation share the hash tag ``{conv_...}``, so that the scripts of
# resq.conversations, which touch all four, stay legal on a Redis Cluster.


def _conversation(conversation_id: str, suffix: str) -> str:
    return f"{PREFIX}:{{{conversation_id}}}:{suffix}"


def conversation(conversation_id: str) -> str:
    """Hash: ``owner`` (the creating key's fingerprint), ``created_at`` (unix seconds) and
    ``metadata`` (JSON) of one conversation; the conversation exists while this key does."""
    return _conversation(conversation_id, "conversation")


def conversation_items(conversation_id: str) -> str:
    """List: the conversation's item ids, in conversation order (each id once)."""
    return _conversation(conversation_id, "items")


def conversation_item_data(conversation_id: str) -> str:
    """Hash: item id -> the item's JSON, for every id of :func:`conversation_items`."""
    return _conversation(conversation_id, "item_data")


def conversation_appended(conversation_id: str) -> str:
    """Set: ids of the responses whose items were appended already (the exactly-once marker)."""
    return _conversation(conversation_id, "appended")


def conversation_keys(conversation_id: str) -> tuple[str, str, str, str]:
    """Every key of one conversation, in the order the scripts of resq.conversations take them."""
    return (
        conversation(conversation_id),
        conversation_items(conversation_id),
        conversation_item_data(conversation_id),
        conversation_appended(conversation_id),
    )
