"""Processes the bench starts: each logs to a file of the run, and all stop at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STOP_GRACE_S = 15.0


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Proc:
    """One started process and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        """Its process id."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether it still runs."""
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The end of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@dataclass
class ProcGroup:
    """Starts processes with logs under ``log_dir``; :meth:`stop_all` stops them newest first."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    tree: Path | None = None
    """Another checkout of resq to run the roles from (``bench.versus``); None: this one.

    Both the working directory and ``PYTHONPATH``: ``python -m`` puts its working directory
    first on ``sys.path``, so a role started from this checkout would import this checkout's
    code whatever ``PYTHONPATH`` says."""

    def start(
        self, name: str, argv: Sequence[str], env: dict[str, str] | None = None, pipes: bool = False
    ) -> Proc:
        """Start ``argv`` with ``env`` added to this process's environment.

        With ``pipes`` its stdin and stdout are pipes to this process (stderr still goes to the log).
        """
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        if self.tree is not None:
            full_env["PYTHONPATH"] = str(self.tree)
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                list(argv),
                env=full_env,
                cwd=self.tree,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else log_file,
                stderr=log_file if pipes else subprocess.STDOUT,
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def start_role(self, role: str, name: str, env: dict[str, str]) -> Proc:
        """Start a resq role the way ``resq up`` does (``python -m resq <role>``)."""
        return self.start(name, [sys.executable, "-m", "resq", role], env)

    def stop(self, proc: Proc) -> None:
        """Stop one process of the group."""
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        """Stop every process, newest first."""
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


def wait_until(
    condition: Callable[[], bool], timeout_s: float, what: str, watched: Sequence[Proc] = ()
) -> None:
    """Poll ``condition`` until true; raise with the logs of ``watched`` if it never is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in watched:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited while waiting for {what}:\n{proc.log_tail()}")
        try:
            if condition():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.25)
    logs = "\n\n".join(f"--- {proc.name} ---\n{proc.log_tail()}" for proc in watched)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{logs}")


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 200."""
    return httpx.get(url, timeout=2).status_code == 200
