"""The end-to-end stack: real Redis, a Celery GPU worker on the fixture model, post-process
workers (or the inline post-processor) and the API under uvicorn, driven over HTTP.

``stack`` is parametrised over ``RESQ_POSTPROCESS_WORKERS`` 0 (inline) and 2, so every
test that uses it runs against both post-processing modes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import DefaultHttpxClient, OpenAI

from tests.fixture_model import ensure_fixture_model
from tests.support.conformance import check_http_response
from tests.support.processes import (
    START_TIMEOUT_S,
    ProcessGroup,
    RoleProcess,
    api_healthy,
    free_port,
    model_registered,
    wait_until,
)
from tests.support.redis_server import PrivateRedis

MODEL = "fixture"


@dataclass
class Stack:
    """A running API (and its post-process workers) in front of the shared GPU worker."""

    base_url: str
    postprocess_workers: int
    api: RoleProcess
    workers: list[RoleProcess]
    group: ProcessGroup

    def client(self, **options: object) -> OpenAI:
        """An SDK client in strict validation mode, with no retries."""
        options.setdefault(
            # Every JSON Response it receives is checked against the Open Responses schema too.
            "http_client",
            DefaultHttpxClient(event_hooks={"response": [check_http_response]}),
        )
        return OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key="sk-test",
            max_retries=0,
            timeout=120,
            _strict_response_validation=True,
            **options,  # type: ignore[arg-type]
        )


@pytest.fixture(scope="session")
def fixture_model_dir() -> Path:
    """The trained fixture model (built once, cached)."""
    return ensure_fixture_model()


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the processes of the session write their logs."""
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def base_env(redis_url: str, fixture_model_dir: Path) -> dict[str, str]:
    """Settings every process of the stack shares."""
    return {
        "RESQ_REDIS_URL": redis_url,
        "RESQ_MODEL": str(fixture_model_dir),
        "RESQ_MODEL_NAME": MODEL,
        "RESQ_LOG_LEVEL": "info",
        # What compose runs; tests/e2e/test_operations.py checks every line parses.
        "RESQ_LOG_FORMAT": "json",
        "RESQ_HEARTBEAT_S": "0.5",
        "RESQ_WORKER_TTL_S": "5",
        "RESQ_MAX_BATCH": "32",
        "RESQ_KV_CACHE_TOKENS": "32768",
        # The fixture model writes Qwen3-style reasoning and Hermes-style calls.
        "RESQ_REASONING_PARSER": "qwen3",
        "RESQ_TOOL_PARSER": "hermes",
        # Tests here cancel, disconnect and compare streams a step at a time: every engine step's
        # tokens go out with it. tests/e2e/test_stream_interval.py runs the default interval, and
        # so does Codex's stack; RESQ_TEST_STREAM_INTERVAL_MS runs e.g. the client tests at another.
        "RESQ_STREAM_INTERVAL_MS": os.environ.get("RESQ_TEST_STREAM_INTERVAL_MS", "0"),
    }


@pytest.fixture(scope="session")
def gpu_worker(base_env: dict[str, str], log_dir: Path, redis_url: str) -> Iterator[RoleProcess]:
    """One GPU worker for the whole session."""
    group = ProcessGroup(log_dir, base_env)
    worker = group.start("gpu-worker", "gpu-worker")
    try:
        wait_until(lambda: model_registered(redis_url, MODEL), START_TIMEOUT_S, "the GPU worker", [worker])
        yield worker
    finally:
        group.stop_all()


def start_stack(base_env: dict[str, str], log_dir: Path, postprocess_workers: int, tag: str) -> Stack:
    """Start an API (and ``postprocess_workers`` workers) and wait until healthy."""
    group = ProcessGroup(log_dir, base_env)
    workers = [
        group.start(
            "postprocess-worker",
            f"postprocess-{tag}-{index}",
            RESQ_POSTPROCESS_WORKERS=str(postprocess_workers),
        )
        for index in range(postprocess_workers)
    ]
    port = free_port()
    api = group.start(
        "api", f"api-{tag}", RESQ_PORT=str(port), RESQ_POSTPROCESS_WORKERS=str(postprocess_workers)
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: api_healthy(base_url), START_TIMEOUT_S, f"the API ({tag})", [api, *workers])
    except BaseException:
        group.stop_all()
        raise
    return Stack(base_url, postprocess_workers, api, workers, group)


@contextmanager
def stack_on_own_redis(
    env: dict[str, str], log_dir: Path, redis_dir: Path, model_name: str, tag: str, postprocess_workers: int
) -> Iterator[Stack]:
    """A GPU worker serving ``model_name`` and an API (with ``postprocess_workers``), all with
    ``env`` on a private Redis of their own: a second GPU worker on the suite's Redis would show
    in its ``/v1/models``, and take the suite's jobs if it served the suite's model."""
    server = PrivateRedis(redis_dir)
    server.start()
    env = {**env, "RESQ_REDIS_URL": server.url, "RESQ_MODEL_NAME": model_name}
    group = ProcessGroup(log_dir, env)
    try:
        worker = group.start("gpu-worker", f"gpu-worker-{tag}")
        wait_until(
            lambda: model_registered(server.url, model_name),
            START_TIMEOUT_S,
            f"the GPU worker ({tag})",
            [worker],
        )
        stack = start_stack(env, log_dir, postprocess_workers, tag)
        try:
            yield stack
        finally:
            stack.group.stop_all()
    finally:
        group.stop_all()
        server.stop()


@pytest.fixture(scope="session", params=[0, 2], ids=["inline", "workers2"])
def stack(
    request: pytest.FixtureRequest, gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path
) -> Iterator[Stack]:
    """The API in one post-processing mode (session-scoped: each mode starts once)."""
    started = start_stack(base_env, log_dir, request.param, f"pp{request.param}")
    try:
        yield started
    finally:
        started.group.stop_all()


@pytest.fixture
def client(stack: Stack) -> OpenAI:
    """The strict SDK client for the current stack."""
    return stack.client()
