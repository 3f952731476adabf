"""When ``resq up`` starts a role that died again, and when it gives up on it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RestartBackoff:
    """The restart policy of one role: Kubernetes' crash-loop back-off, with systemd's start limit.

    A role that dies is started again after a delay that doubles with each death in a row
    (``first_delay_s``, twice that, ... up to ``max_delay_s``), so that a role failing on a
    dependency does not spin. A run of ``stable_after_s`` before a death ends the row: an
    occasional crash gets the first delay again. ``max_quick_deaths`` deaths in a row, each
    less than ``quick_s`` after the process started, mean the role cannot start at all (a wrong
    setting, a port another process holds): :meth:`after_death` then says to give up. A role
    that dies later than that each time (a model that takes minutes to load, then fails) is not
    given up on; it is started again at most every ``max_delay_s``.
    """

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_after_s: float = 600.0
    quick_s: float = 60.0
    max_quick_deaths: int = 5
    deaths: int = 0
    """Deaths in a row, none after a run of ``stable_after_s``."""
    quick_deaths: int = 0
    """Deaths in a row, each less than ``quick_s`` after its process started."""

    def after_death(self, ran_for_s: float) -> float | None:
        """Seconds to wait before starting the role again; None when it cannot start at all."""
        if ran_for_s >= self.stable_after_s:
            self.deaths = 0
        self.deaths += 1
        self.quick_deaths = self.quick_deaths + 1 if ran_for_s < self.quick_s else 0
        if self.quick_deaths >= self.max_quick_deaths:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** (self.deaths - 1))
