"""encrypted_content: round trip, determinism, and refusal of altered, foreign or replayed blobs."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from api.errors import OpenAIError
from api.prompting import opened_for_prompt, opened_history
from resq.conversation import items_to_messages
from resq.sealed import PREFIX, REASONING, Sealer, SealError, sealer_from_settings
from resq.settings import load_settings

OWNER = "owner-a"
TEXT = "Two plus two equals four.\n"


def test_round_trip_gives_the_text_back_exactly() -> None:
    sealer = Sealer(b"k1")
    for text in (TEXT, "", "ünïcödé ✓ \u0000 <think>", "x" * 100_000):
        blob = sealer.seal(REASONING, OWNER, text)
        assert blob.startswith(PREFIX)
        assert sealer.open(REASONING, OWNER, blob) == text


def test_the_blob_does_not_carry_the_text_in_the_clear() -> None:
    blob = Sealer(b"k1").seal(REASONING, OWNER, TEXT)
    raw = base64.urlsafe_b64decode(blob[len(PREFIX) :] + "==")
    assert b"plus" not in raw and "plus" not in blob


def test_sealing_is_deterministic_so_a_rerun_post_processor_rebuilds_the_same_bytes() -> None:
    sealer = Sealer(b"k1")
    assert sealer.seal(REASONING, OWNER, TEXT) == Sealer(b"k1").seal(REASONING, OWNER, TEXT)
    # A different text or owner gives a different nonce, never the same one.
    assert sealer.seal(REASONING, OWNER, TEXT)[:20] != sealer.seal(REASONING, OWNER, TEXT + ".")[:20]
    assert sealer.seal(REASONING, OWNER, TEXT)[:20] != sealer.seal(REASONING, "owner-b", TEXT)[:20]


def _flip(blob: str, position: int) -> str:
    raw = bytearray(base64.urlsafe_b64decode(blob[len(PREFIX) :] + "=="))
    raw[position] ^= 0x01
    return PREFIX + base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()


@pytest.mark.parametrize("position", [0, 11, 12, 20, -1])
def test_one_flipped_bit_anywhere_is_refused(position: int) -> None:
    sealer = Sealer(b"k1")
    blob = sealer.seal(REASONING, OWNER, TEXT)
    with pytest.raises(SealError):
        sealer.open(REASONING, OWNER, _flip(blob, position))


def test_another_servers_key_another_owner_or_another_purpose_is_refused() -> None:
    blob = Sealer(b"k1").seal(REASONING, OWNER, TEXT)
    with pytest.raises(SealError):
        Sealer(b"k2").open(REASONING, OWNER, blob)
    with pytest.raises(SealError):
        Sealer(b"k1").open(REASONING, "owner-b", blob)
    with pytest.raises(SealError):
        Sealer(b"k1").open("compaction", OWNER, blob)


@pytest.mark.parametrize(
    "blob", ["", "rq1_", "rq1_!!!", "rq1_AAAA", "gAAAAABo-openai-style", PREFIX + "A" * 40]
)
def test_garbage_is_refused_not_crashed_on(blob: str) -> None:
    with pytest.raises(SealError):
        Sealer(b"k1").open(REASONING, OWNER, blob)


def test_the_content_secret_wins_over_the_owner_secret_and_both_change_the_key() -> None:
    default = sealer_from_settings(load_settings())
    owner_only = sealer_from_settings(load_settings(owner_secret="o"))
    content = sealer_from_settings(load_settings(owner_secret="o", content_secret="c"))
    blob = content.seal(REASONING, OWNER, TEXT)
    assert Sealer(b"c").open(REASONING, OWNER, blob) == TEXT
    for other in (default, owner_only):
        with pytest.raises(SealError):
            other.open(REASONING, OWNER, blob)
    assert Sealer(b"o").open(REASONING, OWNER, owner_only.seal(REASONING, OWNER, TEXT)) == TEXT


def _sealed_reasoning(sealer: Sealer) -> dict[str, Any]:
    """A reasoning item as Codex sends it back: its blob only, no text."""
    return {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "encrypted_content": sealer.seal(REASONING, OWNER, TEXT),
    }


def test_a_sealed_reasoning_item_is_opened_for_the_prompt_only() -> None:
    """Stored as sent (the blob), the reasoning reaches the chat template as the model wrote it."""
    sealer = Sealer(b"k1")
    sent = _sealed_reasoning(sealer)
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4."}]}
    items = [{"type": "message", "role": "user", "content": "2+2?"}, sent, answer]
    opened = opened_for_prompt(items, sealer, OWNER)
    assert items[1] == sent  # the caller's (stored) items are left as they are
    assert opened[1]["content"] == [{"type": "reasoning_text", "text": TEXT}]
    (assistant,) = [message for message in items_to_messages(opened) if message["role"] == "assistant"]
    assert assistant["reasoning_content"] == TEXT
    with pytest.raises(OpenAIError) as refused:
        opened_for_prompt(items, Sealer(b"k2"), OWNER)
    assert refused.value.param == "input[1].encrypted_content"


def test_stored_history_is_opened_where_sealed_and_never_refused() -> None:
    """History is the store's, not the client's to resend: a blob that no longer opens (the
    secret changed) leaves the reasoning out instead of making every continuation a 400, and an
    item stored with its text (a response's own output) is not opened at all."""
    sealer = Sealer(b"k1")
    sealed = _sealed_reasoning(sealer)
    with_text = {
        **sealed,
        "id": "rs_2",
        "encrypted_content": "not a blob",
        "content": [{"type": "reasoning_text", "text": "kept"}],
    }
    opened = opened_history([sealed, with_text], sealer, OWNER)
    assert opened[0]["content"] == [{"type": "reasoning_text", "text": TEXT}]
    assert opened[1] == with_text
    assert opened_history([sealed], Sealer(b"k2"), OWNER) == [sealed]
