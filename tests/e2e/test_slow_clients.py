"""A stream client that falls behind gets its pending deltas merged (api/coalesce.py); one that
keeps up gets every event as logged.

The slow client is a real TCP client whose socket holds little: a small receive buffer and
a small MSS, set before it connects (the server's send buffer grows with the MSS the client
announces; over loopback's 64 KiB MSS it would swallow megabytes, the whole stream). It stops
reading after the first delta until the response has ended, so the API's writes block and
the relay's follower piles up the rest of the stream. Nothing here depends on timing: the
response ends while the client reads nothing, whatever the machine's load.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx
import pytest

from tests.e2e.conftest import MODEL, Stack
from tests.support.conformance import check_events
from tests.support.invariants import output_text
from tests.support.responses import wait_ended

pytestmark = pytest.mark.e2e

WAIT_S = 240.0
"""Upper bound for anything to happen on a loaded two-core machine (never reached when it works)."""
LONG = {
    "model": MODEL,
    "input": "Repeat forever.",
    "temperature": 0,
    "max_output_tokens": 900,
    "include": ["message.output_text.logprobs"],
    "stream": True,
}
"""About 900 deltas with their logprobs: some 220 KB of SSE, more than twice what the slow socket holds."""
RECEIVE_BUFFER = 1
"""The client's SO_RCVBUF: the kernel raises it to its floor (a few KB)."""
SEGMENT = 200
"""The client's TCP_MAXSEG: the server's send buffer then holds some 25 KB, not megabytes (with
these two, measured over loopback; the API's own write buffer adds 64 KB)."""
FAST_ATTEMPTS = 3
"""Tries of the fast client: a loaded machine may let the post-processor fall behind and log a
burst of deltas in one write, which is lag too (merged); it cannot happen three times running."""
DELTA = "response.output_text.delta"
TERMINAL = ("response.completed", "response.incomplete", "response.failed")

RawEvent = tuple[str, bytes]


def _parse_frames(buffer: bytes) -> tuple[list[RawEvent | None], bytes]:
    """The complete SSE frames at the start of ``buffer`` (None for ``[DONE]``), and the rest."""
    frames: list[RawEvent | None] = []
    while b"\n\n" in buffer:
        frame, buffer = buffer.split(b"\n\n", 1)
        event_type, data = "", b""
        for line in frame.split(b"\n"):
            if line.startswith(b"event: "):
                event_type = line[len(b"event: ") :].decode()
            elif line.startswith(b"data: "):
                data = line[len(b"data: ") :]
        if data == b"[DONE]":
            frames.append(None)
        elif data:  # a comment (ping) has no data
            frames.append((event_type, data))
    return frames, buffer


class SlowStream:
    """``POST /v1/responses`` over a socket that holds little, read only when asked to."""

    def __init__(self, base_url: str, body: dict[str, Any]) -> None:
        url = urlsplit(base_url)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Before connect: the MSS is announced in the SYN, the window is sized from the buffer.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, SEGMENT)
        self._sock.settimeout(WAIT_S)
        self._sock.connect((url.hostname, url.port))
        self._http = h11.Connection(h11.CLIENT)
        payload = json.dumps(body).encode()
        request = h11.Request(
            method="POST",
            target="/v1/responses",
            headers=[
                ("Host", url.netloc),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(payload))),
                ("Connection", "close"),
            ],
        )
        for message in (request, h11.Data(data=payload), h11.EndOfMessage()):
            self._sock.sendall(self._http.send(message) or b"")
        self._buffer = b""

    def events(self) -> Iterator[RawEvent]:
        """The stream's events as they are read (a few KB per read), up to ``[DONE]``."""
        while True:
            message = self._http.next_event()
            if message is h11.NEED_DATA:
                self._http.receive_data(self._sock.recv(4096))
            elif isinstance(message, h11.Response):
                assert message.status_code == 200, message
            elif isinstance(message, h11.Data):
                frames, self._buffer = _parse_frames(self._buffer + bytes(message.data))
                for frame in frames:
                    if frame is None:
                        return
                    yield frame
            elif isinstance(message, h11.EndOfMessage | h11.ConnectionClosed):
                raise AssertionError("the stream ended without [DONE]")

    def close(self) -> None:
        self._sock.close()


def _sse_events(reply: httpx.Response) -> list[RawEvent]:
    """Every event of an SSE reply, read as fast as it comes, up to ``[DONE]``."""
    assert reply.status_code == 200, reply.read()
    events: list[RawEvent] = []
    event_type = ""
    for line in reply.iter_lines():
        if line.startswith("event: "):
            event_type = line[len("event: ") :]
        elif line == "data: [DONE]":
            return events
        elif line.startswith("data: "):
            events.append((event_type, line[len("data: ") :].encode()))
    raise AssertionError("the stream ended without [DONE]")


def _replay(stack: Stack, response_id: str, starting_after: int | None = None) -> list[RawEvent]:
    """The response's log as ``GET ?stream=true`` replays it (the catch-up: exact)."""
    params: dict[str, Any] = {"stream": "true"}
    if starting_after is not None:
        params["starting_after"] = starting_after
    with (
        httpx.Client(timeout=WAIT_S) as http,
        http.stream("GET", f"{stack.base_url}/v1/responses/{response_id}", params=params) as reply,
    ):
        return _sse_events(reply)


def _decoded(events: list[RawEvent]) -> list[dict[str, Any]]:
    decoded = [json.loads(data) for _, data in events]
    assert [event["type"] for event in decoded] == [kind for kind, _ in events]
    return decoded


def _coalesced_total(stack: Stack) -> float:
    text = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("resq_sse_deltas_coalesced_total "):
            return float(line.split()[1])
    raise AssertionError("the API exports no resq_sse_deltas_coalesced_total")


def _check_against_the_log(received: list[RawEvent], log: list[RawEvent]) -> None:
    """Each received event stands for the logged events since the one before it, exactly.

    An event sent as logged is the log's bytes at its ``sequence_number``; a merged delta is
    the run of logged deltas it replaced, one item, one part, their text concatenated. So a
    client resuming after any ``sequence_number`` it saw loses and repeats nothing.
    """
    logged = _decoded(log)
    assert [event["sequence_number"] for event in logged] == list(range(len(logged)))
    previous = -1
    for (kind, data), event in zip(received, _decoded(received), strict=True):
        number = event["sequence_number"]
        covered = logged[previous + 1 : number + 1]
        assert covered, f"sequence number {number} after {previous}"
        if number == previous + 1:
            assert (kind, data) == log[number], "an event sent alone differs from the log's bytes"
        else:
            assert kind == DELTA and {item["type"] for item in covered} == {DELTA}, (previous, number)
            assert {(item["item_id"], item["content_index"]) for item in covered} == {
                (event["item_id"], event["content_index"])
            }
            assert event["delta"] == "".join(item["delta"] for item in covered)
            assert event["logprobs"] == [entry for item in covered for entry in item["logprobs"]]
        previous = number
    assert previous == len(log) - 1, "the stream ended before the log's last event"


def test_a_slow_client_gets_its_backlog_of_deltas_merged_and_a_fast_one_every_delta(stack: Stack) -> None:
    client = stack.client()
    coalesced_before = _coalesced_total(stack)

    slow = SlowStream(stack.base_url, LONG)
    try:
        events = slow.events()
        head: list[RawEvent] = []
        for event in events:
            head.append(event)
            if event[0] == DELTA:
                break
        response_id = json.loads(head[0][1])["response"]["id"]
        # The client reads nothing until the response has ended: the API's writes block
        # meanwhile, and every event logged since waits in the relay's follower.
        ended = wait_ended(client, response_id, timeout_s=WAIT_S)
        received = head + list(events)
    finally:
        slow.close()

    log = _replay(stack, response_id)
    decoded = _decoded(received)
    check_events(decoded)  # merged deltas are valid events too (Open Responses, strict SDK models)
    numbers = [event["sequence_number"] for event in decoded]
    assert numbers == sorted(set(numbers)), "sequence numbers must strictly increase"
    assert received[-1] == log[-1] and received[-1][0] in TERMINAL

    final = decoded[-1]["response"]
    assert final["status"] == ended.status == "incomplete"
    text = output_text(final)
    assert text == ended.output_text and len(text) > 0
    deltas = [event for event in decoded if event["type"] == DELTA]
    logged_deltas = [kind for kind, _ in log if kind == DELTA]
    print(f"slow client: {len(deltas)} delta events for {len(logged_deltas)} logged deltas")
    assert len(deltas) < len(logged_deltas) <= final["usage"]["output_tokens"]
    assert "".join(event["delta"] for event in deltas) == text
    final_logprobs = final["output"][0]["content"][0]["logprobs"]
    assert [entry for event in deltas for entry in event["logprobs"]] == [
        {key: entry[key] for key in ("token", "logprob", "top_logprobs")} for entry in final_logprobs
    ]
    _check_against_the_log(received, log)
    assert _coalesced_total(stack) - coalesced_before == len(log) - len(received)

    # Resuming right after a merged delta gives the rest of the text: nothing lost, nothing twice.
    merged_at = next(index for index in range(1, len(numbers)) if numbers[index] != numbers[index - 1] + 1)
    resumed = _decoded(_replay(stack, response_id, starting_after=numbers[merged_at]))
    seen = "".join(event["delta"] for event in deltas if event["sequence_number"] <= numbers[merged_at])
    assert seen + "".join(event["delta"] for event in resumed if event["type"] == DELTA) == text

    # A client that keeps up, same request: every delta as logged, the replay byte for byte.
    fast_runs: list[tuple[int, int]] = []
    for _ in range(FAST_ATTEMPTS):
        with (
            httpx.Client(timeout=WAIT_S) as http,
            http.stream("POST", f"{stack.base_url}/v1/responses", json=LONG) as reply,
        ):
            fast = _sse_events(reply)
        fast_log = _replay(stack, json.loads(fast[0][1])["response"]["id"])
        fast_deltas = sum(1 for kind, _ in fast if kind == DELTA)
        fast_runs.append((fast_deltas, sum(1 for kind, _ in fast_log if kind == DELTA)))
        if fast == fast_log:
            break
    else:
        raise AssertionError(f"a fast client had deltas merged in every try: (sent, logged) {fast_runs}")
    print(f"fast client: (sent, logged) deltas per try {fast_runs}")
    assert output_text(_decoded(fast)[-1]["response"]) == text
