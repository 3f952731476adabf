"""Child processes that end with the process that started them."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


# Looked up here, not in the child: between fork and exec only the call itself is safe.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """``preexec_fn`` of a child: on Linux it gets SIGTERM when its parent dies, even by SIGKILL.

    ``resq up`` killed with ``kill -9`` left its workers, API and embedded Redis running, holding
    the ports the next ``make run`` needs. Elsewhere it does nothing.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
