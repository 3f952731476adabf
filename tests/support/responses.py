"""Waiting on a response over the API, as a client polling it would."""

from __future__ import annotations

import time

from openai import OpenAI
from openai.types.responses import Response

UNFINISHED = ("queued", "in_progress")


def wait_ended(client: OpenAI, response_id: str, timeout_s: float = 120.0, poll_s: float = 0.1) -> Response:
    """The response once its status is no longer ``queued`` or ``in_progress``; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in UNFINISHED:
            return response
        assert time.monotonic() < deadline, f"{response_id} did not end within {timeout_s:g}s"
        time.sleep(poll_s)
