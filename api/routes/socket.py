"""WebSocket mode: ``GET /v1/responses`` upgraded, one ``response.create`` message per response.

What the SDK's ``client.responses.connect()`` speaks: the client sends
``{"type": "response.create", ...create parameters}`` (``stream`` is implicit,
``background`` is refused); the server answers with the same events as the SSE
stream, each one WebSocket text message, the very bytes the event log holds. Messages
are handled in order, one response in flight per socket: a ``response.create`` sent
while one streams waits its turn (FIFO); one that finds :data:`MESSAGES_AHEAD` waiting is
refused at once with a 429 ``too_many_messages_waiting`` error event (the socket is always
read, so that a close is seen while messages wait). A message that fails gets an ``error`` event with
the HTTP status and OpenAI error the same body gets over HTTP (a 4xx; a 503 while Redis is
unreachable; a 500), and the socket stays usable; so does a response whose relay fails
mid-stream, or that is deleted while it streams (a 404), which ends with such an event.
``previous_response_id`` chains across messages as over HTTP; the socket also keeps its most
recent response in memory when it is ``store: false`` (and in no conversation), so that one can
be continued on the same socket (the Open Responses rule; on another socket, or over HTTP, it is
``previous_response_not_found``). A stored one is continued from the store, as over HTTP. A
continuation that fails (an error event, or a response that ends ``failed``) evicts the response
it named from that memory. With the SDK's ``generate: false`` the response is prepared without
output (Codex's prewarm): a prefill-only job computes its prompt, so that the engine has its pages
cached, and it completes with its input and no output; the next turn continues it by
``previous_response_id``. Messages still waiting when the client
closes the socket are not accepted.

A socket lives ``RESQ_WEBSOCKET_MAX_S`` (an hour, as the Open Responses spec says): then, once
no response streams, the server sends an ``error`` whose code is
``websocket_connection_limit_reached`` and closes it; the client opens a new one.

The same key, rate limit, admission, limits and validation as HTTP: the gate
authenticates the handshake (a bad key: the upgrade is refused with the 401 HTTP gives), and
each message is counted by the key's rate limit (a 429 error event) and runs
:func:`api.submission.accept`. The disconnect rules of a foreground
stream hold: a socket that closes while a response streams cancels its generation
(an unstored one is dropped). Each response's events are in its event log, so a
socket that drops can resume over HTTP (``GET /v1/responses/{id}?stream=true&starting_after=N``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError
from redis.exceptions import RedisError

from api import metrics, stopping
from api.caller import ANONYMOUS, Caller
from api.errors import (
    OpenAIError,
    as_openai_error,
    invalid_value,
    response_not_found,
    validation_error_to_openai,
)
from api.foreground import client_left, forget_unstored
from api.gate import caller_of, check_rate
from api.relay import coalesced_when_behind, follow_event_batches
from api.schemas import CreateResponseRequest, not_utf8
from api.state import AppState
from api.store import EarlierConversation
from api.submission import Accepted, accept
from resq import jsonutil
from resq.events.types import TERMINAL_TYPES

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1")

CREATE = "response.create"
SOCKET_ONLY_FIELDS = ("type", "stream_id", "generate")
"""Keys of a ``response.create`` message that are not create parameters."""
CLOSED = object()
SERVICE_RESTART = 1012
"""The close code uvicorn sends its sockets as it shuts down."""
"""What the reader queues when the client closed the socket."""
MESSAGES_AHEAD = 4
"""Messages read and waiting while a response streams; one more is refused (a 429 error event),
so a client that pipelines requests holds at most this many bodies in the API's memory, not as
many as it sends: 200 messages of 1 MiB sent while a response streamed raised the API's RSS by
210 MB at its peak without a bound, by 10 MB with one."""


def error_event(error: OpenAIError, stream_id: str | None = None) -> dict[str, Any]:
    """The ``error`` server event for ``error`` (the socket stays open)."""
    event: dict[str, Any] = {"type": "error", "status": error.status_code, **error.body()}
    if stream_id is not None:
        event["stream_id"] = stream_id
    return event


def create_request(message: Any) -> tuple[CreateResponseRequest, str | None]:
    """The create request a client message carries, and its ``stream_id``; an OpenAIError otherwise."""
    if not isinstance(message, dict):
        raise invalid_value(
            "A WebSocket message must be a JSON object: this one is not an object, is not JSON, or "
            "nests too deep to read.",
            None,
            "invalid_json",
        )
    if message.get("type") != CREATE:
        raise invalid_value(
            f"Unsupported message type {message.get('type')!r}: this server takes {CREATE!r}.", "type"
        )
    stream_id = message.get("stream_id")
    if stream_id is not None and not isinstance(stream_id, str):
        raise invalid_value("'stream_id' must be a string.", "stream_id")
    if stream_id is not None and not_utf8(stream_id):
        raise invalid_value("'stream_id' is not valid Unicode (a lone surrogate).", "stream_id")
    generate = message.get("generate")
    if generate is not None and not isinstance(generate, bool):
        raise invalid_value("'generate' must be a boolean.", "generate", "invalid_type")
    if message.get("background"):
        raise invalid_value("'background' is not supported over WebSocket; use HTTP.", "background")
    stream = message.get("stream")
    if stream is not None and stream is not True:  # false, or not a boolean at all (1 == True)
        raise invalid_value("Responses over WebSocket always stream: send no 'stream'.", "stream")
    body = {key: value for key, value in message.items() if key not in SOCKET_ONLY_FIELDS}
    body["stream"] = True
    try:
        return CreateResponseRequest.model_validate(body), stream_id
    except ValidationError as exc:
        raise validation_error_to_openai(exc.errors()) from None


def echoable(stream_id: Any) -> str | None:
    """A message's ``stream_id`` as its error events echo it: a string JSON can carry, else none."""
    return stream_id if isinstance(stream_id, str) and not not_utf8(stream_id) else None


def with_stream_id(data: bytes, stream_id: str | None) -> str:
    """An event's JSON as sent: as logged, with the request's ``stream_id`` when it gave one.

    The key is spliced in before the object's closing brace (every logged event is a non-empty
    object), so no event is parsed and encoded again on the way out.
    """
    if stream_id is None:
        return data.decode()
    return (data[:-1] + b',"stream_id":' + jsonutil.dumps(stream_id) + b"}").decode()


class Socket:
    """One client socket: a reader that queues messages, and responses streamed one at a time."""

    def __init__(self, websocket: WebSocket, state: AppState, caller: Caller) -> None:
        self._websocket = websocket
        self._state = state
        self._caller = caller
        self._messages: asyncio.Queue[Any] = asyncio.Queue(maxsize=MESSAGES_AHEAD)
        self._closed = asyncio.Event()
        self._sending = asyncio.Lock()
        self._close_code: int | None = None
        """The close code of the disconnect, once read (1012: the server restarting)."""
        self._history: dict[str, EarlierConversation] = {}
        """The socket's most recent response, by id, when it is unstored (and in no conversation):
        continued from memory, where HTTP cannot find it. A stored one is continued from the store,
        as over HTTP, which sees it deleted, or refuses a conversation's response."""

    async def serve(self) -> None:
        """Handle messages until the client closes the socket, or it reaches its time limit."""
        reader = asyncio.create_task(self._read())
        deadline = time.monotonic() + self._state.settings.websocket_max_s
        try:
            while True:
                try:
                    message = await asyncio.wait_for(
                        self._messages.get(), max(0.0, deadline - time.monotonic())
                    )
                except TimeoutError:
                    await self._close_at_limit()
                    return
                if message is CLOSED or self._closed.is_set():
                    # Messages still queued when the client closed have nobody to answer: not accepted.
                    return
                try:
                    await self._handle(message)
                except (WebSocketDisconnect, RuntimeError):
                    if not self._closed.is_set():
                        raise
                    return  # a send met the closed socket: the client left, nothing to log
                if time.monotonic() >= deadline:
                    await self._close_at_limit()
                    return
        finally:
            reader.cancel()

    async def _close_at_limit(self) -> None:
        limit = OpenAIError(
            400,
            f"This WebSocket reached its limit of {self._state.settings.websocket_max_s:g} s; open a new one.",
            code="websocket_connection_limit_reached",
        )
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await self._send(error_event(limit))
            await self._websocket.close(code=1000)

    async def _read(self) -> None:
        try:
            while True:
                message = await self._websocket.receive()
                if message["type"] == "websocket.disconnect":
                    self._close_code = message.get("code")
                    break
                try:
                    # A binary frame is read as UTF-8 text (some clients send their JSON that way;
                    # Starlette's receive_text() raised KeyError on one, which ended this reader and
                    # left the socket unanswered until its time limit).
                    text = message.get("text")
                    if text is None:
                        text = (message.get("bytes") or b"").decode()
                    # Parsed as FastAPI parses an HTTP body (integers of any size stay integers), so
                    # that a message and a body are refused for the same numbers (check_raw_body).
                    parsed: Any = json.loads(text)
                except (ValueError, RecursionError):  # not UTF-8 or not JSON; nested past recursion
                    parsed = None  # answered with invalid_json, in its turn
                if self._messages.full():
                    # Refused now rather than left unread: a reader that waits for room stops
                    # reading the socket, and a close behind the waiting messages went unseen (the
                    # streaming generation ran on, and the messages queued were answered).
                    await self._refuse_waiting(parsed)
                    continue
                self._messages.put_nowait(parsed)
        except (WebSocketDisconnect, RuntimeError):
            pass
        except Exception:  # a bug here must close the socket, never leave it unanswered
            log.exception("reading a WebSocket failed; closing it")
        self._closed.set()
        await self._messages.put(CLOSED)

    async def _refuse_waiting(self, message: Any) -> None:
        """Answer a message that found :data:`MESSAGES_AHEAD` waiting: not accepted (a 429)."""
        refused = OpenAIError(
            429,
            f"{MESSAGES_AHEAD} messages already wait on this WebSocket while a response streams; "
            "this one was not accepted: send it once a response has ended.",
            type="requests",
            code="too_many_messages_waiting",
        )
        stream_id = message.get("stream_id") if isinstance(message, dict) else None
        await self._send(error_event(refused, echoable(stream_id)))

    async def _handle(self, message: Any) -> None:
        stream_id = message.get("stream_id") if isinstance(message, dict) else None
        previous = message.get("previous_response_id") if isinstance(message, dict) else None
        with metrics.request_timed():  # what the response's time to first token counts from
            await self._create(message, stream_id, previous)

    async def _create(self, message: Any, stream_id: Any, previous: Any) -> None:
        echoed = echoable(stream_id)
        try:
            # Each message is a request: the key's rate limit counts it (the handshake is not), as
            # HTTP's gate does, before the message is read. Refused there, it evicts nothing: the
            # client sends it again, on from the same response.
            await check_rate(self._state, self._caller)
        except OpenAIError as limited:
            await self._send(error_event(limited, echoed))
            return
        try:
            request, stream_id = create_request(message)
            # `generate: false`: the prompt is computed, no output generated (a later turn continues it).
            generate = message.get("generate") is not False
            accepted = await accept(
                self._state, request, self._caller, self._history, follow=True, generate=generate
            )
        except Exception as failure:
            # The answer HTTP gives the same body: a 4xx, or a 503 while Redis is unreachable, or a
            # 500; here as an error event, and the socket stays usable.
            if isinstance(previous, str):
                self._history.pop(previous, None)
            await self._send(error_event(as_openai_error(failure), echoed))
            return
        final = await self._stream(accepted, stream_id)
        if final is None or final.get("status") == "failed":
            if isinstance(previous, str):
                self._history.pop(previous, None)
            return
        remembered = not accepted.store and request.conversation_id is None
        self._history = (
            {
                accepted.response_id: EarlierConversation(
                    accepted.conversation, final.get("output", []), linked=False
                )
            }
            if remembered
            else {}
        )

    async def _stream(self, accepted: Accepted, stream_id: str | None) -> dict[str, Any] | None:
        """Relay the response to its terminal event; its final Response (None: the client left)."""
        streaming = asyncio.create_task(self._relay(accepted, stream_id))
        closed = asyncio.create_task(self._closed.wait())
        try:
            done, _ = await asyncio.wait({streaming, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        failure = streaming.exception() if streaming in done else None
        if streaming in done and failure is None:
            if not accepted.store:
                await self._best_effort(forget_unstored(self._state, accepted.response_id), accepted)
            return streaming.result()
        if failure is not None and not self._closed.is_set():
            # The relay failed and the socket did not (Redis went away mid-stream): over HTTP the
            # body would end there; a socket has no end of body, so its client is told, and the
            # rest of the response, which it will not get, stops as a leaving client's would.
            await self._best_effort(client_left(self._state, accepted), accepted)
            await self._send(error_event(as_openai_error(failure), stream_id))
            return None
        streaming.cancel()
        streaming.add_done_callback(_relay_ended)
        log.info("socket closed while %s streamed", accepted.response_id)
        # Closed by this process as it stops (uvicorn sends 1012, "service restart"): the client
        # did not leave.
        stopped_by_server = stopping.is_stopping() and self._close_code == SERVICE_RESTART
        await self._best_effort(
            client_left(self._state, accepted, stopped_by_server=stopped_by_server), accepted
        )
        return None

    async def _best_effort(self, cleanup: Awaitable[None], accepted: Accepted) -> None:
        """Stop or drop ``accepted`` (:mod:`api.foreground`), without ending the socket if Redis is
        unreachable: then a generation runs to its end, and an unstored response's keys to their TTL."""
        try:
            await cleanup
        except RedisError as error:
            log.warning("could not stop or drop %s: %s", accepted.response_id, error)

    async def _relay(self, accepted: Accepted, stream_id: str | None) -> dict[str, Any] | None:
        last: bytes | None = None
        # One message per event: a slow reader blocks the sends, so its next batch is long.
        followed = follow_event_batches(self._state.redis, accepted.response_id, opened=accepted.opened)
        # Measured after merging, as an SSE stream is: delivered, output tokens, TTFT, active streams.
        batches = metrics.measured_batches(
            coalesced_when_behind(followed, self._state.settings.sse_coalesce_after)
        )
        async for batch in batches:
            for _, data in batch:
                await self._send_text(with_stream_id(data, stream_id))
                last = data
        ended: dict[str, Any] | None = jsonutil.loads(last) if last is not None else None
        if ended is None or ended.get("type") not in TERMINAL_TYPES:
            # The log ended without its terminal event: the response was deleted (or expired)
            # while it streamed. Over HTTP the body ends; a socket's client is told.
            raise response_not_found(accepted.response_id)
        final: dict[str, Any] | None = ended.get("response")
        return final

    async def _send(self, event: dict[str, Any]) -> None:
        await self._send_text(jsonutil.dumps(event).decode())

    async def _send_text(self, text: str) -> None:
        try:
            async with self._sending:  # the reader's refusals and the relay's events, whole frames
                await self._websocket.send_text(text)
        except (WebSocketDisconnect, RuntimeError):
            self._closed.set()
            raise


def _relay_ended(relay: asyncio.Task[Any]) -> None:
    """Take the end of a relay whose socket closed (asyncio logs an end nobody took as an error).

    A send that met the closed socket is how such a relay usually ends: every client that closed
    its socket mid-stream logged "Task exception was never retrieved" with two tracebacks.
    Anything else is a fault of the relay, logged as one.
    """
    if relay.cancelled():
        return
    error = relay.exception()
    if error is not None and not isinstance(error, WebSocketDisconnect | RuntimeError):
        log.error("relaying to a closed socket failed", exc_info=error)


@router.websocket("/responses")
async def responses_socket(websocket: WebSocket) -> None:
    """WebSocket mode of ``POST /v1/responses`` (``client.responses.connect()``)."""
    state: AppState = websocket.app.state.resq
    caller = caller_of(websocket.scope) or (ANONYMOUS if state.keyring.open else None)
    if caller is None:  # the gate authenticates every /v1 handshake; fail closed all the same
        await websocket.close(code=1008)
        return
    await websocket.accept()
    await Socket(websocket, state, caller).serve()
