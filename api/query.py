"""Query-string values parsed the way the SDK sends them (``true``/``false``, integers).

Parsed by hand rather than declared as FastAPI query parameters so that a bad
value gets OpenAI's error envelope with ``param`` naming the parameter, and so
that parameters resq ignores (``include[]``, ``include_obfuscation``) never fail
a request.
"""

from __future__ import annotations

import re

from starlette.datastructures import QueryParams

from api.errors import invalid_value
from api.schemas import KNOWN_INCLUDES

# Event-log entry ids are `0-<n + 1>` with 64-bit parts: a larger position cannot exist.
MAX_POSITION = 2**63 - 2
_TRUE = frozenset({"true", "1"})
_FALSE = frozenset({"false", "0"})


def boolean(value: str | None, param: str) -> bool:
    """A boolean parameter; absent is false."""
    if value is None:
        return False
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise invalid_value(f"Invalid value for '{param}': {value!r}. Expected 'true' or 'false'.", param)


_DECIMAL = re.compile(r"-?[0-9]+")


def decimal(value: str) -> int:
    """``value`` as an integer written in ASCII decimal digits (``ValueError`` otherwise): Python's
    ``int`` also reads ``1_0``, ``+3``, `` 1`` and other scripts' digits, which no client sends."""
    if _DECIMAL.fullmatch(value) is None:
        raise ValueError(value)
    return int(value)


def non_negative_int(value: str | None, param: str) -> int | None:
    """A non-negative integer parameter (at most :data:`MAX_POSITION`); absent is None."""
    if value is None:
        return None
    try:
        number = decimal(value)
    except ValueError:
        raise invalid_value(
            f"Invalid type for '{param}': {value!r} is not an integer.", param, "invalid_type"
        ) from None
    if not 0 <= number <= MAX_POSITION:
        raise invalid_value(
            f"Invalid value for '{param}': {number}. It must be between 0 and {MAX_POSITION}.", param
        )
    return number


def check_include(query: QueryParams) -> None:
    """400 for an ``include`` value no item list knows (the item lists' only use of it: which
    optional fields their items carry). The SDK sends ``include[]=...``; curl users write
    ``include=...``."""
    for value in [*query.getlist("include"), *query.getlist("include[]")]:
        if value not in KNOWN_INCLUDES:
            known = ", ".join(repr(name) for name in sorted(KNOWN_INCLUDES))
            raise invalid_value(
                f"Invalid value for 'include': {value!r}. Expected one of {known}.", "include"
            )
