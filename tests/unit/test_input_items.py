"""Input items: their listed shape (checked against the SDK's models), paging and query parameters."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses import ResponseItem
from pydantic import TypeAdapter

from api.input_items import (
    DEFAULT_LIMIT,
    PageParameterError,
    PageRequest,
    duplicate_id,
    normalise_input,
    normalise_item,
    paginate,
    parse_page_request,
)
from resq.conversation import items_to_messages

ITEM = TypeAdapter(ResponseItem)
RESPONSE_ID = "resp_" + "1" * 32

REQUEST_ITEMS: list[dict[str, Any]] = [
    {"role": "system", "content": "Be terse."},
    {"role": "developer", "content": [{"type": "input_text", "text": "Use French."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": "Let me check."},
    {
        "type": "message",
        "role": "assistant",
        "id": "msg_earlier",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
    },
    {
        "type": "reasoning",
        "id": "rs_earlier",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Need the tool."}],
    },
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
    {"role": "user", "content": "Thanks."},
]


def page_ids(items: list[dict[str, Any]], **request: Any) -> tuple[list[str], bool]:
    page = paginate(items, PageRequest(**request))
    return [item["id"] for item in page["data"]], page["has_more"]


def numbered(count: int) -> list[dict[str, Any]]:
    return [{"id": f"in_{index}"} for index in range(count)]


def test_every_normalised_item_is_a_valid_sdk_item_with_an_id() -> None:
    normalised = normalise_input(REQUEST_ITEMS, RESPONSE_ID)
    for item in normalised:
        ITEM.validate_python(item, strict=True)
        assert item["id"]
    assert len({item["id"] for item in normalised}) == len(normalised)
    assert normalised[4]["id"] == "msg_earlier" and normalised[5]["id"] == "rs_earlier"
    assert normalised[0]["content"] == [{"type": "input_text", "text": "Be terse."}]
    assert normalised[3]["content"] == [{"type": "output_text", "text": "Let me check.", "annotations": []}]


def test_ids_are_stable_for_a_response_and_differ_between_responses() -> None:
    again = normalise_input(REQUEST_ITEMS, RESPONSE_ID)
    other = normalise_input(REQUEST_ITEMS, "resp_" + "2" * 32)
    assert [item["id"] for item in again] == [
        item["id"] for item in normalise_input(REQUEST_ITEMS, RESPONSE_ID)
    ]
    assert again[0]["id"] != other[0]["id"]


def test_normalising_keeps_what_the_chat_template_sees() -> None:
    normalised = normalise_input(REQUEST_ITEMS, RESPONSE_ID)
    assert items_to_messages(normalised, "Hi.") == items_to_messages(REQUEST_ITEMS, "Hi.")


def test_three_items_page_one_by_one_in_both_orders() -> None:
    items = numbered(3)
    assert page_ids(items, limit=1, order="asc") == (["in_0"], True)
    assert page_ids(items, limit=1, order="asc", after="in_0") == (["in_1"], True)
    assert page_ids(items, limit=1, order="asc", after="in_1") == (["in_2"], False)
    assert page_ids(items, limit=1, order="desc") == (["in_2"], True)
    assert page_ids(items, limit=1, order="desc", after="in_2") == (["in_1"], True)
    assert page_ids(items, limit=1, order="desc", after="in_1") == (["in_0"], False)
    assert page_ids(items, limit=1, order="asc", after="in_2") == ([], False)


def test_page_shape_names_its_ends() -> None:
    page = paginate(numbered(5), PageRequest(limit=2, order="asc", after="in_0"))
    assert page == {
        "object": "list",
        "data": [{"id": "in_1"}, {"id": "in_2"}],
        "first_id": "in_1",
        "last_id": "in_2",
        "has_more": True,
    }
    empty = paginate([], PageRequest())
    assert empty["data"] == [] and empty["first_id"] == empty["last_id"] == "" and empty["has_more"] is False


@given(st.integers(0, 60), st.integers(1, 100), st.sampled_from(["asc", "desc"]))
def test_following_last_id_visits_every_item_once_and_stops(count: int, limit: int, order: str) -> None:
    items = numbered(count)
    visited: list[str] = []
    after = None
    for _ in range(count + 2):
        page = paginate(items, PageRequest(limit=limit, order=order, after=after))  # type: ignore[arg-type]
        visited += [item["id"] for item in page["data"]]
        if not page["has_more"]:
            break
        assert page["data"], "has_more with an empty page would never end"
        after = page["last_id"]
    expected = [item["id"] for item in items]
    assert visited == (expected if order == "asc" else expected[::-1])


def test_an_unknown_after_is_refused() -> None:
    with pytest.raises(PageParameterError) as caught:
        paginate(numbered(2), PageRequest(after="in_9"))
    assert caught.value.param == "after"


def test_query_parameters_are_parsed_and_checked() -> None:
    assert parse_page_request(None, None, None) == PageRequest(DEFAULT_LIMIT, "desc", None)
    assert parse_page_request("1", "asc", "in_0") == PageRequest(1, "asc", "in_0")
    assert parse_page_request("100", "desc", "") == PageRequest(100, "desc", None)
    for limit, order, param in [
        ("0", None, "limit"),
        ("101", None, "limit"),
        ("ten", None, "limit"),
        ("５", None, "limit"),
        ("1_0", None, "limit"),
        (None, "up", "order"),
        (None, "ASC", "order"),
    ]:
        with pytest.raises(PageParameterError) as caught:
            parse_page_request(limit, order, None)
        assert caught.value.param == param


def test_a_duplicate_id_is_found_among_the_new_items_and_against_the_history() -> None:
    first, second = {"id": "msg_1"}, {"id": "msg_2"}
    assert duplicate_id([first, second], []) is None
    assert duplicate_id([first, {"id": "msg_1"}], []) == "msg_1"
    assert duplicate_id([second], [first, second]) == "msg_2"
    assert duplicate_id([first], [second]) is None


def test_a_compaction_item_is_listed_without_a_status() -> None:
    compaction = {"type": "compaction", "encrypted_content": "rq1_x", "status": "completed"}
    assert "status" not in normalise_item(compaction, "cmp_1")
    assert normalise_item({"type": "reasoning", "summary": []}, "rs_1")["status"] == "completed"


@pytest.mark.parametrize(
    ("arguments", "rendered_as_text"),
    [
        ('{"city": "Paris"}', False),
        ('{"emoji": "\\ud83d\\ude00"}', False),  # an escaped pair is one character
        ("[" * 5000 + "]" * 5000, True),  # nested past Python's recursion limit
        ('{"a": "\\ud800"}', True),  # an escaped lone surrogate: no UTF-8 prompt can hold it
        ("not json", True),
    ],
    ids=["object", "surrogate-pair", "deep", "lone-surrogate", "text"],
)
def test_a_calls_arguments_reach_the_template_as_a_value_or_as_the_text_sent(
    arguments: str, rendered_as_text: bool
) -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}
    output = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    messages = items_to_messages([{"role": "user", "content": "hi"}, call, output])
    (sent,) = [message for message in messages if message.get("tool_calls")]
    value = sent["tool_calls"][0]["function"]["arguments"]
    if rendered_as_text:
        assert value == arguments
    else:
        assert isinstance(value, dict)
        value_text = json.dumps(value, ensure_ascii=False)
        value_text.encode()  # renders into a UTF-8 prompt
