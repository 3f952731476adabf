"""The engine's output mailbox: the latest output per request, a wake-up only for what goes out at once."""

from __future__ import annotations

import threading
import time

from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from gpu_worker.output_mailbox import OutputMailbox


def decoding(request_id: str, tokens: list[int]) -> GenerationOutput:
    return GenerationOutput(request_id, generated_tokens=tokens, status=RequestStatus.DECODING)


def finished(request_id: str, tokens: list[int]) -> GenerationOutput:
    return GenerationOutput(request_id, generated_tokens=tokens, status=RequestStatus.FINISHED)


def timed_take(mailbox: OutputMailbox, timeout_s: float) -> tuple[list[GenerationOutput], float]:
    started = time.monotonic()
    outputs = mailbox.take(timeout_s)
    return outputs, time.monotonic() - started


def test_later_tokens_wait_unseen_until_the_timeout_and_only_the_latest_output_is_kept() -> None:
    mailbox = OutputMailbox(wake_for_every_output=False)
    mailbox.put(decoding("a", [1, 2]))
    mailbox.put(decoding("a", [1, 2, 3]))
    outputs, waited = timed_take(mailbox, 0.2)
    assert waited >= 0.19  # nothing woke the reader
    assert [(output.request_id, output.generated_tokens) for output in outputs] == [("a", [1, 2, 3])]
    assert timed_take(mailbox, 0.01)[0] == []


def test_a_first_token_wakes_the_reader_with_every_other_request_s_latest_output() -> None:
    mailbox = OutputMailbox(wake_for_every_output=False)
    mailbox.put(decoding("a", [1, 2, 3]))
    mailbox.put(decoding("b", []))  # still prefilling: nothing to send yet
    outputs, waited = timed_take(mailbox, 0.1)
    assert waited >= 0.09
    mailbox.put(decoding("a", [1, 2, 3, 4]))
    mailbox.put(decoding("b", [7]))
    outputs, waited = timed_take(mailbox, 5)
    assert waited < 1
    assert {output.request_id: output.generated_tokens for output in outputs} == {"a": [1, 2, 3, 4], "b": [7]}


def test_an_end_wakes_the_reader() -> None:
    mailbox = OutputMailbox(wake_for_every_output=False)
    mailbox.put(finished("a", [1, 2, 9]))
    outputs, waited = timed_take(mailbox, 5)
    assert waited < 1 and outputs[0].is_finished()


def test_a_put_from_another_thread_wakes_a_waiting_reader() -> None:
    mailbox = OutputMailbox(wake_for_every_output=False)
    timer = threading.Timer(0.05, lambda: mailbox.put(decoding("a", [5])))
    timer.start()
    outputs, waited = timed_take(mailbox, 5)
    timer.join()
    assert waited < 1 and outputs[0].generated_tokens == [5]


def test_without_a_stream_interval_every_output_wakes_the_reader() -> None:
    mailbox = OutputMailbox(wake_for_every_output=True)
    mailbox.put(decoding("a", [1, 2, 3]))
    outputs, waited = timed_take(mailbox, 5)
    assert waited < 1 and outputs[0].generated_tokens == [1, 2, 3]
