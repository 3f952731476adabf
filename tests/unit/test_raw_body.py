"""The raw body's check: its walk, which builds a value's path only for an error, finds the same flaw
with the same path as the walk that built every value's path (kept here as the reference)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import PydanticCustomError

from api.schemas import MAX_NESTING, _check_values, _storable_number, check_raw_body, not_utf8

_TEXT = st.sampled_from(["", "plain", "café", "\ud800", "a\udfffb", "😀"])
_NUMBER = st.sampled_from([0, -1, 2**63 - 1, 2**64, -(2**70), 2.5, float("nan"), float("inf"), True])
_BODY = st.recursive(
    st.none() | _TEXT | _NUMBER,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=16,
)


def _reference_flaw(body: Any) -> tuple[str, dict[str, Any] | None] | None:
    """The first flaw as the walk before did it, building every value's path on the way."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_NESTING:
            return "nesting_limit", {
                "limit": MAX_NESTING,
                "param": re.split(r"[.\[]", path, maxsplit=1)[0] or None,
            }
        if isinstance(value, str):
            if not_utf8(value):
                return "invalid_unicode", {"param": path or None}
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not_utf8(key):
                    return "invalid_unicode", {"param": path or None}
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{index}]", depth + 1) for index, item in enumerate(value))
        elif isinstance(value, (int, float)) and not _storable_number(value):
            return "number_range", {"param": path or None}
    return None


def _flaw(body: Any) -> tuple[str, dict[str, Any] | None] | None:
    try:
        _check_values(body)
    except PydanticCustomError as error:
        return error.type, error.context
    return None


@settings(max_examples=400, deadline=None)
@given(body=_BODY)
def test_the_walk_finds_a_flaw_exactly_where_the_naming_walk_does(body: Any) -> None:
    expected = _reference_flaw(body)
    assert _flaw(body) == expected
    if expected is None:
        check_raw_body({"input": body}, limit_items=False)
    else:
        with pytest.raises(PydanticCustomError):
            check_raw_body({"input": body}, limit_items=False)


def test_nesting_past_the_limit_is_a_flaw_and_at_the_limit_is_not() -> None:
    def nested(depth: int) -> Any:
        value: Any = "x"
        for _ in range(depth):
            value = [value]
        return value

    assert _flaw(nested(MAX_NESTING)) is None and _reference_flaw(nested(MAX_NESTING)) is None
    assert _flaw(nested(MAX_NESTING + 1)) == _reference_flaw(nested(MAX_NESTING + 1))
    assert (_flaw(nested(MAX_NESTING + 1)) or ("",))[0] == "nesting_limit"


def test_the_error_still_names_the_culprits_path() -> None:
    body = {"input": [{"content": "ok"}, {"content": ["fine", "bad \ud800"]}]}
    with pytest.raises(PydanticCustomError) as raised:
        check_raw_body(body)
    assert raised.value.context == {"param": "input[1].content[1]"}
