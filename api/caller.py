"""Who is calling: the identity responses are owned by.

resq has no authentication yet, so every caller is :data:`ANONYMOUS` and owns
every response it creates. Authentication replaces :func:`api.deps.get_caller`;
the store checks ownership in one place (:meth:`api.store.ResponseStore.visible`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """The identity behind a request; ``owner`` is what response records store."""

    owner: str = ""


ANONYMOUS = Caller()
