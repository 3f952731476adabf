"""``resq up``'s restart policy: doubling delays for quick deaths, a fresh count after a long run,
and a stop for a role that keeps dying at once."""

from __future__ import annotations

from resq.restart_backoff import RestartBackoff


def test_quick_deaths_double_the_delay_up_to_the_cap_then_give_up() -> None:
    backoff = RestartBackoff(first_delay_s=1, max_delay_s=5, stable_after_s=60, max_quick_deaths=5)
    assert [backoff.after_death(2) for _ in range(4)] == [1, 2, 4, 5]
    assert backoff.after_death(2) is None


def test_a_long_run_starts_the_count_again() -> None:
    backoff = RestartBackoff(first_delay_s=1, max_delay_s=30, stable_after_s=60, max_quick_deaths=3)
    assert backoff.after_death(1) == 1
    assert backoff.after_death(1) == 2
    # It ran a while before this death: an occasional crash, not a broken role.
    assert backoff.after_death(61) == 1
    assert backoff.quick_deaths == 0
    assert backoff.after_death(1) == 1
    assert backoff.after_death(1) == 2
    assert backoff.after_death(1) is None
