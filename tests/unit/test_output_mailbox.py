"""The engine's output mailbox: the latest output per request; a wake-up only for what goes out now."""

from __future__ import annotations

import threading
import time

from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from gpu_worker.output_mailbox import OutputMailbox

LATER = 3600.0
"""A round due in an hour: nothing but first tokens and ends may wake the reader."""


def decoding(request_id: str, tokens: list[int]) -> GenerationOutput:
    return GenerationOutput(request_id, generated_tokens=tokens, status=RequestStatus.DECODING)


def finished(request_id: str, tokens: list[int]) -> GenerationOutput:
    return GenerationOutput(request_id, generated_tokens=tokens, status=RequestStatus.FINISHED)


def timed_take(
    mailbox: OutputMailbox, timeout_s: float, quiet_for_s: float
) -> tuple[list[GenerationOutput], float]:
    started = time.monotonic()
    outputs = mailbox.take(timeout_s, quiet_until=started + quiet_for_s)
    return outputs, time.monotonic() - started


def put_later(mailbox: OutputMailbox, delay_s: float, output: GenerationOutput) -> threading.Timer:
    timer = threading.Timer(delay_s, lambda: mailbox.put(output))
    timer.start()
    return timer


def test_later_tokens_wait_unseen_before_the_round_and_only_the_latest_output_is_kept() -> None:
    mailbox = OutputMailbox()
    timer = put_later(mailbox, 0.05, decoding("a", [1, 2]))
    mailbox.put(decoding("a", [1]))  # left before the reader waits: a first token, but no wait yet
    outputs, waited = timed_take(mailbox, 5, LATER)
    assert waited < 1 and outputs[0].generated_tokens == [1]
    timer.join()
    mailbox.put(decoding("a", [1, 2, 3]))
    outputs, waited = timed_take(mailbox, 0.2, LATER)
    assert waited >= 0.19  # nothing woke the reader
    assert [(output.request_id, output.generated_tokens) for output in outputs] == [("a", [1, 2, 3])]
    assert timed_take(mailbox, 0.01, LATER)[0] == []


def test_a_first_token_wakes_the_reader_with_every_other_request_s_latest_output() -> None:
    mailbox = OutputMailbox()
    mailbox.put(decoding("a", [1, 2, 3]))
    mailbox.put(decoding("b", []))  # still prefilling: nothing to send yet
    timer = put_later(mailbox, 0.1, decoding("b", [7]))
    mailbox.put(decoding("a", [1, 2, 3, 4]))
    outputs, waited = timed_take(mailbox, 5, LATER)
    timer.join()
    assert 0.09 <= waited < 1
    assert {output.request_id: output.generated_tokens for output in outputs} == {"a": [1, 2, 3, 4], "b": [7]}


def test_an_end_wakes_the_reader() -> None:
    mailbox = OutputMailbox()
    timer = put_later(mailbox, 0.05, finished("a", [1, 2, 9]))
    outputs, waited = timed_take(mailbox, 5, LATER)
    timer.join()
    assert waited < 1 and outputs[0].is_finished()


def test_once_the_round_is_due_any_output_wakes_the_reader() -> None:
    """A step slower than the stream interval: its tokens go out as they come."""
    mailbox = OutputMailbox()
    timer = put_later(mailbox, 0.15, decoding("a", [1, 2, 3]))
    outputs, waited = timed_take(mailbox, 5, quiet_for_s=0.05)
    timer.join()
    assert 0.14 <= waited < 1 and outputs[0].generated_tokens == [1, 2, 3]
    mailbox.put(decoding("a", [1, 2, 3, 4]))  # left while the round was already due: no wait at all
    outputs, waited = timed_take(mailbox, 5, quiet_for_s=-1)
    assert waited < 0.5 and outputs[0].generated_tokens == [1, 2, 3, 4]


def test_a_reader_that_names_no_round_is_woken_by_every_output() -> None:
    mailbox = OutputMailbox()
    timer = put_later(mailbox, 0.05, decoding("a", [1, 2, 3]))
    outputs = mailbox.take(5)
    timer.join()
    assert outputs[0].generated_tokens == [1, 2, 3]
