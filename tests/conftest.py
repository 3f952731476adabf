"""Session-wide fixtures: a real Redis, which must answer (the suite fails, never skips, without it)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

TEST_REDIS_URL = os.environ.get("RESQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
# litellm (a client under test) would fetch its model price list from the internet at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis database the suite owns (flushed at the start of the session)."""
    client = redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as exc:
        pytest.fail(
            f"no Redis answers at {TEST_REDIS_URL} (set RESQ_TEST_REDIS_URL, or start one: "
            f"redis-server --daemonize yes --port 6379): {exc}"
        )
    client.flushdb()
    client.close()
    return TEST_REDIS_URL


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A blocking client on the suite's database."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


# Modules that load a fixture model without the `fixture_model_dir` fixture.
_MAIN_MODEL_MODULES = ("test_fixture_model.py", "test_engine_logprobs.py", "test_generation_plan.py")
_LONG_MODEL_MODULES = ("test_js_clients.py", "test_long_context_fixture.py")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the fixture models the selected tests need now, before any test's timeout starts.

    A build takes a minute or two on a quiet machine and much longer on a loaded one; inside
    a test (or a fixture) it would count against that test's ``timeout`` and turn every e2e
    test into an error. Cached builds return at once.
    """
    items = session.items
    wants_main = any(
        "fixture_model_dir" in getattr(item, "fixturenames", ())
        or item.path.name in _MAIN_MODEL_MODULES
        or "e2e" in item.path.parts
        for item in items
    )
    wants_long = any(item.path.name in _LONG_MODEL_MODULES for item in items)
    if not (wants_main or wants_long):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("fixture models: building any that are not cached (progress on stderr)")
    if wants_main:
        from tests.fixture_model import ensure_fixture_model

        ensure_fixture_model()
    if wants_long:
        from tests.fixture_model.long_context import ensure_long_context_model

        ensure_long_context_model()
