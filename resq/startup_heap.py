"""Keep the garbage collector off what a process built to start: its modules, model and caches.

CPython's collector scans every tracked object of a generation it collects, and its oldest
generation holds everything a process loaded to start: ~100,000 objects in the API or a
post-process worker (FastAPI, pydantic's validators, Celery, kombu), ~400,000 in a GPU worker
(torch, transformers, the model). A full collection, which comes whenever enough objects outlive
their youth, then stops every thread of the process for that long: 50-60 ms in the API,
55-115 ms in a post-process worker in the middle of a load, 190-330 ms in a GPU worker on a 2-core
machine (``docs/benchmarks.md``, "2026-12-07, night"): every stream the process serves stalls.
None of those objects ever becomes garbage, so once a process has started they go to the
collector's permanent generation (:func:`gc.freeze`), which it never scans, as vLLM and
``transformers serve`` do; later collections scan only what the process made since.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(collect: bool = True) -> None:
    """Move every object alive now out of the collector's sight (:func:`gc.freeze`).

    ``collect``: collect first, so that startup garbage is freed rather than kept for good (one
    full collection's pause, before the process serves anything); without it, what was built
    since an earlier call is frozen too, at no pause (a warm-up's tokenizers, Celery's consumer).
    """
    started = time.perf_counter()
    if collect:
        gc.collect()
    gc.freeze()
    log.debug(
        "froze %d startup objects in %.1f ms", gc.get_freeze_count(), (time.perf_counter() - started) * 1000
    )
