"""Real resq processes for end-to-end tests: started as the ``resq`` command starts them.

Every role runs as ``python -m resq <role>`` with ``RESQ_*`` variables, logs to
a file (printed when a start fails), and is stopped with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

START_TIMEOUT_S = 180.0


def _ephemeral_ports() -> range:
    # Where the kernel picks the local port of every outgoing connection (and of a bind to 0).
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


_EPHEMERAL = _ephemeral_ports()
# Candidates outside the ephemeral range: a port probed free here may be bound by a role
# seconds later (after its model loads), and a port from the ephemeral range can be taken
# meanwhile by any outgoing connection, a Redis client's for one.
_CANDIDATES = [port for port in range(20000, 32768) if port not in _EPHEMERAL] or list(range(20000, 32768))
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port nobody listens on now, outside the kernel's ephemeral range, not handed out before."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = rng.choice(_CANDIDATES)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free TCP port found outside the ephemeral range")


WORKER_ROLES = ("gpu-worker", "postprocess-worker")
STOP_TIMEOUT_S = 15.0
"""How long a stopped role may take to shut down before it is killed."""


def readable_log_line(line: str) -> str:
    """A JSON log line (RESQ_LOG_FORMAT=json) as people read it; other lines unchanged."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict) or "message" not in record:
        return line
    about = f" [{record['response_id']}]" if record.get("response_id") else ""
    text = f"{record.get('time', '')} {record.get('level', '')} {record.get('logger', '')}{about}: {record['message']}"
    return f"{text}\n{record['exc_info']}" if record.get("exc_info") else text


@dataclass
class RoleProcess:
    """One running role and its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int | None = None
    """Where a worker serves its Prometheus metrics (the API serves them on its own port)."""

    def log_tail(self, lines: int = 60) -> str:
        """The end of the role's log."""
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return "\n".join(readable_log_line(line) for line in tail)

    def alive(self) -> bool:
        """Whether it still runs."""
        return self.process.poll() is None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        self.terminate()
        self.wait_or_kill(timeout_s)

    def terminate(self) -> None:
        """SIGTERM, without waiting (the role's graceful shutdown begins)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_or_kill(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for it to end, then SIGKILL it."""
        try:
            self.process.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """SIGKILL at once (fault injection)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclass
class ProcessGroup:
    """Starts roles with a shared base environment; stops all of them at the end."""

    log_dir: Path
    base_env: dict[str, str]
    processes: list[RoleProcess] = field(default_factory=list)

    def start(self, role: str, name: str, **env: str) -> RoleProcess:
        """Start ``python -m resq <role>`` with extra ``RESQ_*`` variables."""
        log_path = self.log_dir / f"{name}.log"
        metrics_port = None
        if role in WORKER_ROLES and "RESQ_METRICS_PORT" not in env:
            metrics_port = free_port()
            env = {**env, "RESQ_METRICS_PORT": str(metrics_port)}
        full_env = {**os.environ, **self.base_env, **env, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "resq", role], env=full_env, stdout=log_file, stderr=subprocess.STDOUT
            )
        started = RoleProcess(name, process, log_path, metrics_port)
        self.processes.append(started)
        return started

    def stop_all(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every process started: all are signalled first (newest first) and shut down side by
        side, so that a group's teardown takes its slowest role's shutdown, not their sum; any
        still running ``timeout_s`` later is killed."""
        roles = list(reversed(self.processes))
        for role in roles:
            role.terminate()
        deadline = time.monotonic() + timeout_s
        for role in roles:
            role.wait_or_kill(deadline - time.monotonic())
        self.processes.clear()


def wait_until(
    condition: Callable[[], bool], timeout_s: float, what: str, watched: list[RoleProcess] | None = None
) -> None:
    """Poll ``condition`` until true; fail with the logs of ``watched`` if it never is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for role in watched or []:
            if not role.alive():
                raise RuntimeError(f"{role.name} exited while waiting for {what}:\n{role.log_tail()}")
        try:
            if condition():
                return
        except (httpx.HTTPError, redis.RedisError, OSError):
            pass
        time.sleep(0.2)
    logs = "\n\n".join(f"--- {role.name} ---\n{role.log_tail()}" for role in watched or [])
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{logs}")


def api_healthy(base_url: str) -> bool:
    """Whether ``/health`` answers 200."""
    return httpx.get(f"{base_url}/health", timeout=2).status_code == 200


def model_registered(redis_url: str, model_name: str) -> bool:
    """Whether a GPU worker registered ``model_name``."""
    client = redis.Redis.from_url(redis_url)
    try:
        return bool(client.hexists("resq:models", model_name))
    finally:
        client.close()
