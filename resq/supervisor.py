"""``resq up``: Redis (embedded if none answers), one GPU worker, the post-process workers and the API.

Each role runs as its own process (``python -m resq <role>``) with the same
resolved settings in its environment. Ctrl-C or SIGTERM stops them all. A role
that dies while the stack starts fails the start (everything stops, ``resq up``
exits non-zero); one that dies once the stack is up is started again, with the
delays of :class:`~resq.restart_backoff.RestartBackoff`, while the others go on
serving (its work is taken over as after any worker's loss: docs/reliability.md).
A role that cannot start (it keeps dying at once) or the embedded Redis dying
stops everything, so nothing is left half-running.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from types import FrameType

from resq.child_processes import die_with_parent
from resq.embedded_redis import EmbeddedRedis, RedisRefusedError, masked_url, redis_answers
from resq.restart_backoff import RestartBackoff
from resq.settings import Settings

log = logging.getLogger("resq.up")

STOP_GRACE_S = 15.0
"""How long the roles get to stop on top of the GPU worker's ``RESQ_SHUTDOWN_GRACE_S``."""
READY_TIMEOUT_S = 600.0


def check_metrics_ports(settings: Settings) -> None:
    """ValueError when the workers' metrics ports (``RESQ_METRICS_PORT`` and one more per
    post-process worker) would run past the last port."""
    first, workers = settings.metrics_port, settings.postprocess_workers
    if first is not None and first + workers > 65535:
        raise ValueError(
            f"RESQ_METRICS_PORT={first}: `resq up` gives its {workers + 1} workers the ports "
            f"{first} to {first + workers}; use one up to {65535 - workers}"
        )


def check_port_free(host: str, port: int) -> None:
    """ValueError when ``host:port`` cannot be bound: another process listens there, and its
    ``/health`` would pass for this API's (which would then die on its bind)."""
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            # As uvicorn binds: a port left in TIME_WAIT by a stopped resq is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        raise ValueError(
            f"RESQ_PORT={port}: the API cannot listen on {host}:{port} ({exc.strerror or exc}); "
            "is another resq running? Stop it or choose another port"
        ) from None


def how_it_ended(returncode: int) -> str:
    """A dead process's end in words: ``exited with code 1``, ``was killed by SIGKILL``."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class _Child:
    """One role's process, and what it takes to start that role again."""

    role: str
    name: str
    metrics_offset: int | None
    process: subprocess.Popen[bytes]
    started_at: float
    backoff: RestartBackoff = field(default_factory=RestartBackoff)
    restart_at: float | None = None
    """When the dead process is to be replaced (monotonic clock); None while it runs."""


@dataclass
class Supervisor:
    """Starts, watches and stops the processes of one resq deployment."""

    settings: Settings
    children: list[_Child] = field(default_factory=list)
    embedded_redis: EmbeddedRedis | None = None
    _stopping: bool = False

    def run(self) -> int:
        """Bring everything up, wait until a signal or a death, bring everything down."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            check_metrics_ports(self.settings)
            check_port_free(self.settings.host, self.settings.port)
            self._ensure_redis()
            self._spawn("gpu-worker", metrics_offset=0)
            for index in range(self.settings.postprocess_workers):
                self._spawn("postprocess-worker", suffix=str(index + 1), metrics_offset=index + 1)
            self._spawn("api")
            if not self._wait_until_ready():
                return 0  # stopped by a signal while starting
            return self._watch()
        except KeyboardInterrupt:
            return 0
        except (RedisRefusedError, RuntimeError, ValueError) as exc:
            # A role that died while starting, a Redis that refuses the URL, a URL that is none:
            # one line (the role's own output says why it died), not a traceback.
            log.error("%s; stopping everything", exc)
            return 1
        finally:
            self._stop_all()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only noted: the loops look at the flag. Raising here could land between a child's
        # start and its bookkeeping (a process nobody stops), or in the middle of the shutdown
        # when a second signal comes.
        if not self._stopping:
            log.info("received %s; stopping", signal.Signals(signum).name)
        self._stopping = True

    def _ensure_redis(self) -> None:
        if redis_answers(self.settings.redis_url):
            log.info("using Redis at %s", masked_url(self.settings.redis_url))
            return
        log.info("nothing listens at %s; starting an embedded Redis", masked_url(self.settings.redis_url))
        self.embedded_redis = EmbeddedRedis()
        self.embedded_redis.start()
        self.settings = self.settings.model_copy(update={"redis_url": self.embedded_redis.url})
        log.info("embedded Redis ready at %s", self.embedded_redis.url)

    def _spawn(self, role: str, suffix: str = "", metrics_offset: int | None = None) -> None:
        name = f"{role}{'-' + suffix if suffix else ''}"
        process = self._start_process(role, name, metrics_offset)
        self.children.append(_Child(role, name, metrics_offset, process, time.monotonic()))

    def _start_process(self, role: str, name: str, metrics_offset: int | None) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.settings.to_env()}
        if self.settings.metrics_port is not None and metrics_offset is not None:
            # Workers share this host: each serves its metrics on a port of its own.
            env["RESQ_METRICS_PORT"] = str(self.settings.metrics_port + metrics_offset)
        process = subprocess.Popen([sys.executable, "-m", "resq", role], env=env, preexec_fn=die_with_parent)
        log.info("started %s (pid %d)", name, process.pid)
        return process

    def _wait_until_ready(self) -> bool:
        """Wait until the API answers ``/health``; False when a signal came first."""
        url = f"http://{self.settings.host}:{self.settings.port}/health"
        log.info("waiting for the model to load and every role to report in (%s)", url)
        deadline = time.monotonic() + READY_TIMEOUT_S
        last_note = 0.0
        while time.monotonic() < deadline:
            if self._stopping:
                return False
            self._check_children()
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        log.info(
                            "resq is ready: http://%s:%d/v1 serving model %r",
                            self.settings.host,
                            self.settings.port,
                            self.settings.served_model_name,
                        )
                        return True
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - last_note > 10:
                last_note = time.monotonic()
                log.info("still starting...")
            time.sleep(0.5)
        raise RuntimeError(f"resq did not become ready within {READY_TIMEOUT_S:.0f}s")

    def _check_children(self) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(f"{child.name} {how_it_ended(code)}")
        self._check_embedded_redis()

    def _check_embedded_redis(self) -> None:
        # Not started again: it keeps nothing, so a new one would serve none of the responses and
        # the roles would answer 503 until then (docs/reliability.md).
        if self.embedded_redis is not None and (code := self.embedded_redis.returncode) is not None:
            raise RuntimeError(f"the embedded Redis {how_it_ended(code)}")

    def _watch(self) -> int:
        """Start again each role that dies, until a signal (0); 1 when one cannot start at all or
        the embedded Redis died."""
        while not self._stopping:
            try:
                self._check_embedded_redis()
            except RuntimeError as exc:
                log.error("%s; stopping everything", exc)
                return 1
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is None:
                    code = child.process.poll()
                    if code is not None and not self._schedule_restart(child, code, now):
                        return 1
                elif now >= child.restart_at:
                    child.process = self._start_process(child.role, child.name, child.metrics_offset)
                    child.started_at, child.restart_at = now, None
            time.sleep(0.5)
        return 0

    def _schedule_restart(self, child: _Child, code: int, now: float) -> bool:
        """Note when ``child``, found dead with ``code``, starts again; False when it keeps dying."""
        ran_for_s = now - child.started_at
        delay_s = child.backoff.after_death(ran_for_s)
        if delay_s is None:
            log.error(
                "%s %s after %.0fs, %d times in a row within %.0fs of starting: it cannot start; "
                "stopping everything",
                child.name,
                how_it_ended(code),
                ran_for_s,
                child.backoff.quick_deaths,
                child.backoff.quick_s,
            )
            return False
        # The others go on serving: a lost worker's responses are taken over (docs/reliability.md).
        log.error(
            "%s %s after %.0fs; starting it again in %.0fs",
            child.name,
            how_it_ended(code),
            ran_for_s,
            delay_s,
        )
        child.restart_at = now + delay_s
        return True

    def _stop_all(self) -> None:
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        # The GPU worker may drain its requests for RESQ_SHUTDOWN_GRACE_S before it hands back.
        deadline = time.monotonic() + self.settings.shutdown_grace_s + STOP_GRACE_S
        for child in reversed(self.children):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                child.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", child.name)
                child.process.kill()
                child.process.wait()
        if self.embedded_redis is not None:
            self.embedded_redis.stop()
        log.info("stopped")
