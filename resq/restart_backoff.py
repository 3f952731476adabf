"""When ``resq up`` starts a role that died again, and when it gives up on it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RestartBackoff:
    """The restart policy of one role, like systemd's ``Restart=always`` with a start limit.

    A role that dies is started again after a delay that doubles with each death in a row
    (``first_delay_s``, then twice that, up to ``max_delay_s``), so that a role failing on a
    dependency (a GPU out of memory, a port taken) does not spin. A role that ran for
    ``stable_after_s`` before dying starts the count again: an occasional crash always gets
    the first delay. After ``max_quick_deaths`` deaths in a row, each before ``stable_after_s``,
    the role is deemed broken (its settings, its model) and :meth:`after_death` says to stop.
    """

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0
    max_quick_deaths: int = 5
    quick_deaths: int = 0
    """Deaths in a row of a process that ran less than ``stable_after_s``."""

    def after_death(self, ran_for_s: float) -> float | None:
        """Seconds to wait before starting the role again; None when it keeps dying at once."""
        if ran_for_s >= self.stable_after_s:
            self.quick_deaths = 0
            return self.first_delay_s
        self.quick_deaths += 1
        if self.quick_deaths >= self.max_quick_deaths:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** (self.quick_deaths - 1))
