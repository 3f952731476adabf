"""Identifiers of responses and of their output items.

Item ids are derived from the response id and the item's position, not drawn at
random: a post-processor that is re-run after a crash rebuilds byte-identical
events, so the events it re-creates match the ones already logged.
"""

from __future__ import annotations

import hashlib
import re
import secrets

RESPONSE_ID_PATTERN = re.compile(r"^resp_[0-9a-f]{32}$")


def new_response_id() -> str:
    """A fresh ``resp_`` id: 32 random hex digits."""
    return "resp_" + secrets.token_hex(16)


def is_response_id(value: str) -> bool:
    """Whether ``value`` is shaped like an id this server issues."""
    return RESPONSE_ID_PATTERN.fullmatch(value) is not None


def item_id(prefix: str, response_id: str, output_index: int) -> str:
    """The id of the output item at ``output_index`` (``msg``, ``rs``, ``fc``, ``call`` prefixes)."""
    digest = hashlib.blake2b(f"{response_id}/{prefix}/{output_index}".encode(), digest_size=16).hexdigest()
    return f"{prefix}_{digest}"


def input_item_id(response_id: str, index: int) -> str:
    """The id given to the ``index``-th input item of a response when the client sent none."""
    return item_id("in", response_id, index)


CONVERSATION_ID_PATTERN = re.compile(r"^conv_[0-9a-f]{32}$")


def new_conversation_id() -> str:
    """A fresh ``conv_`` id: 32 random hex digits."""
    return "conv_" + secrets.token_hex(16)


def is_conversation_id(value: str) -> bool:
    """Whether ``value`` is shaped like a conversation id this server issues."""
    return CONVERSATION_ID_PATTERN.fullmatch(value) is not None
