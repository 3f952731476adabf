"""A stopping GPU worker releases its requests once, however many sides ask."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

from gpu_worker.publisher import TokenPublisher
from gpu_worker.shutdown import WorkRelease


class FakePublisher:
    """Counts what the release does; ``active_count`` drops when the test says so."""

    def __init__(self, active: int) -> None:
        self.active_count = active
        self.stops = 0
        self.hand_backs: list[Callable[[str], None]] = []
        self.lock = threading.Lock()

    def stop(self) -> None:
        with self.lock:
            self.stops += 1

    def hand_back_remaining(self, dispatch: Callable[[str], None]) -> None:
        with self.lock:
            self.hand_backs.append(dispatch)


def release_for(publisher: FakePublisher, grace_s: float) -> WorkRelease:
    return WorkRelease(cast(TokenPublisher, publisher), grace_s, dispatch=lambda _: None)


def test_begin_then_finish_releases_once() -> None:
    publisher = FakePublisher(active=0)
    release = release_for(publisher, grace_s=5)
    release.begin()
    release.begin()
    release.finish()
    assert publisher.stops == 1 and len(publisher.hand_backs) == 1


def test_the_grace_period_ends_when_the_requests_do() -> None:
    publisher = FakePublisher(active=2)
    release = release_for(publisher, grace_s=30)
    release.begin()
    time.sleep(0.3)
    assert publisher.stops == 0, "stopped publishing while requests were still finishing"
    publisher.active_count = 0
    started = time.monotonic()
    release.finish()
    assert time.monotonic() - started < 5
    assert publisher.stops == 1 and len(publisher.hand_backs) == 1


def test_no_grace_hands_back_at_once() -> None:
    publisher: Any = FakePublisher(active=3)
    release = release_for(publisher, grace_s=0)
    started = time.monotonic()
    release.finish()
    assert time.monotonic() - started < 1
    assert publisher.stops == 1 and len(publisher.hand_backs) == 1


def test_a_second_signal_during_begin_does_not_deadlock(monkeypatch: Any) -> None:
    """Ctrl-C reaches the whole process group, then `resq up` sends SIGTERM: Celery's handler
    runs begin() again on the main thread while the first begin() is still in Thread.start."""
    publisher = FakePublisher(active=0)
    release = release_for(publisher, grace_s=0)
    start = threading.Thread.start

    def start_interrupted(thread: threading.Thread) -> None:
        release.begin()  # the second signal's handler, run where the first begin() waits
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_interrupted)
    done = threading.Event()

    def first_signal() -> None:
        release.begin()
        done.set()

    caller = threading.Thread(target=first_signal, daemon=True)
    start(caller)
    assert done.wait(5), "begin() deadlocked when a second signal called it again"
    monkeypatch.undo()
    release.finish()
    assert publisher.stops == 1 and len(publisher.hand_backs) == 1
