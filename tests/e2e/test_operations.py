"""Operations end to end: every role's metrics grow after a request, every log line is JSON
and the lines about a response carry its id. Runs against both post-processing modes.

The session's processes run with ``RESQ_LOG_FORMAT=json`` and each worker serves its
metrics on a port of its own (``tests/support/processes.py``), as in compose.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL, Stack
from tests.support.invariants import as_dict, check_stream
from tests.support.metrics import Samples, scrape, value
from tests.support.processes import ProcessGroup, RoleProcess, free_port, wait_until

pytestmark = pytest.mark.e2e

EVENTUALLY_S = 60.0
DELTA_TYPES = {"response.output_text.delta", "response.reasoning_text.delta"}


def api_metrics(stack: Stack) -> str:
    return f"{stack.base_url}/metrics"


def worker_metrics(role: RoleProcess) -> str:
    assert role.metrics_port is not None, f"{role.name} serves no metrics"
    return f"http://127.0.0.1:{role.metrics_port}/metrics"


def postprocess_sources(stack: Stack) -> list[str]:
    """Where post-processing is measured: the workers, or the API when it post-processes inline."""
    return [worker_metrics(worker) for worker in stack.workers] or [api_metrics(stack)]


def summed(urls: list[str], name: str, **labels: str) -> float:
    return sum(value(scrape(url), name, **labels) for url in urls)


def eventually(condition: Callable[[], bool], what: str) -> None:
    wait_until(condition, EVENTUALLY_S, what)


def test_metrics_of_every_role_grow_after_a_streamed_request(
    stack: Stack, gpu_worker: RoleProcess, client: OpenAI
) -> None:
    pp_urls = postprocess_sources(stack)
    api_before = scrape(api_metrics(stack))
    gpu_before = scrape(worker_metrics(gpu_worker))
    pp_events_before = summed(pp_urls, "resq_postprocess_events_total")
    pp_lag_before = summed(pp_urls, "resq_postprocess_lag_seconds_count")
    pp_done_before = summed(pp_urls, "resq_postprocess_responses_total", status="completed")

    with client.responses.create(model=MODEL, input="Count to twenty.", temperature=0, stream=True) as stream:
        events = [as_dict(event) for event in stream]
    final = check_stream(events)
    deltas = sum(event["type"] in DELTA_TYPES for event in events)
    output_tokens = final["usage"]["output_tokens"]
    assert final["status"] == "completed" and deltas >= 2

    def grown(
        samples_before: Samples, url: str, name: str, at_least: float, **labels: str
    ) -> Callable[[], bool]:
        before = value(samples_before, name, **labels)
        return lambda: value(scrape(url), name, **labels) - before >= at_least

    api = api_metrics(stack)
    request = {"route": "/v1/responses", "method": "POST", "status": "200"}
    # The request is counted when its body ends, which the client may see a moment earlier.
    eventually(grown(api_before, api, "resq_http_requests_total", 1, **request), "the request count")
    api_after = scrape(api)
    assert (
        value(api_after, "resq_time_to_first_token_seconds_count")
        - value(api_before, "resq_time_to_first_token_seconds_count")
        >= 1
    )
    assert (
        value(api_after, "resq_inter_token_seconds_count")
        - value(api_before, "resq_inter_token_seconds_count")
        >= deltas - 1
    )
    assert (
        value(api_after, "resq_output_tokens_total", model=MODEL)
        - value(api_before, "resq_output_tokens_total", model=MODEL)
        >= output_tokens
    )
    assert value(api_after, "resq_workers_alive", role="gpu") >= 1
    assert ("resq_queue_depth", (("queue", f"generate:{MODEL}"),)) in api_after

    gpu_after = scrape(worker_metrics(gpu_worker))
    assert (
        value(gpu_after, "resq_generated_tokens_total") - value(gpu_before, "resq_generated_tokens_total")
        >= output_tokens
    )
    assert value(gpu_after, "resq_engine_max_batch") == 32

    eventually(
        lambda: summed(pp_urls, "resq_postprocess_responses_total", status="completed") > pp_done_before,
        "the post-processor to count the response",
    )
    # Every event but the opening two (response.created and response.in_progress, which the API
    # logs for a foreground response) came from a post-processor.
    assert summed(pp_urls, "resq_postprocess_events_total") - pp_events_before >= len(events) - 2
    assert summed(pp_urls, "resq_postprocess_lag_seconds_count") > pp_lag_before


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a log file, each of which must be one JSON object."""
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"{path.name}:{number} is not JSON: {line[:300]}")
        assert isinstance(record, dict) and {"time", "level", "logger", "message", "role"} <= set(record)
        records.append(record)
    return records


def test_every_log_line_is_json_and_lines_about_a_response_carry_its_id(
    stack: Stack, gpu_worker: RoleProcess, client: OpenAI
) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
    assert response.status == "completed"
    postprocess_logs = [worker.log_path for worker in stack.workers] or [stack.api.log_path]
    # Which logs must mention the response, and from which code (inline post-processing logs in the API's).
    expected = {
        "api.": [stack.api.log_path],
        "gpu_worker.": [gpu_worker.log_path],
        "resq.postprocess.": postprocess_logs,
    }

    def tagged(paths: list[Path], logger: str) -> bool:
        return any(
            record.get("response_id") == response.id and record["logger"].startswith(logger)
            for path in paths
            for record in json_lines(path)
        )

    for logger, paths in expected.items():
        # Post-processing logs its end after the terminal event, which the client may see first.
        eventually(
            lambda paths=paths, logger=logger: tagged(paths, logger),  # type: ignore[misc]
            f"a line from {logger}* about {response.id}",
        )
    for path in {path for paths in expected.values() for path in paths}:
        for record in json_lines(path):
            if response.id in record["message"]:
                assert record.get("response_id") == response.id, record


@pytest.mark.parametrize("role", ["gpu-worker", "postprocess-worker"])
def test_a_worker_whose_metrics_port_is_taken_exits_at_once_saying_so(
    base_env: dict[str, str], log_dir: Path, role: str
) -> None:
    """Before it loads a model or starts a thread that would keep a half-started process alive."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        group = ProcessGroup(log_dir, base_env)
        worker = group.start(role, f"{role}-port-taken", RESQ_METRICS_PORT=str(port))
        try:
            returncode = worker.process.wait(timeout=60)
        finally:
            group.stop_all()
    assert returncode != 0
    assert f"cannot serve metrics on 127.0.0.1:{port} (RESQ_METRICS_PORT)" in worker.log_tail()
