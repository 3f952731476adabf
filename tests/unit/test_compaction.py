"""The summary request of a compaction (``api/compaction.py``): what it holds, and what it may."""

from __future__ import annotations

from api.compaction import COMPACTION_PROMPT, summary_of
from api.schemas import MAX_INPUT_ITEMS


def _message(text: str, item_id: str | None = None) -> dict[str, str]:
    message = {"type": "message", "role": "user", "content": text}
    return {**message, "id": item_id} if item_id is not None else message


def test_the_summary_request_is_the_history_then_its_prompt_unstored_and_truncated() -> None:
    request = summary_of("m", [_message("a"), _message("b")], "Be brief.", 64)
    texts = [item.model_dump()["content"] for item in request.input]  # type: ignore[union-attr]
    assert texts == ["a", "b", COMPACTION_PROMPT]
    assert (request.store, request.truncation, request.max_output_tokens) == (False, "auto", 64)


def test_a_history_of_the_most_items_a_client_may_send_still_fits_with_the_prompt() -> None:
    history = [_message(str(index)) for index in range(MAX_INPUT_ITEMS)]
    assert len(summary_of("m", history, None, 64).input) == MAX_INPUT_ITEMS + 1  # type: ignore[arg-type]


def test_an_id_the_stored_history_repeats_is_summarised_once() -> None:
    history = [_message("first", "msg_1"), _message("again", "msg_1"), _message("other", "msg_2")]
    request = summary_of("m", history, None, 64)
    texts = [item.model_dump()["content"] for item in request.input]  # type: ignore[union-attr]
    assert texts == ["first", "other", COMPACTION_PROMPT]
