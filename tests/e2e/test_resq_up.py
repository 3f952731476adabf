"""``resq up`` as ``make run`` runs it, on its embedded Redis: a role killed once the stack is up is
started again while the others go on serving, and SIGTERM stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import APIError, OpenAI

from tests.e2e.conftest import MODEL
from tests.support.processes import START_TIMEOUT_S, RoleProcess, api_healthy, free_port, wait_until

pytestmark = pytest.mark.e2e


def role_pids(up: subprocess.Popen[bytes], role: str) -> list[int]:
    """The pids of ``resq up``'s children running ``role`` (``python -m resq <role>``)."""
    found = []
    for child in psutil.Process(up.pid).children():
        try:
            if child.cmdline()[-1:] == [role]:
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def answer(base_url: str) -> str:
    """The id of a stored response the stack completed."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, _strict_response_validation=True)
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8)
    assert response.status in ("completed", "incomplete"), response
    return response.id


def answers(base_url: str) -> bool:
    """Whether a request completes (False while a role that was killed is not back)."""
    try:
        return bool(answer(base_url))
    except APIError:
        return False


def start_resq_up(base_env: dict[str, str], tmp_path: Path) -> tuple[RoleProcess, str]:
    """``resq up`` on its embedded Redis (nothing listens at its URL, as on a fresh machine),
    ready; the process (with its log) and the API's base URL."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        **base_env,
        "RESQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "RESQ_PORT": str(port),
        "RESQ_POSTPROCESS_WORKERS": "2",
        "OMP_NUM_THREADS": "1",
    }
    log_path = tmp_path / "resq-up.log"
    with log_path.open("wb") as log_file:
        up = subprocess.Popen(
            [sys.executable, "-m", "resq", "up"], env=env, stdout=log_file, stderr=subprocess.STDOUT
        )
    watched = RoleProcess("resq up", up, log_path)
    try:
        # Ready when resq up itself says so, not at the API's first healthy answer: until its own
        # poll of /health (every 0.5 s) sees it, a role that dies fails the start by design, and a
        # test that killed one in that gap on a fast machine saw everything stop.
        wait_until(
            lambda: api_healthy(base_url) and "resq is ready" in log_path.read_text(errors="replace"),
            START_TIMEOUT_S,
            "resq up",
            [watched],
        )
    except BaseException:
        stop(up)
        raise
    return watched, base_url


def still_running(pids: list[int], wait_s: float = 10.0) -> list[int]:
    """Those of ``pids`` still running (zombies aside) after up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        running = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
            except psutil.NoSuchProcess:
                continue
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def stop(up: subprocess.Popen[bytes]) -> None:
    """Kill ``resq up`` if a test left it running (its children get SIGTERM with it)."""
    if up.poll() is None:
        up.kill()
        up.wait()


def test_resq_up_starts_a_killed_role_again_and_keeps_serving(
    base_env: dict[str, str], tmp_path: Path
) -> None:
    watched, base_url = start_resq_up(base_env, tmp_path)
    up, log_path = watched.process, watched.log_path
    try:
        first = answer(base_url)

        for role in ("postprocess-worker", "api", "gpu-worker"):
            before = role_pids(up, role)
            assert before, f"no {role} under resq up:\n{watched.log_tail()}"
            psutil.Process(before[0]).kill()
            wait_until(
                lambda role=role, before=before: (
                    len(role_pids(up, role)) == len(before)  # type: ignore[misc]
                    and before[0] not in role_pids(up, role)
                ),
                60,
                f"{role} started again",
                [watched],
            )
            assert "was killed by SIGKILL" in log_path.read_text(errors="replace")
            assert "starting it again in" in log_path.read_text(errors="replace")
            # The stack serves again, and what it stored before the death is still there.
            wait_until(lambda: api_healthy(base_url), START_TIMEOUT_S, f"health after {role}", [watched])
            wait_until(lambda: answers(base_url), START_TIMEOUT_S, f"an answer after {role}", [watched])
            stored = httpx.get(f"{base_url}/v1/responses/{first}", timeout=10)
            assert stored.status_code == 200 and stored.json()["id"] == first

        children = [child.pid for child in psutil.Process(up.pid).children(recursive=True)]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, watched.log_tail()
        left = still_running(children)
        assert not left, f"resq up left {left} running"
    finally:
        stop(up)


def test_resq_up_stops_everything_when_its_embedded_redis_dies(
    base_env: dict[str, str], tmp_path: Path
) -> None:
    """A new embedded Redis would hold none of the responses: the roles would answer 503 for ever."""
    watched, _ = start_resq_up(base_env, tmp_path)
    up = watched.process
    try:
        children = psutil.Process(up.pid).children(recursive=True)
        redis = [child for child in children if "redis-server" in " ".join(child.cmdline())]
        assert len(redis) == 1, [child.cmdline() for child in children]
        redis[0].kill()
        assert up.wait(timeout=60) == 1, watched.log_tail()
        assert "the embedded Redis was killed by SIGKILL; stopping everything" in watched.log_tail()
        left = still_running([child.pid for child in children])
        assert not left, f"resq up left {left} running"
    finally:
        stop(up)
