"""Where the engine thread leaves its outputs for the publisher, waking it only when it must.

transformers' continuous batching hands every request's output of every step to a
``queue.Queue`` (``OutputRouter.output_queue``): a lock and a condition per output, and
the reader woken at every step. The publisher sends most tokens once per stream interval
(:mod:`gpu_worker.publisher`), so a wake-up per step only moved the step's outputs into a
dict and went back to sleep; in one process with the engine thread that took the GIL from
it and cost two thread switches per step (on the bench's tiny model at 32 requests, ~230
steps a second against 20 rounds).

:class:`OutputMailbox` stands in for that queue (transformers only ever calls its
``put``): it keeps the latest output of each request (outputs are cumulative: the last one
says everything before it) and wakes the reader only for what goes out at once, a
request's first tokens and its end. The reader waits for the rest until its round is due.
With ``wake_for_every_output`` (a stream interval of 0: every step's tokens go out with
it) every output wakes the reader, as the queue did.
"""

from __future__ import annotations

import threading

from transformers.generation.continuous_batching.requests import GenerationOutput


class OutputMailbox:
    """The latest output of every request since the last :meth:`take`, and a wake-up for urgent ones."""

    def __init__(self, wake_for_every_output: bool) -> None:
        self._wake_for_every_output = wake_for_every_output
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._latest: dict[str, GenerationOutput] = {}

    def put(self, output: GenerationOutput) -> None:
        """Leave ``output`` (called by the engine thread, for every request of every step)."""
        with self._lock:
            self._latest[output.request_id] = output
            # A step adds one token per request: one token is the request's first. (Were a first
            # output ever to carry more, it would wait for the next round: later, never lost.)
            if self._wake_for_every_output or output.is_finished() or len(output.generated_tokens) == 1:
                self._wake.set()

    def take(self, timeout_s: float) -> list[GenerationOutput]:
        """Every output left since the last call, once one must go out or ``timeout_s`` passed."""
        self._wake.wait(timeout_s)
        with self._lock:
            outputs = list(self._latest.values())
            self._latest = {}
            self._wake.clear()
        return outputs
