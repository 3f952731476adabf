"""Child processes that end with the process that started them."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` of a child: on Linux it gets SIGTERM when its parent dies, even by SIGKILL.

    ``resq up`` killed with ``kill -9`` left its workers, API and embedded Redis running, holding
    the ports the next ``make run`` needs. Elsewhere it does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
