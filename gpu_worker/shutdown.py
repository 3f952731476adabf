"""What a stopping GPU worker does with the requests in its engine, once.

It lets them finish for ``RESQ_SHUTDOWN_GRACE_S``, stops publishing, and hands what
is left back for another GPU worker to resume from the tokens already published.
This starts as soon as Celery's warm shutdown begins (``worker_shutting_down``),
not when it ends: Celery's consumer takes up to a broker poll (about a second) to
stop, and a worker with no grace period would otherwise go on generating, and
often finish, requests it was asked to give up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpu_worker.publisher import TokenPublisher

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1


class WorkRelease:
    """Drain, stop publishing, hand back: started at most once, from whichever side comes first."""

    def __init__(self, publisher: TokenPublisher, grace_s: float, dispatch: Callable[[str], None]) -> None:
        self._publisher = publisher
        self._grace_s = grace_s
        self._dispatch = dispatch
        self._thread: threading.Thread | None = None
        # Re-entrant: a second stop signal (Ctrl-C reaches the whole process group, then `resq up`
        # sends its SIGTERM) runs Celery's handler, and so begin(), on the main thread while the
        # first begin() still holds the lock there (in Thread.start); a plain lock deadlocked.
        self._lock = threading.RLock()

    def begin(self) -> None:
        """Start releasing the engine's requests in the background (idempotent)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._release, name="work-release", daemon=True)
                self._thread.start()

    def finish(self) -> None:
        """Release the engine's requests (started here if not yet) and wait until it is done."""
        self.begin()
        assert self._thread is not None
        self._thread.join()

    def _release(self) -> None:
        publisher = self._publisher
        deadline = time.monotonic() + self._grace_s
        if publisher.active_count:
            log.info("waiting up to %.0fs for %d requests to finish", self._grace_s, publisher.active_count)
        while publisher.active_count and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        publisher.stop()
        # What did not finish in the grace period resumes on another GPU worker (or on this
        # one when it comes back), from the tokens already published: no need to finish it here.
        publisher.hand_back_remaining(self._dispatch)
