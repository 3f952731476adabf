"""Native calls that recurse as deep as their input: run on a thread with a deep stack.

llguidance compiles a grammar recursively, in Rust, on the calling thread's stack, at 3 to 8
KB a level. A chain of 1,100 ``$ref``s in a 75 KB JSON schema, or of 3,000 rules in a Lark
grammar, overflowed the 8 MB stack of a Python thread, and the process (the API checking a
request, or the GPU worker compiling its matcher) died of SIGSEGV, where the grammar limit
(:data:`resq.grammars.MAX_GRAMMAR_CHARS`, 512 KB) admits chains of about 36,000 levels. A
native stack overflow cannot be caught; it can only be given room. :func:`on_deep_stack` runs
a call on a thread of its own whose stack is :data:`DEEP_STACK_BYTES`: address space reserved,
not memory. A compile touches the pages its depth needs (about 200 MB at 36,000 levels) and
they are given back when the thread ends. At most :data:`DEEP_STACK_THREADS` such calls run at
once, so that hostile grammars sent together cannot add their stacks up.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

DEEP_STACK_BYTES = 1 << 30
"""The stack of a deep call's thread: about 200,000 levels of llguidance's compiler."""
FALLBACK_STACK_BYTES = 256 << 20
"""Tried when the system refuses :data:`DEEP_STACK_BYTES` (a strict overcommit policy): about
50,000 levels, still more than the 36,000 a grammar within the limit can chain."""
DEEP_STACK_THREADS = 2
"""Deep calls at once; more wait their turn."""

_slots = threading.BoundedSemaphore(DEEP_STACK_THREADS)
_starting = threading.Lock()
"""``threading.stack_size`` is the whole process's setting: one thread is started with it at a time."""


def on_deep_stack(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``function(*args, **kwargs)`` on a new thread with a deep stack: its result, or its exception."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(function(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, whatever it is
            failure.append(exc)

    with _slots:
        thread = _start(run)
        thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


def _start(target: Callable[[], None]) -> threading.Thread:
    with _starting:
        previous = threading.stack_size()
        try:
            for size in (DEEP_STACK_BYTES, FALLBACK_STACK_BYTES):
                threading.stack_size(size)
                thread = threading.Thread(target=target, name="resq-deep-stack", daemon=True)
                try:
                    thread.start()
                except RuntimeError:
                    log.warning("could not start a thread with a %d MB stack", size >> 20)
                    continue
                return thread
        finally:
            threading.stack_size(previous)
    raise RuntimeError("no thread with a deep stack could be started (the system refused the memory)")
