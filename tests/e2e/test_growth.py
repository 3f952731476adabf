"""No unbounded growth in Redis: every per-response key expires, and unstored responses leave nothing.

Both tests run a stack on a Redis server of their own, so that its key space and its
memory figures are resq's alone.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.conftest import MODEL
from tests.fixture_model import scenario
from tests.support.processes import START_TIMEOUT_S, ProcessGroup, api_healthy, free_port, wait_until
from tests.support.redis_server import PrivateRedis

pytestmark = pytest.mark.e2e

GLOBAL_KEYS = {
    b"resq:models",
    b"resq:models:served",
    b"resq:workers:gpu",
    b"resq:workers:postprocess",
    b"resq:generations",
    b"resq:{leases}:postprocess",
    b"resq:{leases}:postprocess:holders",
}
"""Keys without a TTL by design: bounded (one entry per model, live worker or response in flight)."""


def _is_global(key: bytes) -> bool:
    # Celery/kombu's own bookkeeping (queue bindings, unacked messages) and the tokenizers
    # (one per model) are bounded too.
    return key in GLOBAL_KEYS or key.startswith((b"_kombu.", b"unacked", b"resq:tokenizer:"))


@pytest.fixture
def private_stack(tmp_path: Path, fixture_model_dir: Path) -> Iterator[tuple[str, redis.Redis]]:
    """A GPU worker, one post-process worker and an API on a private Redis."""
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    group = ProcessGroup(
        tmp_path,
        {
            "RESQ_REDIS_URL": server.url,
            "RESQ_MODEL": str(fixture_model_dir),
            "RESQ_MODEL_NAME": MODEL,
            "RESQ_POSTPROCESS_WORKERS": "1",
            "RESQ_KV_CACHE_TOKENS": "16384",
        },
    )
    try:
        gpu = group.start("gpu-worker", "gpu")
        worker = group.start("postprocess-worker", "postprocess")
        port = free_port()
        api = group.start("api", "api", RESQ_PORT=str(port))
        base_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: api_healthy(base_url), START_TIMEOUT_S, "the stack", [gpu, worker, api])
        client = server.client()
        yield base_url, client
        client.close()
    finally:
        group.stop_all()
        server.stop()


def _create(http: httpx.Client, base_url: str, **body: Any) -> httpx.Response:
    reply = http.post(f"{base_url}/v1/responses", json={"model": MODEL, "temperature": 0, **body})
    reply.raise_for_status()
    return reply


def _settled(client: redis.Redis) -> bool:
    """Nothing in flight: no generation listed, no post-process lease, no queued message."""
    return (
        client.zcard("resq:generations") == 0
        and client.zcard("resq:{leases}:postprocess") == 0
        and client.llen(f"generate:{MODEL}") == 0
        and client.llen("postprocess") == 0
    )


def test_every_key_of_a_response_expires(private_stack: tuple[str, redis.Redis]) -> None:
    base_url, client = private_stack
    with httpx.Client(timeout=120) as http:
        _create(http, base_url, input="Say hello.")
        _create(http, base_url, input="Say hello.", store=False)
        with http.stream(
            "POST",
            f"{base_url}/v1/responses",
            json={"model": MODEL, "input": "Count to twenty.", "stream": True, "store": False},
        ) as reply:
            body = reply.read()
        assert b"response.completed" in body
        background = _create(http, base_url, input="Say hello.", background=True).json()
        wait_until(
            lambda: client.hget(f"resq:{{{background['id']}}}:response", "status") == b"completed",
            120,
            "the background response",
        )
    wait_until(lambda: _settled(client), 60, "the stack to settle")
    without_ttl = [key for key in client.scan_iter(count=1000) if client.ttl(key) < 0 and not _is_global(key)]
    assert without_ttl == []
    # Two stored responses remain (plain and background); the unstored ones left nothing.
    response_keys = {key.split(b"}")[0] for key in client.scan_iter(match="resq:{resp_*", count=1000)}
    assert len(response_keys) == 2


UNSTORED_RESPONSES = int(os.environ.get("RESQ_GROWTH_RESPONSES", "10000"))
CONCURRENCY = 32


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
def test_redis_memory_returns_to_baseline_after_many_unstored_responses(
    private_stack: tuple[str, redis.Redis],
) -> None:
    """``RESQ_GROWTH_RESPONSES`` (default 10,000) ``store=false`` responses, 32 at a time.

    Each is cut at 3 output tokens: what is measured is the keys a response leaves
    behind, which does not depend on its length.
    """
    base_url, client = private_stack
    expected = scenario("hello").completion
    with httpx.Client(timeout=300, limits=httpx.Limits(max_connections=CONCURRENCY)) as http:
        lock = threading.Lock()
        failures: list[str] = []

        def work(counter: Iterator[int]) -> None:
            while True:
                with lock:
                    if next(counter, None) is None:
                        return
                try:
                    reply = _create(
                        http, base_url, input="Say hello.", store=False, max_output_tokens=3
                    ).json()
                    text = reply["output"][0]["content"][0]["text"]
                    if reply["status"] != "incomplete" or not text or not expected.startswith(text):
                        failures.append(str(reply)[:200])
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))

        def run(count: int) -> float:
            counter = iter(range(count))
            started = time.monotonic()
            threads = [threading.Thread(target=work, args=(counter,)) for _ in range(CONCURRENCY)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert failures == []
            wait_until(lambda: _settled(client), 120, "the stack to settle")
            return time.monotonic() - started

        # Warm up at full concurrency: every global structure and every connection pool
        # reaches its working size before the baseline is taken.
        run(4 * CONCURRENCY)
        baseline_keys = set(client.scan_iter(count=1000))
        baseline = client.info("memory")
        elapsed = run(UNSTORED_RESPONSES)

    after_keys = set(client.scan_iter(count=1000))
    after = client.info("memory")
    report = ", ".join(
        f"{name} {baseline[name]} -> {after[name]} ({after[name] - baseline[name]:+d})"
        for name in ("used_memory", "used_memory_dataset", "mem_clients_normal")
    )
    print(
        f"\n{UNSTORED_RESPONSES} store=false responses in {elapsed:.0f}s "
        f"({UNSTORED_RESPONSES / elapsed:.1f}/s); keys {len(baseline_keys)} -> {len(after_keys)}; {report}"
    )
    assert after_keys == baseline_keys
    grown = after["used_memory"] - baseline["used_memory"]
    assert grown < 256 * 1024, f"Redis grew by {grown} bytes: {report}"


CHAIN_TURNS = 200
CHAIN_CHECKPOINTS = (50, 100, 150, 200)


def _chain_bytes(client: redis.Redis) -> int:
    """``MEMORY USAGE`` summed over every per-response and per-conversation key."""
    return sum(
        int(client.memory_usage(key) or 0)
        for key in client.scan_iter(count=1000)
        if not _is_global(key) and key.startswith((b"resq:{resp_", b"resq:{conv_", b"resq:itemholders:"))
    )


def test_a_long_chain_and_a_long_conversation_cost_linear_memory(
    private_stack: tuple[str, redis.Redis],
) -> None:
    """200 turns by ``previous_response_id`` and 200 in a conversation: each turn is stored once.

    Printed (``-s``): the bytes at each checkpoint, and what storing each response's whole
    conversation (the layout before turns) would have held: the JSON of every turn's history.
    """
    base_url, client = private_stack
    rows: list[tuple[int, int, int]] = []
    whole_layout = 0
    history_bytes = 0
    with httpx.Client(timeout=120) as http:
        previous: str | None = None
        for index in range(1, CHAIN_TURNS + 1):
            body: dict[str, Any] = {"input": "Say hello.", "max_output_tokens": 4, "truncation": "auto"}
            if previous is not None:
                body["previous_response_id"] = previous
            created = _create(http, base_url, **body).json()
            previous = created["id"]
            history_bytes += len(b'{"type":"message","role":"user","content":"Say hello."}') + len(
                httpx.Response(200, json=created["output"]).content
            )
            whole_layout += history_bytes
            if index in CHAIN_CHECKPOINTS:
                wait_until(lambda: _settled(client), 60, "the stack to settle")
                rows.append((index, _chain_bytes(client), whole_layout))
        chain_bytes = _chain_bytes(client)
        conversation = http.post(f"{base_url}/v1/conversations", json={}).json()["id"]
        for _ in range(CHAIN_TURNS):
            _create(
                http,
                base_url,
                input="Say hello.",
                max_output_tokens=4,
                truncation="auto",
                conversation=conversation,
            )
        wait_until(lambda: _settled(client), 60, "the stack to settle")
        listed = http.get(f"{base_url}/v1/conversations/{conversation}/items", params={"limit": 1}).json()
        assert listed["has_more"]
    conversation_bytes = _chain_bytes(client) - chain_bytes
    print("\nturns  stored bytes  bytes/turn  whole-conversation layout (history JSON alone)")
    for turns, stored, whole in rows:
        print(f"{turns:5d}  {stored:12d}  {stored // turns:10d}  {whole:12d}")
    print(
        f"conversation of {CHAIN_TURNS} turns: {conversation_bytes} bytes ({conversation_bytes // CHAIN_TURNS}/turn)"
    )
    # Linear: the last 50 turns cost about what the first 50 did (a quadratic layout: 7x).
    increments = [later[1] - earlier[1] for earlier, later in itertools.pairwise(rows)]
    first_block = rows[0][1]
    assert all(increment < 1.5 * first_block for increment in increments), rows
    assert conversation_bytes < 1.5 * chain_bytes
