"""The Celery worker flags both worker roles pass."""

from __future__ import annotations

from resq.celery_app import worker_options
from resq.settings import Settings


def test_workers_send_no_celery_heartbeats_unless_events_are_on() -> None:
    quiet = worker_options(Settings(celery_events=False))
    assert "--without-heartbeat" in quiet
    assert {"--without-gossip", "--without-mingle"} <= set(quiet)
    # Flower shows workers by their heartbeat events: with events on, they are sent.
    watched = worker_options(Settings(celery_events=True))
    assert "--without-heartbeat" not in watched
    assert {"--without-gossip", "--without-mingle"} <= set(watched)
