"""Items that carry a sealed blob (``encrypted_content``): reasoning and compaction items.

resq seals them for one caller (:mod:`resq.sealed`); an item comes back as input, or is added to
a conversation, only if that caller's key opens it. One check for both ways in, so that a blob
refused on one is refused on the other with the same error.
"""

from __future__ import annotations

from typing import Any

from api.errors import invalid_value
from resq import sealed
from resq.sealed import Sealer, SealError

Item = dict[str, Any]

_PURPOSES = {"reasoning": sealed.REASONING, "compaction": sealed.COMPACTION}


def opened_text(item: Item, sealer: Sealer, owner: str, where: str) -> str | None:
    """The text ``item``'s blob seals for ``owner``; None when it carries none. A blob that does not
    open (altered, another server's, another key's) is a 400 ``invalid_encrypted_content`` naming
    ``where`` (the item's parameter path, e.g. ``input[3]``)."""
    purpose = _PURPOSES.get(item.get("type") or "")
    blob = item.get("encrypted_content") if purpose is not None else None
    if purpose is None or not isinstance(blob, str):
        return None
    try:
        return sealer.open(purpose, owner, blob)
    except SealError as exc:
        raise invalid_value(
            f"Invalid '{where}.encrypted_content': {exc}.",
            f"{where}.encrypted_content",
            "invalid_encrypted_content",
        ) from None


def check_sealed(items: list[Item], sealer: Sealer, owner: str, param: str = "items") -> None:
    """Refuse, naming ``param[i].encrypted_content``, an item whose blob ``owner`` cannot open:
    added to a conversation, it would make every later response of the conversation a 400."""
    for index, item in enumerate(items):
        opened_text(item, sealer, owner, f"{param}[{index}]")
