"""``resq up``'s restart policy: doubling delays for deaths in a row, a fresh row after a long run,
a stop for a role that cannot start, and no stop (but no spin) for one that dies late each time."""

from __future__ import annotations

from resq.restart_backoff import RestartBackoff


def test_quick_deaths_double_the_delay_up_to_the_cap_then_give_up() -> None:
    backoff = RestartBackoff(first_delay_s=1, max_delay_s=5, quick_s=60, max_quick_deaths=5)
    assert [backoff.after_death(2) for _ in range(4)] == [1, 2, 4, 5]
    assert backoff.after_death(2) is None


def test_a_long_run_starts_the_row_again_and_the_next_deaths_double_from_the_first_delay() -> None:
    backoff = RestartBackoff(first_delay_s=1, max_delay_s=30, stable_after_s=600, quick_s=60)
    assert [backoff.after_death(1), backoff.after_death(1)] == [1, 2]
    # It ran ten minutes before this death: an occasional crash, not a broken role.
    assert backoff.after_death(601) == 1
    assert [backoff.after_death(1), backoff.after_death(1)] == [2, 4]


def test_a_role_that_dies_late_each_time_is_never_given_up_on_but_never_spins() -> None:
    """A GPU worker whose model takes minutes to load and then fails: no give-up (a quick death
    is one before ``quick_s``), and the delay grows to the cap instead of staying at 1 s."""
    backoff = RestartBackoff(first_delay_s=1, max_delay_s=30, stable_after_s=600, quick_s=60)
    delays = [backoff.after_death(63) for _ in range(20)]
    assert None not in delays
    assert delays[:6] == [1, 2, 4, 8, 16, 30] and set(delays[6:]) == {30}


def test_a_late_death_ends_a_row_of_quick_ones() -> None:
    backoff = RestartBackoff(quick_s=60, max_quick_deaths=3)
    backoff.after_death(1)
    backoff.after_death(1)
    backoff.after_death(90)  # it got going this time
    assert backoff.after_death(1) is not None
    assert backoff.after_death(1) is not None
    assert backoff.after_death(1) is None
