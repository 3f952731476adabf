"""Fuzzing the API with schemathesis against its own OpenAPI schema: zero 5xx answers.

A bounded, derandomised run here (``RESQ_FUZZ_EXAMPLES`` examples per operation and
mode, default 20); ``make fuzz`` runs a longer one with shrinking.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import MODEL, Stack, start_stack
from tests.support.fuzz import fuzz_api
from tests.support.processes import RoleProcess

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("RESQ_FUZZ_EXAMPLES", "20"))
SHRINK = os.environ.get("RESQ_FUZZ_SHRINK", "0") == "1"
RANDOM = os.environ.get("RESQ_FUZZ_RANDOM", "0") == "1"
"""New requests on every run (the suite's run stays derandomised: the same requests each time)."""


@pytest.fixture(scope="module")
def fuzzed(gpu_worker: RoleProcess, base_env: dict[str, str], log_dir: Path) -> Iterator[Stack]:
    """An API whose valid requests generate a few tokens only, so that many fit in the run."""
    env = {**base_env, "RESQ_DEFAULT_MAX_OUTPUT_TOKENS": "8", "RESQ_MAX_OUTPUT_TOKENS_CAP": "16"}
    started = start_stack(env, log_dir, 0, "fuzz")
    try:
        yield started
    finally:
        started.group.stop_all()


def test_schema_describes_the_create_body(fuzzed: Stack) -> None:
    schema = httpx.get(f"{fuzzed.base_url}/openapi.json", timeout=30).json()
    create = schema["paths"]["/v1/responses"]["post"]
    body_schema = create["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema == {"$ref": "#/components/schemas/CreateResponseRequest"}
    assert "422" not in create["responses"] and "4XX" in create["responses"]
    retrieve = schema["paths"]["/v1/responses/{response_id}"]["get"]
    assert {parameter["name"] for parameter in retrieve["parameters"]} >= {"stream", "starting_after"}


@pytest.mark.timeout(3600)
def test_fuzzing_finds_no_server_error(fuzzed: Stack) -> None:
    report = fuzz_api(fuzzed.base_url, MODEL, EXAMPLES, shrink=SHRINK, randomised=RANDOM)
    print(f"fuzz: {report.statuses.total()} requests: {sorted(report.statuses.items())}")
    assert not report.failures, "\n".join(report.failures)
    # Some generated requests were valid all the way: they reached the GPU worker.
    assert report.statuses["POST /v1/responses", 200] > 0, report.samples.get(("POST /v1/responses", 400))
    assert report.statuses["POST /v1/chat/completions", 200] > 0, report.samples.get(
        ("POST /v1/chat/completions", 400)
    )
    assert all(status < 500 for _, status in report.statuses)
    # The service still answers normally.
    response = fuzzed.client().responses.create(
        model=MODEL, input="Say hello.", temperature=0, max_output_tokens=16
    )
    assert response.status == "completed"
