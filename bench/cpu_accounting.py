"""B7: CPU seconds a serving system spends around its engine, per streamed token.

A system is a set of processes (resq: its GPU worker, post-process workers, API and
Redis; ``transformers serve``: its server process and, since transformers 5.25, the model
process it spawns, read as the server's children). Their CPU is read per thread, before and
after a run: from the scheduler's own count in nanoseconds (``/proc/<pid>/task/<tid>/schedstat``)
where Linux has it, else ``psutil``'s user and system times, which Linux gives in 10 ms clock
ticks, each thread's reading cut down to a whole tick (over the ~100 threads of a resq stack
that blurred a round's figure by several microseconds per token); the threads that run transformers' generation loop
(``ContinuousBatchingManager._run_generation_loop``: the forward step, the scheduler
and the sampling of every batch) are the engine and are counted apart. What is left
is what the server costs on top of the model: HTTP, JSON, detokenising, queues,
Redis, publishing. Each engine runs on one torch thread (``bench/systems.py``), so
the engine's work stays in that one thread.

The engine threads are found by name with ``py-spy dump`` (Python names its threads
after their target: ``Thread-3 (_run_generation_loop)``), which needs ptrace rights on
the process (root, or ``kernel.yama.ptrace_scope`` 0); without them the figure is not
measured rather than guessed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

ENGINE_LOOP = "_run_generation_loop"
"""The function transformers' continuous batching runs its generation thread on."""
PY_SPY_TIMEOUT_S = 30.0


class EngineThreadNotFoundError(RuntimeError):
    """No generation-loop thread could be named in a process that should have one."""


class PySpyUnavailableError(EngineThreadNotFoundError):
    """py-spy is missing or may not read the process (no ptrace rights)."""


def py_spy_path() -> str | None:
    """py-spy next to this interpreter (an unactivated virtualenv) or on ``PATH``."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def engine_threads(pid: int) -> frozenset[int]:
    """OS thread ids of the generation-loop threads of process ``pid`` (from ``py-spy dump --json``)."""
    py_spy = py_spy_path()
    if py_spy is None:
        raise PySpyUnavailableError("py-spy is not installed (the bench extra installs it)")
    try:
        dumped = subprocess.run(
            [py_spy, "dump", "--json", "--pid", str(pid)],
            capture_output=True,
            text=True,
            check=True,
            timeout=PY_SPY_TIMEOUT_S,
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise PySpyUnavailableError(f"py-spy dump of {pid} failed: {error}") from error
    found = frozenset(
        int(thread["os_thread_id"])
        for thread in json.loads(dumped)
        if thread.get("os_thread_id") is not None
        and (
            ENGINE_LOOP in str(thread.get("thread_name", ""))
            or any(frame.get("name") == ENGINE_LOOP for frame in thread.get("frames", []))
        )
    )
    if not found:
        raise EngineThreadNotFoundError(f"process {pid} runs no {ENGINE_LOOP} thread")
    return found


ThreadTimes = dict[tuple[int, int], float]
"""CPU seconds (user + system) per ``(pid, os thread id)``."""


def schedstat_seconds(pid: int, tid: int) -> float | None:
    """CPU seconds thread ``tid`` of process ``pid`` has run, to the nanosecond (the first field
    of its ``schedstat``); None when the file cannot be read (no such thread, or no schedstat)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as stat:
            return int(stat.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _has_schedstat() -> bool:
    """Whether this kernel counts thread CPU in ``schedstat`` (Linux with ``CONFIG_SCHED_INFO``)."""
    return schedstat_seconds(os.getpid(), threading.get_native_id()) is not None


SCHEDSTAT = _has_schedstat()
"""Read thread CPU from ``schedstat``; else from ``psutil`` (whole 10 ms ticks on Linux)."""


def thread_times(pids: Sequence[int], precise: bool = SCHEDSTAT) -> ThreadTimes:
    """CPU seconds of every thread of ``pids`` and of their child processes, now.

    ``precise``: from ``schedstat`` (see the module); a thread that ended between the listing and
    its reading is left out, as one that ended before the listing is.
    """
    times: ThreadTimes = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            family = [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in family:
            try:
                threads = member.threads()
            except psutil.NoSuchProcess:
                continue
            for thread in threads:
                if not precise:
                    times[(member.pid, thread.id)] = thread.user_time + thread.system_time
                elif (seconds := schedstat_seconds(member.pid, thread.id)) is not None:
                    times[(member.pid, thread.id)] = seconds
    return times


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds of a run: the engine threads, and everything else by process label."""

    engine_s: float
    server_s_by_label: dict[str, float]

    @property
    def server_s(self) -> float:
        """Everything outside the engine threads."""
        return sum(self.server_s_by_label.values())

    def per_token(self, streamed: int) -> dict[str, float]:
        """The metrics B7 records for a run that streamed ``streamed`` tokens (us per token):
        outside the engine, the engine, and outside the engine by process label."""
        streamed = max(1, streamed)
        return {
            "server_cpu_us_per_token": self.server_s * 1e6 / streamed,
            "engine_cpu_us_per_token": self.engine_s * 1e6 / streamed,
            **{
                f"server_cpu_us_per_token:{label}": seconds * 1e6 / streamed
                for label, seconds in self.server_s_by_label.items()
            },
        }


def split(
    before: ThreadTimes,
    after: ThreadTimes,
    engine: set[tuple[int, int]],
    labels: dict[int, str] | None = None,
) -> CpuSplit:
    """The CPU spent between two :func:`thread_times` readings, engine threads apart.

    ``labels`` names processes (a child counts as ``other`` unless named). A thread born
    during the run counts from 0; one that ended during the run is lost (psutil cannot
    read a dead thread), which only ever undercounts.
    """
    engine_s = 0.0
    by_label: dict[str, float] = {}
    for key, seconds in after.items():
        spent = max(0.0, seconds - before.get(key, 0.0))
        if key in engine:
            engine_s += spent
        else:
            label = (labels or {}).get(key[0], "other")
            by_label[label] = by_label.get(label, 0.0) + spent
    return CpuSplit(engine_s, by_label)


@dataclass
class CpuMeter:
    """Measures one system: its processes (labelled), and those of them that run an engine thread."""

    labels: dict[int, str]
    """Every process to read, by pid, with the role it plays (``api``, ``redis``...)."""
    engine_pids: list[int]

    @property
    def pids(self) -> list[int]:
        """Every process to read."""
        return list(self.labels)

    def engine_keys(self) -> set[tuple[int, int]]:
        """``(pid, thread id)`` of every engine thread, looked up now (raises when one is missing)."""
        return {key for pid in self.engine_pids for key in engine_thread_keys(pid)}


def engine_thread_keys(pid: int) -> frozenset[tuple[int, int]]:
    """``(pid, thread id)`` of the generation-loop threads of process ``pid``, or of its first
    descendant that runs one (``transformers serve`` >= 5.25 runs its model in a spawned process).

    Raises :class:`PySpyUnavailableError` when ``pid`` cannot be read, and ``pid``'s own
    :class:`EngineThreadNotFoundError` when no descendant runs one either.
    """
    try:
        return frozenset((pid, tid) for tid in engine_threads(pid))
    except PySpyUnavailableError:
        raise
    except EngineThreadNotFoundError as not_here:
        missing = not_here
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    for child in descendants:
        try:
            return frozenset((child.pid, tid) for tid in engine_threads(child.pid))
        except EngineThreadNotFoundError:  # py-spy unavailable for it included: not a Python engine
            continue
    raise missing


def redis_server_pid(info: dict[str, object]) -> int | None:
    """The pid of a Redis server on this machine, from its ``INFO server`` (None when it is not ours to read)."""
    pid = info.get("process_id")
    if not isinstance(pid, int):
        return None
    try:
        name = psutil.Process(pid).name()
    except psutil.Error:
        return None
    # A fork answers as Redis does (Valkey's INFO says redis_version 7.2.4 for clients' sake).
    return pid if "redis" in name or "valkey" in name else None
