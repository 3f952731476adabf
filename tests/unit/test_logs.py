"""Log lines: JSON lines parse, name their role and carry their response id; text lines stay one line."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from api.main import create_app
from resq.logs import (
    ResponseIdFilter,
    about,
    bind_response_id,
    json_formatter,
    response_context,
    text_formatter,
)
from resq.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
RESPONSE_ID = "resp_" + "ab" * 16


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger writing JSON lines (as ``RESQ_LOG_FORMAT=json`` sets them up) into a buffer."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(json_formatter("postprocess"))
    handler.addFilter(ResponseIdFilter())
    logger = logging.getLogger("tests.logs")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, buffer
    logger.handlers.clear()


def lines(buffer: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_a_line_inside_a_response_context_carries_its_id(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, buffer = captured
    with response_context(RESPONSE_ID):
        logger.info("post-processing ended: %s", "completed")
    logger.info("idle")
    inside, outside = lines(buffer)
    assert inside["response_id"] == RESPONSE_ID
    assert inside["message"] == "post-processing ended: completed"
    assert inside["level"] == "INFO" and inside["role"] == "postprocess" and inside["logger"] == "tests.logs"
    assert isinstance(inside["time"], str) and isinstance(inside["pid"], int)
    assert "response_id" not in outside


def test_an_explicit_id_wins_over_the_context(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, buffer = captured
    other = "resp_" + "cd" * 16
    with response_context(RESPONSE_ID):
        logger.info("cancelled", extra=about(other))
    assert lines(buffer)[0]["response_id"] == other


def test_contexts_do_not_leak_across_threads(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, buffer = captured

    def elsewhere() -> None:
        logger.info("another thread")

    with response_context(RESPONSE_ID):
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert "response_id" not in lines(buffer)[0]


def test_exceptions_stay_inside_one_json_line(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, buffer = captured
    with response_context(RESPONSE_ID):
        try:
            raise RuntimeError("boom\nsecond line")
        except RuntimeError:
            logger.exception("failed")
    (line,) = lines(buffer)
    assert line["response_id"] == RESPONSE_ID
    assert "RuntimeError: boom" in str(line["exc_info"])


def test_a_bound_id_lasts_until_the_context_ends(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, buffer = captured
    with response_context("resp_placeholder"):
        bind_response_id(RESPONSE_ID)
        logger.info("accepted")
    logger.info("after")
    first, second = lines(buffer)
    assert first["response_id"] == RESPONSE_ID
    assert "response_id" not in second


def test_a_process_in_json_mode_writes_only_json_lines_even_when_it_crashes() -> None:
    code = (
        "import logging, warnings; from resq.logs import configure_logging, response_context; "
        "configure_logging('info', 'api', 'json'); "
        "logging.getLogger('ContinuousBatchingLogger').info('library line'); "
        "warnings.warn('deprecated thing'); "
        f"ctx = response_context({RESPONSE_ID!r}); ctx.__enter__(); "
        "raise SystemError('crash')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    records = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    messages = [record["message"] for record in records]
    assert "library line" in messages
    assert any("deprecated thing" in message for message in messages)
    crash = records[-1]
    assert crash["level"] == "CRITICAL" and "SystemError: crash" in crash["exc_info"]
    assert crash["response_id"] == RESPONSE_ID and crash["role"] == "api"


def test_a_text_line_stays_one_line_whatever_the_client_sent() -> None:
    """A decoded `%0A` in a logged path must not start a line that looks like the server's own."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(text_formatter("api"))
    logger = logging.getLogger("tests.logs.text")
    logger.handlers[:] = [handler]
    logger.propagate = False
    forged = "/v1/x\n2026-01-01 00:00:00,000 INFO [api] api.auth: key sk-admin accepted\r\x1b[2K\u2028"
    try:
        logger.warning("GET %s refused", forged)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed at %s", forged)
    finally:
        logger.handlers.clear()
    refused, failed, *traceback = buffer.getvalue().splitlines()
    assert refused.endswith(
        "GET /v1/x\\n2026-01-01 00:00:00,000 INFO [api] api.auth: key sk-admin accepted\\r\\x1b[2K\\u2028 refused"
    )
    assert "failed at /v1/x\\n" in failed
    # The traceback keeps its lines.
    assert traceback[0] == "Traceback (most recent call last):" and traceback[-1] == "RuntimeError: boom"


def test_a_refused_request_logs_its_path_escaped(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(redis_url=redis_url, postprocess_workers=1, api_keys="sk-resq-" + "a" * 24)
    with TestClient(create_app(settings)) as client, caplog.at_level(logging.INFO, logger="api.gate"):
        reply = client.get("/v1/models%0A2026-01-01%20INFO%20forged")
    assert reply.status_code == 401
    (record,) = [record for record in caplog.records if record.name == "api.gate"]
    line = json_formatter("api").format(record)
    assert "refused" in record.getMessage() and "\n" not in record.getMessage()
    assert json.loads(line)["message"].startswith("GET /v1/models\\n2026-01-01 INFO forged refused")
