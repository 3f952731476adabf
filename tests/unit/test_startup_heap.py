"""What a process built to start leaves the collector's sight; what it makes later does not."""

from __future__ import annotations

import gc
import weakref

from resq.startup_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> _Node:
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return first


def test_the_startup_heap_is_frozen_its_garbage_freed_and_later_garbage_still_collected() -> None:
    try:
        kept = _cycle()
        startup_garbage = weakref.ref(_cycle())  # a cycle nothing holds: only the collector frees it
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        assert id(kept) not in {id(obj) for obj in gc.get_objects()}  # out of the collector's sight
        assert startup_garbage() is None  # collected first, not frozen for good
        later = _cycle()
        assert id(later) in {id(obj) for obj in gc.get_objects()}
        del later
        assert gc.collect() >= 2  # later cycles are still collected
        built_since = _cycle()
        freeze_startup_heap(collect=False)
        assert id(built_since) not in {id(obj) for obj in gc.get_objects()}
    finally:
        gc.unfreeze()
