"""Fault injection with real processes: kill -9 post-process workers, GPU workers and APIs
mid-stream, pause a GPU worker into a zombie, lose a Celery message, restart Redis.

Each test starts its own stack on a Redis server of its own (a free port), so that kills
and restarts disturb nothing else, with recovery timeouts shortened through settings. Every
test checks the stream invariants and compares the final Response with an uninterrupted
greedy run of the same request, not only that nothing crashed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai import OpenAI
from openai.types.responses import Response

from resq import keys
from resq.faults import FAULT_EXIT_CODE
from resq.redis_types import range_entries
from tests.e2e import test_websocket as websocket
from tests.e2e.conftest import MODEL
from tests.fixture_model import scenario
from tests.support.invariants import TERMINAL, as_dict, check_stream, output_text
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
from tests.support.responses import wait_ended

pytestmark = pytest.mark.e2e

RECOVERY_ENV = {
    "RESQ_HEARTBEAT_S": "0.3",
    "RESQ_WORKER_TTL_S": "3",
    "RESQ_POSTPROCESS_LEASE_S": "2",
    "RESQ_REAPER_INTERVAL_S": "0.3",
    "RESQ_DISPATCH_TIMEOUT_S": "3",
    "RESQ_GPU_LOST_TIMEOUT_S": "8",
    "RESQ_SHUTDOWN_GRACE_S": "2",
    # Faults strike "after a few deltas" and cancels are bounded in engine steps: every step's
    # tokens go out with it. tests/e2e/test_stream_interval.py runs the default interval, faults
    # included.
    "RESQ_STREAM_INTERVAL_MS": "0",
}
LONG_TOKENS = 150
LONG = {"input": "Repeat forever.", "temperature": 0, "max_output_tokens": LONG_TOKENS}
"""A greedy request long enough to be interrupted (the fixture model never ends it on its own)."""
STOPPING_LONG = {**LONG, "max_output_tokens": 600}
"""Longer: a worker asked to stop keeps generating until Celery's shutdown reaches the hand-back."""
DELTAS_BEFORE_FAULT = 5
KILLED_CHAT_TOKENS = 400
"""The chat GPU-kill test's budget: more than LONG's, so the kill lands well before the end."""
RECOVERY_BOUND_S = 30.0
"""A wide margin over the configured timeouts (seconds) for the bounds these tests measure."""


@dataclass
class FaultStack:
    """Roles started on a private Redis; any of them can be killed, paused or added."""

    redis_server: PrivateRedis
    group: ProcessGroup
    gpu_workers: list[RoleProcess] = field(default_factory=list)
    postprocess_workers: list[RoleProcess] = field(default_factory=list)
    apis: list[tuple[RoleProcess, str]] = field(default_factory=list)

    @property
    def redis(self) -> redis.Redis:
        return self.redis_server.client()

    def start_gpu_worker(self, wait: bool = True, **env: str) -> RoleProcess:
        worker = self.group.start("gpu-worker", f"gpu-{len(self.gpu_workers)}", **env)
        self.gpu_workers.append(worker)
        if wait:
            self.wait_for_gpu_worker(worker)
        return worker

    def wait_for_gpu_worker(self, worker: RoleProcess) -> None:
        url = self.redis_server.url
        wait_until(lambda: _gpu_beats(url, worker.process.pid), START_TIMEOUT_S, worker.name, [worker])

    def start_postprocess_worker(self, **env: str) -> RoleProcess:
        worker = self.group.start("postprocess-worker", f"postprocess-{len(self.postprocess_workers)}", **env)
        self.postprocess_workers.append(worker)
        return worker

    def start_api(self, wait: bool = True, **env: str) -> str:
        port = free_port()
        api = self.group.start("api", f"api-{len(self.apis)}", RESQ_PORT=str(port), **env)
        base_url = f"http://127.0.0.1:{port}"
        self.apis.append((api, base_url))
        if wait:
            self.wait_for_api(len(self.apis) - 1)
        return base_url

    def wait_for_api(self, index: int) -> None:
        api, base_url = self.apis[index]
        watched = [api, *self.gpu_workers, *self.postprocess_workers]
        wait_until(lambda: api_healthy(base_url), START_TIMEOUT_S, api.name, watched)

    def client(self, index: int = 0) -> OpenAI:
        return OpenAI(
            base_url=f"{self.apis[index][1]}/v1",
            api_key="sk-test",
            max_retries=0,
            timeout=120,
            _strict_response_validation=True,
        )

    def role_of(self, worker_id: bytes | str) -> RoleProcess:
        """The process a worker id (``role@host:pid``) names."""
        text = worker_id.decode() if isinstance(worker_id, bytes) else worker_id
        pid = int(text.rsplit(":", 1)[1])
        roles = [*self.gpu_workers, *self.postprocess_workers, *(api for api, _ in self.apis)]
        return next(role for role in roles if role.process.pid == pid)

    def logs(self) -> str:
        return "\n\n".join(f"--- {role.name} ---\n{role.log_tail(40)}" for role in self.group.processes)


def _gpu_beats(redis_url: str, pid: int) -> bool:
    client = redis.Redis.from_url(redis_url)
    try:
        members = [member.decode() for member in client.zrange(keys.GPU_WORKERS, 0, -1)]
        return model_registered(redis_url, MODEL) and any(m.endswith(f":{pid}") for m in members)
    finally:
        client.close()


StackFactory = Callable[..., FaultStack]


@pytest.fixture
def make_stack(
    tmp_path: Path, fixture_model_dir: Path, log_dir: Path, request: pytest.FixtureRequest
) -> Iterator[StackFactory]:
    """Build stacks on private Redis servers; everything is stopped at the end of the test."""
    built: list[FaultStack] = []

    def make(
        gpu_workers: int = 1,
        postprocess_workers: int = 0,
        apis: int = 1,
        append_only: bool = False,
        faulty: dict[str, str] | None = None,
        **env: str,
    ) -> FaultStack:
        """``faulty``: role (``gpu``, ``postprocess``, ``api``) -> the fault point of its first process."""
        server = PrivateRedis(tmp_path / f"redis-{len(built)}", append_only=append_only)
        server.start()
        settings = {
            "RESQ_REDIS_URL": server.url,
            "RESQ_MODEL": str(fixture_model_dir),
            "RESQ_MODEL_NAME": MODEL,
            "RESQ_LOG_LEVEL": "info",
            "RESQ_KV_CACHE_TOKENS": "16384",
            "RESQ_POSTPROCESS_WORKERS": str(postprocess_workers),
            **RECOVERY_ENV,
            **env,
        }
        test_logs = log_dir / f"{request.node.name}-{len(built)}".replace("/", "_")
        test_logs.mkdir(parents=True, exist_ok=True)
        stack = FaultStack(server, ProcessGroup(test_logs, settings))
        built.append(stack)
        # Everything starts at once; then wait until each GPU worker beats and each API is healthy.
        points = faulty or {}

        def fault_env(role: str, index: int) -> dict[str, str]:
            return {"RESQ_FAULT_POINT": points[role]} if index == 0 and role in points else {}

        for index in range(gpu_workers):
            stack.start_gpu_worker(wait=False, **fault_env("gpu", index))
        for index in range(postprocess_workers):
            stack.start_postprocess_worker(**fault_env("postprocess", index))
        for index in range(apis):
            stack.start_api(wait=False, **fault_env("api", index))
        for worker in stack.gpu_workers:
            stack.wait_for_gpu_worker(worker)
        for index in range(apis):
            stack.wait_for_api(index)
        return stack

    yield make
    for stack in built:
        stack.group.stop_all()
        stack.redis_server.stop()


def comparable(response: dict[str, Any]) -> dict[str, Any]:
    """What two runs of one greedy request share (ids and timestamps differ by design).

    ``cached_tokens`` is left out: a copy resumed on the worker that lost it may reuse the KV
    blocks its first copy computed (a real hit the engine reports), which an uninterrupted run
    cannot have. It stays within the prompt.
    """
    usage = dict(response["usage"])
    details = dict(usage.pop("input_tokens_details"))
    assert 0 <= details.pop("cached_tokens") <= usage["input_tokens"], usage
    return {
        "status": response["status"],
        "output": [{k: v for k, v in item.items() if k != "id"} for item in response["output"]],
        "usage": {**usage, "input_tokens_details": details},
        "error": response["error"],
        "incomplete_details": response["incomplete_details"],
    }


class References:
    """Final Responses of uninterrupted runs, computed once per request on a stack of their own."""

    def __init__(self, client: OpenAI) -> None:
        self._client = client
        self._cache: dict[str, dict[str, Any]] = {}

    def __call__(self, **request: Any) -> dict[str, Any]:
        key = json.dumps(request, sort_keys=True)
        if key not in self._cache:
            with self._client.responses.create(model=MODEL, stream=True, **request) as events:
                final = check_stream([as_dict(event) for event in events])
            assert final["status"] == "incomplete"
            assert final["usage"]["output_tokens"] == request["max_output_tokens"]
            self._cache[key] = comparable(final)
        return self._cache[key]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, fixture_model_dir: Path) -> Iterator[References]:
    """Uninterrupted greedy runs (streamed, so their Responses are built the same way)."""
    directory = tmp_path_factory.mktemp("reference")
    server = PrivateRedis(directory / "redis")
    server.start()
    group = ProcessGroup(
        directory,
        {
            "RESQ_REDIS_URL": server.url,
            "RESQ_MODEL": str(fixture_model_dir),
            "RESQ_MODEL_NAME": MODEL,
            "RESQ_POSTPROCESS_WORKERS": "0",
            "RESQ_KV_CACHE_TOKENS": "16384",
        },
    )
    try:
        gpu = group.start("gpu-worker", "gpu")
        port = free_port()
        api = group.start("api", "api", RESQ_PORT=str(port))
        base_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: api_healthy(base_url), START_TIMEOUT_S, "the reference stack", [gpu, api])
        yield References(OpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0, timeout=300))
    finally:
        group.stop_all()
        server.stop()


def generation_field(client: redis.Redis, response_id: str, name: str) -> str | None:
    value = client.hget(keys.generation(response_id), name)
    return value.decode() if value is not None else None


def freeze_then_kill(victim: RoleProcess, client: redis.Redis, response_id: str) -> int:
    """SIGKILL ``victim`` mid-generation; return the tokens it had appended.

    It is stopped (SIGSTOP) first, so what it had appended is read while it can append no more:
    a generation that had already ended fails here, by name, instead of as a wait for a resume
    that never comes.
    """
    os.kill(victim.process.pid, signal.SIGSTOP)
    generated = int(generation_field(client, response_id, "generated") or 0)
    state = generation_field(client, response_id, "state")
    victim.kill()
    assert state == "pending", f"the generation ended ({state}, {generated} tokens) before the kill"
    return generated


def count_deltas(events: list[dict[str, Any]]) -> int:
    return sum(1 for event in events if event["type"] == "response.output_text.delta")


def stream_with_fault(
    client: OpenAI, fault: Callable[[str], None], **request: Any
) -> tuple[list[dict[str, Any]], float]:
    """Stream a response, calling ``fault(response_id)`` after a few deltas; the events and
    the longest wait for an event after the fault (seconds)."""
    events: list[dict[str, Any]] = []
    faulted_at: float | None = None
    longest_wait = 0.0
    last = time.monotonic()
    with client.responses.create(model=MODEL, stream=True, **request) as stream:
        for event in stream:
            now = time.monotonic()
            if faulted_at is not None:
                longest_wait = max(longest_wait, now - last)
            last = now
            events.append(as_dict(event))
            if faulted_at is None and count_deltas(events) >= DELTAS_BEFORE_FAULT:
                fault(events[0]["response"]["id"])
                faulted_at = last = time.monotonic()
    assert faulted_at is not None, "the response ended before the fault"
    return events, longest_wait


def stored_response(client: redis.Redis, response_id: str) -> dict[str, Any]:
    """The Response in the store, as the SDK reads it."""
    raw = client.hget(keys.record(response_id), "response")
    assert raw is not None
    return Response.model_validate(json.loads(raw)).model_dump(mode="json")


# --- post-process workers ------------------------------------------------------------------------


@pytest.mark.parametrize("background", [False, True], ids=["stream", "background"])
def test_postprocess_worker_killed_mid_stream_is_taken_over(
    make_stack: StackFactory, references: References, background: bool
) -> None:
    stack = make_stack(postprocess_workers=2)
    r = stack.redis
    seen: dict[str, Any] = {}

    def kill_post_processor(response_id: str) -> None:
        holder = r.hget(keys.POSTPROCESS_LEASE_HOLDERS, response_id)
        assert holder, "no post-processor holds the response"
        victim = stack.role_of(holder)
        victim.kill()
        seen.update(
            victim=victim,
            logged=r.xlen(keys.events(response_id)),
            generated=int(generation_field(r, response_id, "generated") or 0),
        )

    events, longest_wait = stream_with_fault(
        stack.client(), kill_post_processor, background=background, **LONG
    )
    final = check_stream(events, background=background)
    response_id = final["id"]
    assert not seen["victim"].alive()
    assert seen["generated"] < LONG_TOKENS, "the generation had ended before the kill"
    # Events past those logged at the kill were written by the post-processor that took over; the
    # log holds each once (numbered 0..n-1). The client may get fewer: the takeover logs a burst,
    # whose deltas the API merges for a client behind it (RESQ_SSE_COALESCE_AFTER).
    logged = r.xlen(keys.events(response_id))
    assert events[-1]["sequence_number"] == logged - 1 and logged > seen["logged"]
    assert len(events) <= logged
    assert comparable(final) == references(**LONG), stack.logs()
    assert comparable(stored_response(r, response_id)) == references(**LONG)
    assert longest_wait < RECOVERY_BOUND_S, f"the stream stalled {longest_wait:.1f}s"
    survivor = next(worker for worker in stack.postprocess_workers if worker.alive())
    assert f"taking over post-processing of {response_id}" in survivor.log_tail(400)
    assert r.zscore(keys.POSTPROCESS_LEASES, response_id) is None


def test_postprocess_worker_killed_in_a_conversation_appends_its_items_once(make_stack: StackFactory) -> None:
    """The takeover finishes the response and appends its items; nothing twice (the exact window of
    a death at the append is tests/unit/test_conversation_append.py's)."""
    stack = make_stack(postprocess_workers=2)
    r = stack.redis
    client = stack.client()
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hi."}])

    def kill_post_processor(response_id: str) -> None:
        holder = r.hget(keys.POSTPROCESS_LEASE_HOLDERS, response_id)
        assert holder, "no post-processor holds the response"
        stack.role_of(holder).kill()

    events, _ = stream_with_fault(client, kill_post_processor, conversation=conversation.id, **LONG)
    final = check_stream(events)
    listed = [item.id for item in client.conversations.items.list(conversation.id, order="asc", limit=100)]
    own_input = client.responses.input_items.list(final["id"]).data[0].id
    assert listed[1:] == [own_input, *[item["id"] for item in final["output"]]]


# --- GPU workers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["kill", "pause", "term"])
def test_gpu_worker_lost_mid_generation_resumes_on_another(
    make_stack: StackFactory, references: References, fault: str
) -> None:
    """``kill``: SIGKILL. ``pause``: SIGSTOP past the worker TTL, then SIGCONT once another
    worker resumed the response: the revived zombie must not append to the stream it lost.
    ``term``: a graceful stop (no grace period) hands the response back at once."""
    stack = make_stack(gpu_workers=2, RESQ_SHUTDOWN_GRACE_S="0")
    request = STOPPING_LONG if fault == "term" else LONG
    r = stack.redis
    seen: dict[str, Any] = {}

    def lose_gpu_worker(response_id: str) -> None:
        owner = generation_field(r, response_id, "owner")
        assert owner, "no GPU worker owns the response"
        victim = stack.role_of(owner)
        if fault == "kill":
            victim.kill()
        elif fault == "term":
            victim.process.terminate()
        else:
            os.kill(victim.process.pid, signal.SIGSTOP)
        seen.update(victim=victim, generated=int(generation_field(r, response_id, "generated") or 0))
        wait_until(lambda: generation_field(r, response_id, "epoch") == "2", RECOVERY_BOUND_S, "a resume")
        seen["resumed_after"] = time.monotonic()
        if fault == "pause":
            os.kill(victim.process.pid, signal.SIGCONT)

    events, _ = stream_with_fault(stack.client(), lose_gpu_worker, **request)
    final = check_stream(events)
    response_id = final["id"]
    assert 0 < seen["generated"] < request["max_output_tokens"], seen
    assert comparable(final) == references(**request), stack.logs()
    # A worker that stops gracefully hands its responses back: that is no loss.
    assert generation_field(r, response_id, "losses") == ("0" if fault == "term" else "1")
    assert generation_field(r, response_id, "state") == "finished"
    survivor = next(worker for worker in stack.gpu_workers if worker is not seen["victim"])
    assert f"resuming {response_id} after" in survivor.log_tail(400)
    if fault == "term":
        assert seen["victim"].process.wait(timeout=60) == 0
        assert f"handed {response_id} back" in seen["victim"].log_tail(400)
    if fault == "pause":
        victim: RoleProcess = seen["victim"]
        wait_until(lambda: "taken over" in victim.log_tail(400), RECOVERY_BOUND_S, "the zombie to notice")
        assert victim.alive()


def test_the_only_gpu_worker_frozen_past_its_ttl_resumes_its_own_job_without_repeats(
    make_stack: StackFactory, references: References
) -> None:
    """The zombie: SIGSTOP the only GPU worker past its TTL (the reaper releases and re-dispatches
    its job), then SIGCONT: it claims its own job again while the old copy is still in its engine.
    The old copy's tokens never reach the stream; three times in a row."""
    stack = make_stack()
    r = stack.redis
    worker = stack.gpu_workers[0]
    for _ in range(3):

        def freeze(response_id: str) -> None:
            os.kill(worker.process.pid, signal.SIGSTOP)
            try:
                # Released as lost by the reaper (its heartbeat lapsed), and sent again.
                wait_until(
                    lambda: generation_field(r, response_id, "losses") == "1", RECOVERY_BOUND_S, "the release"
                )
            finally:
                os.kill(worker.process.pid, signal.SIGCONT)

        events, _ = stream_with_fault(stack.client(), freeze, **LONG)
        final = check_stream(events)
        assert comparable(final) == references(**LONG), stack.logs()
        response_id = final["id"]
        assert generation_field(r, response_id, "state") == "finished"
        assert generation_field(r, response_id, "owner") == worker_id_of(stack, worker)
    assert worker.alive()


def worker_id_of(stack: FaultStack, worker: RoleProcess) -> str:
    """The id a role's heartbeat uses."""
    members = [member.decode() for member in stack.redis.zrange(keys.GPU_WORKERS, 0, -1)]
    return next(member for member in members if member.endswith(f":{worker.process.pid}"))


def test_gpu_worker_killed_with_none_left_fails_the_response(
    make_stack: StackFactory, references: References
) -> None:
    stack = make_stack(postprocess_workers=2)
    r = stack.redis
    killed_at: list[float] = []

    def kill_gpu_worker(response_id: str) -> None:
        stack.gpu_workers[0].kill()
        killed_at.append(time.monotonic())

    events, _ = stream_with_fault(stack.client(), kill_gpu_worker, background=True, **LONG)
    ended_after = time.monotonic() - killed_at[0]
    final = check_stream(events, background=True)
    assert events[-1]["type"] == "response.failed"
    assert final["status"] == "failed"
    assert final["error"]["code"] == "server_error"
    assert "lost" in final["error"]["message"]
    expected_text = output_text({"output": references(**LONG)["output"]})
    assert output_text(final) and expected_text.startswith(output_text(final))
    assert final["output"][0]["status"] == "incomplete"
    assert stored_response(r, final["id"])["status"] == "failed"
    assert ended_after < 3 + 8 + RECOVERY_BOUND_S, f"failed only after {ended_after:.1f}s"

    # A job no GPU worker can take fails too (never stuck in `queued`)...
    with stack.client().responses.create(
        model=MODEL, input="Say hello.", temperature=0, stream=True, background=True
    ) as stream:
        waiting = [as_dict(event) for event in stream]
    never_started = check_stream(waiting, background=True)
    assert [event["type"] for event in waiting] == ["response.created", "response.queued", "response.failed"]
    assert never_started["error"]["code"] == "server_error"

    # ...and once a GPU worker is back, new requests are served.
    stack.start_gpu_worker()
    answer = stack.client().responses.create(model=MODEL, input="Say hello.", temperature=0)
    assert answer.output_text == scenario("hello").completion


def test_a_restarted_gpu_worker_resumes_and_a_lost_message_is_sent_again(
    make_stack: StackFactory, references: References
) -> None:
    stack = make_stack(RESQ_GPU_LOST_TIMEOUT_S="300")
    r = stack.redis

    def restart_gpu_worker(response_id: str) -> None:
        stack.gpu_workers[0].kill()
        stack.start_gpu_worker()

    events, _ = stream_with_fault(stack.client(), restart_gpu_worker, **LONG)
    final = check_stream(events)
    assert comparable(final) == references(**LONG), stack.logs()
    assert generation_field(r, final["id"], "epoch") == "2"

    # No GPU worker runs while a response is accepted, and its Celery message is lost.
    stack.gpu_workers[-1].stop()
    with stack.client().responses.create(
        model=MODEL, input="Say hello.", temperature=0, stream=True, background=True
    ) as stream:
        events = []
        for event in stream:
            events.append(as_dict(event))
            if len(events) == 2:
                assert r.delete(keys.generate_queue(MODEL)) == 1, "the message was not waiting in the queue"
                stack.start_gpu_worker()
    final = check_stream(events, background=True)
    assert output_text(final) == scenario("hello").completion


# --- API processes -------------------------------------------------------------------------------


def test_api_killed_mid_stream_the_client_resumes_on_another(
    make_stack: StackFactory, references: References
) -> None:
    """Inline post-processing: the killed API was also the response's post-processor."""
    stack = make_stack(apis=2)
    first, second = stack.client(0), stack.client(1)
    events: list[dict[str, Any]] = []
    with (
        pytest.raises((openai.APIConnectionError, httpx.HTTPError)),
        first.responses.create(model=MODEL, stream=True, background=True, **LONG) as stream,
    ):
        for event in stream:
            events.append(as_dict(event))
            if count_deltas(events) == DELTAS_BEFORE_FAULT:
                stack.apis[0][0].kill()
    assert events and events[-1]["type"] == "response.output_text.delta"
    response_id = events[0]["response"]["id"]
    with second.responses.retrieve(
        response_id, stream=True, starting_after=events[-1]["sequence_number"]
    ) as resumed:
        events += [as_dict(event) for event in resumed]
    final = check_stream(events, background=True)
    assert comparable(final) == references(**LONG), stack.logs()
    assert "taking over post-processing" in stack.apis[1][0].log_tail(400)


def test_an_api_stopped_by_sigterm_leaves_its_stored_responses_running(
    make_stack: StackFactory, references: References
) -> None:
    """A deploy's SIGTERM of an API is not its clients leaving: a stored foreground stream runs on
    and is resumed on another API, and a non-streaming request still waiting gets a 503 that the
    SDK does not retry (before: the stream's generation was cancelled as the API's graceful
    shutdown ended its task, and the waiting request got a bare 500, which the SDK retried as a
    second generation)."""
    # The GPU worker is paused past the API's graceful shutdown: not for long enough to count as lost.
    stack = make_stack(apis=2, postprocess_workers=1, RESQ_WORKER_TTL_S="60", RESQ_DISPATCH_TIMEOUT_S="60")
    stopped, other = stack.client(0), stack.client(1)
    api, base_url = stack.apis[0]
    waiting: dict[str, Any] = {}

    def wait_for_answer() -> None:
        body = {"model": MODEL, **LONG}
        waiting["reply"] = httpx.post(f"{base_url}/v1/responses", json=body, timeout=120)

    events: list[dict[str, Any]] = []
    gpu = stack.gpu_workers[0]
    answer = threading.Thread(target=wait_for_answer)
    # The stream ends when the stopping API ends it: cut, or closed without its terminal event.
    with (
        contextlib.suppress(openai.APIConnectionError, httpx.HTTPError),
        stopped.responses.create(model=MODEL, stream=True, **LONG) as stream,
    ):
        for event in stream:
            events.append(as_dict(event))
            if count_deltas(events) == DELTAS_BEFORE_FAULT:
                # Paused, the generations outlast the API's graceful shutdown (10 s).
                os.kill(gpu.process.pid, signal.SIGSTOP)
                answer.start()
                time.sleep(1.0)  # the waiting request is accepted (queued behind the pause)
                api.process.terminate()
    assert events[-1]["type"] not in TERMINAL
    answer.join(timeout=60)
    os.kill(gpu.process.pid, signal.SIGCONT)
    # uvicorn raises the signal it caught again once it has shut down.
    assert api.process.wait(timeout=30) in (0, -signal.SIGTERM)
    reply: httpx.Response = waiting["reply"]
    assert reply.status_code == 503, reply.text
    assert reply.headers["x-should-retry"] == "false"
    assert reply.json()["error"]["type"] == "server_error"
    waited_id = reply.json()["error"]["message"].split("response ")[1].split(" ")[0]

    response_id = events[0]["response"]["id"]
    with other.responses.retrieve(
        response_id, stream=True, starting_after=events[-1]["sequence_number"]
    ) as resumed:
        events += [as_dict(event) for event in resumed]
    final = check_stream(events)
    assert comparable(final) == references(**LONG), stack.logs()
    waited = wait_ended(other, waited_id)
    assert waited.status == "incomplete", waited.status  # ran to max_output_tokens, not cancelled
    assert "runs on, for its client to resume elsewhere" in api.log_tail(200)


# --- Redis ---------------------------------------------------------------------------------------


def test_redis_restarted_with_aof_in_flight_responses_continue(
    make_stack: StackFactory, references: References
) -> None:
    stack = make_stack(postprocess_workers=1, append_only=True)

    def restart_redis(response_id: str) -> None:
        stack.redis_server.restart(down_s=1.0)

    events, longest_wait = stream_with_fault(stack.client(), restart_redis, **LONG)
    final = check_stream(events)
    assert comparable(final) == references(**LONG), stack.logs()
    assert longest_wait < RECOVERY_BOUND_S
    # Every role reconnected by itself: a new request goes through all of them.
    answer = stack.client().responses.create(model=MODEL, input="Say hello.", temperature=0)
    assert answer.output_text == scenario("hello").completion
    assert all(role.alive() for role in stack.group.processes)


def test_redis_restarted_without_its_data_processes_reconnect(make_stack: StackFactory) -> None:
    stack = make_stack(postprocess_workers=1)
    ended: list[str] = []

    def restart_redis(response_id: str) -> None:
        stack.redis_server.restart(down_s=1.0)

    # The response in flight is gone with Redis's data: its stream ends (without a terminal
    # event) instead of hanging, and no process is left working on it.
    events: list[dict[str, Any]] = []
    with stack.client().responses.create(model=MODEL, stream=True, **LONG) as stream:
        for event in stream:
            events.append(as_dict(event))
            if count_deltas(events) == DELTAS_BEFORE_FAULT:
                restart_redis(events[0]["response"]["id"])
        ended.append(events[-1]["type"])
    assert ended and ended[0] not in ("response.completed", "response.incomplete")

    # The GPU worker registers its model again, every role beats again: the stack is healthy.
    base_url = stack.apis[0][1]
    wait_until(
        lambda: api_healthy(base_url), RECOVERY_BOUND_S, "health after the restart", stack.group.processes
    )
    answer = stack.client().responses.create(model=MODEL, input="Say hello.", temperature=0)
    assert answer.output_text == scenario("hello").completion
    assert all(role.alive() for role in stack.group.processes)


def test_a_stream_whose_redis_goes_away_ends_without_an_unhandled_error(make_stack: StackFactory) -> None:
    """Redis gone past the clients' retries mid-stream: the body ends without its terminal event,
    and the API logs why (before: an unhandled error of a response already started, with its
    tracebacks)."""
    stack = make_stack(postprocess_workers=1)
    api = stack.apis[0][0]
    events: list[dict[str, Any]] = []
    with (
        contextlib.suppress(openai.APIConnectionError, httpx.HTTPError),
        stack.client().responses.create(
            model=MODEL, stream=True, **{**LONG, "max_output_tokens": 1000}
        ) as stream,
    ):
        for event in stream:
            events.append(as_dict(event))
            if count_deltas(events) == DELTAS_BEFORE_FAULT:
                stack.redis_server.stop()
    assert events[-1]["type"] not in TERMINAL
    wait_until(
        lambda: "its stream ends here" in api.log_tail(400), RECOVERY_BOUND_S, "the relay's end", [api]
    )
    assert "unhandled error" not in api.log_tail(400)
    assert api.alive()


def test_a_socket_answers_an_unreachable_redis_with_an_error_event_and_serves_again(
    make_stack: StackFactory,
) -> None:
    """Over HTTP a request that finds Redis down is a 503 ``server_overloaded``; a WebSocket
    message gets the same as an ``error`` event, and the socket serves its next message once Redis
    is back. (Before, the failure escaped the socket's loop: the server closed the socket with
    1011, and a client that kept it gave up waiting.)"""
    stack = make_stack(postprocess_workers=1)
    with stack.client().responses.connect() as connection:
        connection.response.create(model=MODEL, input="Say hello.", temperature=0)
        assert output_text(check_stream(websocket.until_terminal(connection))) == scenario("hello").completion

        stack.redis_server.stop()
        connection.response.create(model=MODEL, input="Say hello.", temperature=0)
        error = websocket.until_terminal(connection)[-1]
        assert error["type"] == "error", error
        assert (error["status"], error["error"]["code"]) == (503, "server_overloaded")

        stack.redis_server.start()  # empty: the roles reconnect and the GPU worker registers again
        base_url = stack.apis[0][1]
        wait_until(
            lambda: api_healthy(base_url), RECOVERY_BOUND_S, "health after the restart", stack.group.processes
        )
        connection.response.create(model=MODEL, input="Say hello.", temperature=0)
        assert output_text(check_stream(websocket.until_terminal(connection))) == scenario("hello").completion


# --- one request's numbers ---------------------------------------------------------------------


def test_tiny_temperatures_answer_greedily_beside_a_normal_stream(make_stack: StackFactory) -> None:
    """``temperature: 1e-40`` passes validation; divided by it, the logits overflowed, the draw
    from their NaN softmax raised, and the engine died with every response in its batch. Now it
    decodes greedily, its neighbour streams on, and the GPU worker stays up."""
    stack = make_stack()
    events: list[dict[str, Any]] = []
    streaming = threading.Event()

    def neighbour() -> None:
        with stack.client().responses.create(model=MODEL, stream=True, **LONG) as stream:
            for event in stream:
                events.append(as_dict(event))
                if count_deltas(events) == DELTAS_BEFORE_FAULT:
                    streaming.set()

    thread = threading.Thread(target=neighbour, name="neighbour-stream")
    thread.start()
    try:
        assert streaming.wait(RECOVERY_BOUND_S), stack.logs()
        client = stack.client()
        tiny = {
            t: client.responses.create(model=MODEL, input="Say hello.", temperature=t) for t in (1e-40, 1e-30)
        }
        greedy = client.responses.create(model=MODEL, input="Say hello.", temperature=0)
        # The tiny ones ran beside the long stream (it was still generating when they ended).
        assert events[-1]["type"] not in ("response.completed", "response.incomplete", "response.failed")
    finally:
        thread.join(timeout=120)
    assert not thread.is_alive()
    assert greedy.output_text == scenario("hello").completion
    for temperature, answer in tiny.items():
        assert answer.status == "completed", (temperature, answer.error)
        assert answer.output_text == greedy.output_text, temperature
    final = check_stream(events)
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == LONG_TOKENS
    worker = stack.gpu_workers[0]
    assert worker.alive()
    assert "engine failed" not in worker.log_tail(400) and "non-finite" not in worker.log_tail(400)


# --- faults at exact points (RESQ_FAULT_POINT) -------------------------------------------------------


def ended_at_fault_point(role: RoleProcess) -> bool:
    return role.process.poll() == FAULT_EXIT_CODE


def wait_for_fault(role: RoleProcess, point: str) -> None:
    wait_until(lambda: ended_at_fault_point(role), RECOVERY_BOUND_S, f"{role.name} to end at {point}")
    assert f"fault point {point} reached" in role.log_tail(50)


TERMINAL_LOGGED_BOUND_S = 10.0
"""How long a test that saw the final record waits for the terminal event that follows it."""


def logged_events(r: redis.Redis, response_id: str) -> list[dict[str, Any]]:
    """The response's event log once it ends with a terminal event.

    A post-processor writes the final record, then logs the terminal event (the record is what a
    takeover logs it from), so a test that polled the record until it was final can read the log
    a moment before its end: it waits for it, and fails if it never comes.
    """

    def read() -> list[dict[str, Any]]:
        return [
            json.loads(fields[b"data"]) for _, fields in range_entries(r.xrange(keys.events(response_id)))
        ]

    wait_until(
        lambda: (events := read()) != [] and events[-1]["type"] in TERMINAL,
        TERMINAL_LOGGED_BOUND_S,
        f"the terminal event of {response_id} to be logged",
    )
    return read()


@pytest.mark.parametrize("point", ["postprocess.after_final_record", "postprocess.after_conversation_append"])
def test_a_post_processor_ended_between_the_final_record_and_the_terminal_event(
    make_stack: StackFactory, references: References, point: str
) -> None:
    """The final Response is stored (and the conversation holds the items), the terminal event is not
    logged: the takeover logs it, byte for byte what the record says, and appends nothing twice."""
    stack = make_stack(postprocess_workers=1, faulty={"postprocess": point})
    r = stack.redis
    client = stack.client()
    conversation = client.conversations.create(items=[{"role": "user", "content": "Hi."}])
    request = {**LONG, "max_output_tokens": 24}
    started = client.responses.create(model=MODEL, background=True, conversation=conversation.id, **request)
    wait_for_fault(stack.postprocess_workers[0], point)
    assert r.hget(keys.record(started.id), "final") == b"1"
    stack.start_postprocess_worker()
    # The record is final already; the stream ends once the takeover logged the terminal event.
    streamed = [as_dict(event) for event in client.responses.retrieve(started.id, stream=True)]
    check_stream(streamed, background=True)
    final = client.responses.retrieve(started.id)
    events = logged_events(r, started.id)
    assert [(event["sequence_number"], event["type"]) for event in events] == [
        (event["sequence_number"], event["type"]) for event in streamed
    ]
    assert events[-1]["response"] == json.loads(r.hget(keys.record(started.id), "response") or b"{}")
    # The reference is the same prompt sent whole: the conversation's item, then the input.
    seeded = [{"role": "user", "content": "Hi."}, {"role": "user", "content": request["input"]}]
    assert comparable(final.model_dump(mode="json")) == references(**{**request, "input": seeded})
    listed = [item.id for item in client.conversations.items.list(conversation.id, order="asc", limit=100)]
    own_input = client.responses.input_items.list(started.id).data[0].id
    assert listed[1:] == [own_input, *[item.id for item in final.output]]


@pytest.mark.parametrize("point", ["gpu.after_claim", "gpu.after_publish"])
def test_a_gpu_worker_ended_right_after_claiming_or_publishing(
    make_stack: StackFactory, references: References, point: str
) -> None:
    """After a claim (nothing published) or after a publish it never counted: another worker resumes
    from exactly what the stream holds; the stream holds every token once."""
    stack = make_stack(faulty={"gpu": point})
    r = stack.redis
    client = stack.client()
    started = client.responses.create(model=MODEL, background=True, **LONG)
    wait_for_fault(stack.gpu_workers[0], point)
    stack.start_gpu_worker()
    final = wait_ended(client, started.id)
    assert comparable(final.model_dump(mode="json")) == references(**LONG), stack.logs()
    assert generation_field(r, started.id, "losses") == "1"
    events = logged_events(r, started.id)
    check_stream(events, background=True)


def test_an_api_ended_right_after_recording_leaves_a_response_the_other_api_serves(
    make_stack: StackFactory, references: References
) -> None:
    """The API recorded the response, its job and both Celery messages in one step, then died before
    answering: the workers carry the response to its end, and the other API serves all of it."""
    point = "api.after_record"
    stack = make_stack(apis=2, faulty={"api": point})
    r = stack.redis
    with pytest.raises(openai.APIConnectionError):
        stack.client(0).responses.create(model=MODEL, **LONG)
    wait_for_fault(stack.apis[0][0], point)
    recorded = [key.decode() for key in r.scan_iter(match=keys.record("resp_*"))]
    assert len(recorded) == 1, recorded
    response_id = recorded[0].split("{", 1)[1].split("}", 1)[0]
    other = stack.client(1)
    final = wait_ended(other, response_id)
    assert comparable(final.model_dump(mode="json")) == references(**LONG), stack.logs()
    events = [as_dict(event) for event in other.responses.retrieve(response_id, stream=True)]
    check_stream(events)


# --- chat completions ----------------------------------------------------------------------------

CHAT_LONG = {
    "messages": [{"role": "user", "content": "Repeat forever."}],
    "temperature": 0,
    "max_tokens": LONG_TOKENS,
}
"""LONG as a chat completion: the same prompt, so the same greedy text."""


def chat_stream_with_fault(
    client: OpenAI, fault: Callable[[str], None] | None, **overrides: Any
) -> list[dict[str, Any]]:
    """Stream CHAT_LONG with the usage chunk, calling ``fault(response_id)`` after a few content chunks."""
    chunks: list[dict[str, Any]] = []
    faulted = fault is None
    stream = client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **{**CHAT_LONG, **overrides}
    )
    for chunk in stream:
        chunks.append(chunk.model_dump(mode="json"))
        contents = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
        if fault is not None and not faulted and len(contents) >= DELTAS_BEFORE_FAULT:
            fault("resp_" + chunk.id.removeprefix("chatcmpl-"))
            faulted = True
    assert faulted, "the completion ended before the fault"
    return chunks


def _chat_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def check_chat_against(chunks: list[dict[str, Any]], expected: list[dict[str, Any]] | dict[str, Any]) -> None:
    """Every chunk once: the text, the one finish and the usage of the uninterrupted run ``expected``
    (its chunks, or the Responses reference of the same greedy request)."""
    if isinstance(expected, dict):
        text = "".join(
            part["text"]
            for item in expected["output"]
            if item["type"] == "message"
            for part in item["content"]
        )
        finish, tokens = "length", expected["usage"]["output_tokens"]
    else:
        text = _chat_text(expected)
        finish = [c for c in expected if c["choices"]][-1]["choices"][0]["finish_reason"]
        tokens = expected[-1]["usage"]["completion_tokens"]
    assert _chat_text(chunks) == text
    assert [c["choices"][0]["delta"].get("role") for c in chunks if c["choices"]].count("assistant") == 1
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes.count(finish) == 1 and finishes[-1] == finish
    assert len([reason for reason in finishes if reason is not None]) == 1
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == tokens


def test_chat_stream_survives_a_post_process_worker_killed_mid_stream(
    make_stack: StackFactory, references: References
) -> None:
    stack = make_stack(postprocess_workers=2)
    r = stack.redis
    victims: list[RoleProcess] = []

    def kill_post_processor(response_id: str) -> None:
        holder = r.hget(keys.POSTPROCESS_LEASE_HOLDERS, response_id)
        assert holder, "no post-processor holds the completion"
        victims.append(stack.role_of(holder))
        victims[0].kill()
        generated.append(int(generation_field(r, response_id, "generated") or 0))

    generated: list[int] = []
    chunks = chat_stream_with_fault(stack.client(), kill_post_processor)
    assert victims and not victims[0].alive()
    assert generated[0] < LONG_TOKENS, "the generation had ended before the kill"
    check_chat_against(chunks, references(**LONG))
    survivor = next(worker for worker in stack.postprocess_workers if worker.alive())
    assert "taking over post-processing of" in survivor.log_tail(400)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_chat_stream_survives_a_gpu_worker_killed_mid_generation(
    make_stack: StackFactory, references: References, sampling: str
) -> None:
    """Greedy: the text of an uninterrupted run. Seeded (temperature 2): the resumed request draws
    from its seed at the positions it reached, so the text is that of an undisturbed seeded run."""
    stack = make_stack(gpu_workers=2)
    # Longer than LONG: the kill must land before the end even when a loaded machine delivers the
    # first deltas late (150 tokens take 0.6 s here; CI once finished them before the fifth delta).
    budget = {"max_tokens": KILLED_CHAT_TOKENS}
    greedy = {**LONG, "max_output_tokens": KILLED_CHAT_TOKENS}
    seeded = {"temperature": 2.0, "seed": 11} if sampling == "seeded" else {}
    r = stack.redis
    seen: dict[str, Any] = {}

    def kill_gpu_worker(response_id: str) -> None:
        owner = generation_field(r, response_id, "owner")
        assert owner, "no GPU worker owns the completion"
        victim = stack.role_of(owner)
        generated = freeze_then_kill(victim, r, response_id)
        seen.update(victim=victim, response_id=response_id, generated=generated)

        def resumed_or_forgotten() -> bool:
            # A chat completion is not stored: once it ends, its keys go. A seeded answer that
            # ends soon after the resume (45 tokens at temperature 2) can be gone between two
            # polls; the survivor's log, checked after the stream, proves the resume then.
            return generation_field(r, response_id, "epoch") in ("2", None)

        wait_until(resumed_or_forgotten, RECOVERY_BOUND_S, "a resume")

    reference: list[dict[str, Any]] | dict[str, Any] = references(**greedy)
    if seeded:
        reference = chat_stream_with_fault(stack.client(), None, **budget, **seeded)
        assert _chat_text(reference) != output_text(references(**greedy)), "the seeded run drew greedily"
    chunks = chat_stream_with_fault(stack.client(), kill_gpu_worker, **budget, **seeded)
    assert 0 < seen["generated"] < KILLED_CHAT_TOKENS, seen
    check_chat_against(chunks, reference)
    survivor = next(worker for worker in stack.gpu_workers if worker is not seen["victim"])
    assert f"resuming {seen['response_id']} after" in survivor.log_tail(400)
