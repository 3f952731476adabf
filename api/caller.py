"""Who is calling: the identity responses are owned by.

With ``RESQ_API_KEYS`` set, :class:`api.gate.Gate` proves the caller from its
bearer token and ``owner`` is the fingerprint of that key (:mod:`api.auth`); on
an open API every caller is :data:`ANONYMOUS`. The store checks ownership in one
place (:meth:`api.store.ResponseStore.visible`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """The identity behind a request; ``owner`` is what response records store (never the key)."""

    owner: str = ""


ANONYMOUS = Caller()
