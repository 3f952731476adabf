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
