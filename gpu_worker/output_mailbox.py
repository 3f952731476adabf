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
says everything before it) and wakes the reader for what goes out at once, a request's
first tokens and its end, and for any output once the reader's next round is due (a step
slower than the stream interval: its tokens go out as they come). Until then the other
outputs wait unseen. A reader that names no round (``quiet_until`` 0) is woken by every
output, as the queue woke it.
"""

from __future__ import annotations

import threading
import time

from transformers.generation.continuous_batching.requests import GenerationOutput


class OutputMailbox:
    """The latest output of every request since the last :meth:`take`, and a wake-up when one must go out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._latest: dict[str, GenerationOutput] = {}
        self._urgent = False
        """A first token or an end is among ``_latest``."""
        self._quiet_until = 0.0

    def put(self, output: GenerationOutput) -> None:
        """Leave ``output`` (called by the engine thread, for every request of every step)."""
        with self._lock:
            self._latest[output.request_id] = output
            # A step adds one token per request: one token is the request's first. (Were a first
            # output ever to carry more, it would wait for the round: later, never lost.)
            if output.is_finished() or len(output.generated_tokens) == 1:
                self._urgent = True
                self._wake.set()
            elif time.monotonic() >= self._quiet_until:
                self._wake.set()

    def take(self, timeout_s: float, quiet_until: float = 0.0) -> list[GenerationOutput]:
        """Every output left since the last call, once one must go out or ``timeout_s`` passed.

        ``quiet_until`` (``time.monotonic()``): before it, only a first token or an end wakes
        the reader; from it on, any output does.
        """
        with self._lock:
            # What was left while the reader was away is judged by this wait's round, not the last.
            self._quiet_until = quiet_until
            if self._urgent or (self._latest and time.monotonic() >= quiet_until):
                self._wake.set()
            else:
                self._wake.clear()
        self._wake.wait(timeout_s)
        with self._lock:
            outputs = list(self._latest.values())
            self._latest = {}
            self._urgent = False
            self._wake.clear()
        return outputs
