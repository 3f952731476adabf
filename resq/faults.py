"""Faults at exact points: a process that ends itself at a named window, for the fault tests.

Off unless ``RESQ_FAULT_POINT`` names a point. A process that reaches the point it names
ends at once with :data:`FAULT_EXIT_CODE`, as a ``kill -9`` would end it there: no
``finally`` block, no shutdown handler, no buffered write runs. The windows are the ones
between two writes (or a write and the answer) that recovery must bridge:

- ``api.after_record``: the API recorded the response in one step (record, first events, staged
  job and both Celery messages) and has answered nothing;
- ``gpu.after_claim``: a GPU worker claimed a job and has published nothing for it;
- ``gpu.after_publish``: a GPU worker's publishing round trip landed and the worker has not
  counted it (it would send those tokens again);
- ``postprocess.after_final_record``: a post-processor stored the final Response and has not
  appended the terminal event;
- ``postprocess.after_conversation_append``: a post-processor appended a response's items to its
  conversation and has not appended the terminal event.

The mechanism is tested in ``tests/unit/test_fault_points.py``; the recovery from each point in
``tests/e2e/test_faults.py`` (its "faults at exact points" section).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal, get_args

log = logging.getLogger(__name__)

FaultPoint = Literal[
    "api.after_record",
    "gpu.after_claim",
    "gpu.after_publish",
    "postprocess.after_final_record",
    "postprocess.after_conversation_append",
]
FAULT_POINTS: tuple[str, ...] = get_args(FaultPoint)
FAULT_EXIT_CODE = 86
"""The exit status of a process ended at its fault point (tests tell it from a crash)."""


def prepare() -> None:
    """Read the fault point now, as the process starts.

    It is read from the settings on first use, and building them from the environment takes ~2 ms:
    that was the first request's (the API's recording step, a GPU worker's first claim, on the way
    to the first token) in every process started.
    """
    from resq.settings import get_settings  # settings import this module's names

    get_settings()


def reached(point: FaultPoint) -> None:
    """End this process at once when ``RESQ_FAULT_POINT`` names ``point``; nothing otherwise."""
    from resq.settings import get_settings  # settings import this module's names

    if get_settings().fault_point != point:
        return
    log.critical("fault point %s reached: ending the process (RESQ_FAULT_POINT)", point)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(FAULT_EXIT_CODE)
