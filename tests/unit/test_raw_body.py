"""The raw body's check: its quick walk finds a flaw exactly where the walk that names the path does."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import PydanticCustomError

from api.schemas import MAX_NESTING, _raise_first_flaw, _sound, check_raw_body

_TEXT = st.sampled_from(["", "plain", "café", "\ud800", "a\udfffb", "😀"])
_NUMBER = st.sampled_from([0, -1, 2**63 - 1, 2**64, -(2**70), 2.5, float("nan"), float("inf"), True])
_BODY = st.recursive(
    st.none() | _TEXT | _NUMBER,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=16,
)


def _flaw(body: Any) -> str | None:
    try:
        _raise_first_flaw(body)
    except PydanticCustomError as error:
        return f"{error.type}: {error.message()}"
    return None


@settings(max_examples=400, deadline=None)
@given(body=_BODY)
def test_the_quick_walk_finds_a_flaw_exactly_where_the_naming_walk_does(body: Any) -> None:
    expected = _flaw(body)
    assert _sound(body) == (expected is None)
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

    assert _sound(nested(MAX_NESTING)) and _flaw(nested(MAX_NESTING)) is None
    assert not _sound(nested(MAX_NESTING + 1))
    assert (_flaw(nested(MAX_NESTING + 1)) or "").startswith("nesting_limit")


def test_the_error_still_names_the_culprits_path() -> None:
    body = {"input": [{"content": "ok"}, {"content": ["fine", "bad \ud800"]}]}
    with pytest.raises(PydanticCustomError) as raised:
        check_raw_body(body)
    assert raised.value.context == {"param": "input[1].content[1]"}
