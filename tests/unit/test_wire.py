"""Token-stream entries survive their Redis encoding, including the fields older readers lack."""

from __future__ import annotations

import pytest

from gpu_worker.engine import GRAMMAR_FAILED_ERROR, NON_FINITE_ERROR, failure_code
from resq.wire import FinishEntry, TokensEntry, TokenStreamEntry, decode_entry, encode_entry


def round_trip(entry: TokenStreamEntry) -> TokenStreamEntry:
    fields = encode_entry(entry)
    # As redis-py reads them back: every key and value as bytes.
    return decode_entry(
        {
            key.encode(): value if isinstance(value, bytes) else str(value).encode()
            for key, value in fields.items()
        }
    )


@pytest.mark.parametrize(
    "entry",
    [
        TokensEntry([1, 2, 3], [-0.5, -1.0, -2.0], start=4),
        TokensEntry(
            [1, 2], [-0.5, -1.0], start=0, top_logprobs=[[(1, -0.5), (7, -1.5)], [(9, -0.25), (2, -1.0)]]
        ),
        FinishEntry("stop", 12, 3, cached_tokens=8),
        FinishEntry("error", 12, 3, "boom"),
        FinishEntry("error", 12, 3, GRAMMAR_FAILED_ERROR, error_code="invalid_prompt"),
    ],
)
def test_entries_round_trip(entry: TokenStreamEntry) -> None:
    assert round_trip(entry) == entry


def test_a_server_fault_carries_no_code_field_and_an_unknown_code_reads_as_one() -> None:
    """Entries of GPU workers older (or newer) than a code keep their meaning: the server's fault."""
    assert "error_code" not in encode_entry(FinishEntry("error", 1, 0, "boom"))
    fields = {b"type": b"finish", b"finish_reason": b"error", b"prompt_tokens": b"1", b"output_tokens": b"0"}
    assert isinstance(entry := decode_entry({**fields, b"error_code": b"novel"}), FinishEntry)
    assert entry.error_code == "server_error"


def test_only_a_grammar_the_decoder_could_not_follow_is_the_requests_fault() -> None:
    assert failure_code(GRAMMAR_FAILED_ERROR) == "invalid_prompt"
    assert failure_code(NON_FINITE_ERROR) == "server_error"
    assert failure_code(None) == "server_error"
