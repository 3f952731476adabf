"""JSON encoding shared by all roles (orjson: fast, and bytes in, bytes out)."""

from __future__ import annotations

from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    """Compact JSON bytes."""
    return orjson.dumps(value)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON bytes or text."""
    return orjson.loads(data)
