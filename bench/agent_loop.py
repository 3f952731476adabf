"""B6: an agent loop (Codex-style), prefix caching on vs off and WebSocket vs HTTP SSE, paired per round.

Asked for as "B5: agent loop"; B5 already names the structured-outputs case (:mod:`bench.structured`),
so this one is B6 (:data:`SCENARIO`) and its records never mix with B5's.

One loop is ``turns`` (10) streaming creates with a growing history, the way a coding agent drives
the Responses API: every turn resends the same long ``instructions`` (~1,600 tokens, as Codex
resends its own), the same ``prompt_cache_key``, ``previous_response_id`` of the turn before, and a
new input of ~150 tokens: a user message first, then a ``function_call`` with its
``function_call_output`` (the tool call the agent ran; the random model writes text, so the call is
echoed with its output), greedy, ``max_output_tokens`` 16. The turn-10 prompt (~3,750-3,980
tokens) fills the bench model's 4,096-token context.

Per turn: TTFT (request sent to the first ``response.output_text.delta``) and
``usage.input_tokens_details.cached_tokens``. Three systems, each one loop per round, in an order
rotated between rounds (:func:`bench.stats.alternated`):

- ``prefix-on``: HTTP SSE on a stack with prefix caching on (the default);
- ``prefix-off``: HTTP SSE on a stack with ``RESQ_PREFIX_CACHING=false``;
- ``prefix-on-ws``: the same loop over one WebSocket (``GET /v1/responses`` upgraded, one
  ``response.create`` message per turn, :mod:`api.routes.socket`) on the ``prefix-on`` stack; the loop's
  time includes opening the socket, while the HTTP loops reuse a warm keep-alive client;
- ``prefix-on-ws-prewarmed``: that WebSocket loop as Codex opens a session: first a ``generate: false``
  message with the instructions alone (the prewarm, which computes them into the engine's cache while
  a user would still be typing), then the turns, the first one continuing the prewarm. Its loop time
  leaves the prewarm out (timed apart, ``prewarm_s``); HTTP / it is reported beside the like-for-like
  HTTP / WebSocket ratio, which the target is judged on.

Ratios are medians of per-round ratios (:meth:`bench.results.ResultSet.per_round_ratios`): turn-10
TTFT off / on (target >= 3x), whole loop HTTP / WebSocket (target >= 1.2x). The shared prefix of
turn k is turn k-1's whole prompt (turn k's prompt repeats it verbatim, then adds the previous
answer and the new input); the engine shares whole KV pages (``RESQ_KV_PAGE_SIZE``), so the target
is ``cached_tokens`` >= the whole pages of that prefix.

Every loop starts its instructions with a session tag: KV blocks are hashed as a chain from the first
token, so nothing a loop caches serves another loop (a warm-up, an earlier round); only its own
history is reused. The two HTTP loops of a round share their tag (they run on stacks of their own,
so they send the very same requests); the WebSocket loop, on the prefix-on stack, has its own. The
two stacks run on private redis-servers of their own.

The model is the bench model (:func:`bench.models.ensure_bench`) with the tokens that stream no text
of their own silenced the way its EOS is (:func:`ensure_text_model`): greedy, the random model
otherwise often repeats a byte piece that is no whole UTF-8 character, which the detokenizer holds
back for good, and such an answer streams no ``response.output_text.delta`` (no TTFT to see). Same
weights otherwise, so every step costs the same.

``python -m bench.agent_loop`` (``make bench-agent``) runs it and prints the figures.
"""

from __future__ import annotations

import asyncio
import functools
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
import orjson
from websockets.asyncio.client import ClientConnection, connect

from bench.clients import _data_of, _Frames
from bench.models import BenchModel, _build_locked, _copy_tokenizer, _silence_eos, ensure_bench, ensure_tiny
from bench.procs import ProcGroup
from bench.report import Table, Target, fmt, fmt_paired, fmt_ratio, to_markdown
from bench.results import ResultSet, RunRecord
from bench.stats import alternated, median, ratio
from bench.systems import KV_PAGE_SIZE, ResqStack
from resq.embedded_redis import EmbeddedRedis

SCENARIO = "B6"
ON = "prefix-on"
OFF = "prefix-off"
WS = "prefix-on-ws"
WS_PREWARMED = "prefix-on-ws-prewarmed"
SYSTEMS = (ON, OFF, WS, WS_PREWARMED)
TTFT_TARGET = 3.0
"""Turn-10 TTFT, prefix caching off / on, at least."""
WS_TARGET = 1.2
"""Whole loop, HTTP SSE / WebSocket, at least."""
CACHED_TARGET = 1.0
"""Turn-10 ``cached_tokens`` / whole pages of the shared prefix, at least."""
TURN_TIMEOUT_S = 300.0
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
DELTA = "response.output_text.delta"
TOOL_NAME = "shell"


@dataclass(frozen=True)
class LoopShape:
    """The size of one loop."""

    turns: int = 10
    instructions_chars: int = 6000
    """~1,600 tokens of the bench tokenizer (~0.26 token per character of its own corpus)."""
    turn_chars: int = 540
    """120-185 tokens of new text per turn (~230-270 with the tool call, the tags and the previous answer):
    the turn-10 prompt is ~3,980 tokens, just inside the bench model's 4,096-token context."""
    max_output_tokens: int = 16


# --- the model: the bench model, answering text only -----------------------------------------------

TEXT_BUILD_VERSION = "1"


def silent_token_ids(tokenizer: Any) -> list[int]:
    """Tokens that stream no text of their own: special and markup tokens, and byte pieces that are
    no whole UTF-8 character (the detokenizer holds those back for good, so a greedy random model
    stuck on one streams no ``response.output_text.delta`` at all, and TTFT could not be seen)."""
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    silent = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        piece = tokenizer.decode([token_id], skip_special_tokens=False)
        if not piece or "\ufffd" in piece or piece in special:
            silent.append(token_id)
    return silent


def ensure_text_model(cache_dir: Path, base: BenchModel) -> BenchModel:
    """``base`` with :func:`silent_token_ids` made unreachable the way its EOS is (rows zeroed).

    Same architecture, size and weights, so every step costs what it costs on ``base``; only which
    token greedy decoding picks changes: every answer streams text from its first token.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(base.path / "tokenizer.json"))
    silent = silent_token_ids(tokenizer)

    def build(out: Path) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base.path)
        _silence_eos(model, silent)
        model.save_pretrained(out)
        _copy_tokenizer(base.path, out)

    path = _build_locked(cache_dir / f"{base.path.name}-text-{TEXT_BUILD_VERSION}", build)
    description = f"{base.description}; its {len(silent)} tokens that stream no text silenced like EOS"
    return BenchModel(base.key, path, description)


# --- what a loop sends (pure) ----------------------------------------------------------------------


@functools.cache
def corpus() -> str:
    """Deterministic English prose: the text the bench tokenizer was trained on (pydoc's topics)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def instructions(session: str, shape: LoopShape) -> str:
    """The loop's long, fixed instructions, led by its session tag (see the module docstring)."""
    return f"Session {session}. You are a coding agent.\n\n" + corpus()[: shape.instructions_chars]


def turn_text(turn: int, shape: LoopShape) -> str:
    """The new text of ``turn`` (0-based): a slice of the corpus after the instructions' one."""
    start = shape.instructions_chars + turn * shape.turn_chars
    return corpus()[start : start + shape.turn_chars]


def turn_input(turn: int, shape: LoopShape) -> list[dict[str, Any]]:
    """``turn``'s new input items: a user message first, then a tool call and its output."""
    text = turn_text(turn, shape)
    if turn == 0:
        return [{"role": "user", "content": text}]
    call_id = f"call_{turn}"
    arguments = json.dumps({"command": ["sed", "-n", f"{turn * 40},{turn * 40 + 39}p", "notes.txt"]})
    return [
        {"type": "function_call", "call_id": call_id, "name": TOOL_NAME, "arguments": arguments},
        {"type": "function_call_output", "call_id": call_id, "output": text},
    ]


def create_params(
    model: str, session: str, turn: int, previous_response_id: str | None, shape: LoopShape
) -> dict[str, Any]:
    """The create parameters of ``turn`` (no ``stream``: HTTP adds it, a socket's is implicit)."""
    params: dict[str, Any] = {
        "model": model,
        "instructions": instructions(session, shape),
        "input": turn_input(turn, shape),
        "prompt_cache_key": f"bench-agent-{session}",
        "max_output_tokens": shape.max_output_tokens,
        "temperature": 0,
    }
    if previous_response_id is not None:
        params["previous_response_id"] = previous_response_id
    return params


def resent_params(
    model: str, session: str, turn: int, history: list[dict[str, Any]], shape: LoopShape
) -> dict[str, Any]:
    """``turn``'s parameters as Codex sends them: ``store: false`` and the whole conversation again
    (``history``: the earlier turns' inputs and outputs), no ``previous_response_id``."""
    params = create_params(model, session, turn, None, shape)
    return {**params, "input": [*history, *params["input"]], "store": False}


# --- what a loop measures ----------------------------------------------------------------------------


class AgentLoopError(RuntimeError):
    """A turn that did not complete (an HTTP error, an ``error`` event, a failed response)."""


@dataclass(frozen=True)
class Turn:
    """What one turn measured."""

    ttft_s: float | None
    """Request sent to the first ``response.output_text.delta`` (None: the answer had no text)."""
    total_s: float
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    response_id: str
    output: tuple[dict[str, Any], ...] = ()
    """The response's output items (what a client that resends its history sends back)."""


class TurnReader:
    """Follows one turn's events (SSE frames or socket messages, parsed) to its terminal one."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.first_delta: float | None = None

    def feed(self, event: dict[str, Any], now: float) -> Turn | None:
        """The turn, once ``event`` ends it; raises :class:`AgentLoopError` when it failed."""
        kind = event.get("type")
        if kind == DELTA:
            if self.first_delta is None:
                self.first_delta = now
            return None
        if kind == "error":
            raise AgentLoopError(f"error event: {json.dumps(event)[:400]}")
        if kind not in TERMINAL:
            return None
        response = event.get("response") or {}
        if kind == "response.failed":
            raise AgentLoopError(f"response failed: {json.dumps(response.get('error'))[:400]}")
        usage = response.get("usage") or {}
        details = usage.get("input_tokens_details") or {}
        return Turn(
            ttft_s=None if self.first_delta is None else self.first_delta - self.sent,
            total_s=now - self.sent,
            input_tokens=int(usage.get("input_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens", 0)),
            output_tokens=int(usage.get("output_tokens", 0)),
            response_id=str(response.get("id", "")),
            output=tuple(response.get("output") or ()),
        )


@dataclass(frozen=True)
class LoopRun:
    """One loop of one system in one round."""

    system: str
    round_index: int
    turns: list[Turn]
    wall_s: float
    """First request sent (socket opened, for WebSocket) to the last turn's terminal event."""
    prewarm_s: float | None = None
    """The prewarm's own time (socket opened to its terminal event), left out of ``wall_s``."""

    def shared_prefix(self, turn: int) -> int:
        """Tokens ``turn`` shares with what the previous turn computed: the previous prompt (0 first)."""
        return self.turns[turn - 1].input_tokens if turn > 0 else 0

    def record(self, model: str) -> RunRecord:
        """The loop as a bench record (per-turn lists as samples, the last turn as metrics)."""
        last = len(self.turns) - 1
        shared = self.shared_prefix(last)
        pages = shared // KV_PAGE_SIZE * KV_PAGE_SIZE
        metrics: dict[str, float] = {
            "loop_s": self.wall_s,
            **({"prewarm_s": self.prewarm_s} if self.prewarm_s is not None else {}),
            "last_input_tokens": float(self.turns[last].input_tokens),
            "last_cached_tokens": float(self.turns[last].cached_tokens),
            "last_shared_tokens": float(shared),
        }
        ttft = self.turns[last].ttft_s
        if ttft is not None:
            metrics["last_ttft_ms"] = ttft * 1000
        if pages:
            metrics["last_cached_of_pages"] = self.turns[last].cached_tokens / pages
        if self.turns[last].input_tokens:
            metrics["last_cached_fraction"] = self.turns[last].cached_tokens / self.turns[last].input_tokens
        samples = {
            "ttft_ms": [float("nan") if t.ttft_s is None else t.ttft_s * 1000 for t in self.turns],
            "total_ms": [t.total_s * 1000 for t in self.turns],
            "input_tokens": [float(t.input_tokens) for t in self.turns],
            "cached_tokens": [float(t.cached_tokens) for t in self.turns],
            "output_tokens": [float(t.output_tokens) for t in self.turns],
        }
        return RunRecord(SCENARIO, self.system, model, 1, self.round_index, metrics=metrics, samples=samples)


def event_of_frame(frame: bytes) -> dict[str, Any] | None:
    """The event an SSE frame carries (None: a ping, or the ``data: [DONE]`` after the terminal one)."""
    data = _data_of(frame)
    if not data.startswith(b"{"):
        return None
    event: dict[str, Any] = orjson.loads(data)
    return event


async def http_turn(client: httpx.AsyncClient, base_url: str, params: dict[str, Any]) -> Turn:
    """One streaming ``POST /v1/responses``, timed to its terminal event and read to its end (so the
    keep-alive connection goes back to the pool, as an SDK's does)."""
    reader = TurnReader(time.perf_counter())
    frames = _Frames()
    found: Turn | None = None
    async with client.stream("POST", f"{base_url}/v1/responses", json={**params, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            raise AgentLoopError(f"HTTP {response.status_code}: {response.text[:400]}")
        async for chunk in response.aiter_raw():
            now = time.perf_counter()
            for frame in frames.feed(chunk):
                event = event_of_frame(frame)
                if found is None and event is not None:
                    found = reader.feed(event, now)
    if found is None:
        raise AgentLoopError("the stream ended before a terminal event")
    return found


async def http_loop(
    client: httpx.AsyncClient, base_url: str, model: str, session: str, shape: LoopShape, resend: bool = False
) -> tuple[list[Turn], float]:
    """The loop over HTTP SSE; its turns and wall time. ``resend``: every turn sends the whole
    conversation again, unstored (:func:`resent_params`), instead of ``previous_response_id``."""
    started = time.perf_counter()
    turns: list[Turn] = []
    previous: str | None = None
    history: list[dict[str, Any]] = []
    for turn in range(shape.turns):
        if resend:
            params = resent_params(model, session, turn, history, shape)
        else:
            params = create_params(model, session, turn, previous, shape)
        found = await asyncio.wait_for(http_turn(client, base_url, params), TURN_TIMEOUT_S)
        turns.append(found)
        previous = found.response_id
        history = [*params["input"], *found.output]
    return turns, time.perf_counter() - started


async def ws_turn(socket: ClientConnection, params: dict[str, Any]) -> Turn:
    """One ``response.create`` message on ``socket``, followed to its terminal event."""
    reader = TurnReader(time.perf_counter())
    await socket.send(orjson.dumps({"type": "response.create", **params}).decode())
    while True:
        text = await socket.recv()
        found = reader.feed(orjson.loads(text), time.perf_counter())
        if found is not None:
            return found


async def ws_loop(
    base_url: str, model: str, session: str, shape: LoopShape, prewarm: bool = False
) -> tuple[list[Turn], float, float | None]:
    """The loop over one WebSocket (opened inside the timed span); its turns, wall time, and with
    ``prewarm`` the time of a ``generate: false`` of the instructions alone sent first (not in the
    wall time, which then starts at the first turn)."""
    url = "ws" + base_url.removeprefix("http") + "/v1/responses"
    started = time.perf_counter()
    turns: list[Turn] = []
    previous: str | None = None
    prewarm_s: float | None = None
    async with connect(url, max_size=None, open_timeout=60) as socket:
        if prewarm:
            params = create_params(model, session, 0, None, shape)
            params.update(input=[], generate=False)
            del params["max_output_tokens"], params["temperature"]
            warmed = await asyncio.wait_for(ws_turn(socket, params), TURN_TIMEOUT_S)
            previous = warmed.response_id
            prewarm_s = time.perf_counter() - started
            started = time.perf_counter()
        for turn in range(shape.turns):
            params = create_params(model, session, turn, previous, shape)
            found = await asyncio.wait_for(ws_turn(socket, params), TURN_TIMEOUT_S)
            turns.append(found)
            previous = found.response_id
    return turns, time.perf_counter() - started, prewarm_s


# --- the result: pairing, tables, verdicts (pure) -----------------------------------------------------


def ttft_ratios(results: ResultSet, model: str) -> list[float]:
    """Turn-10 TTFT off / on of each round (both loops ran in it, back to back)."""
    return results.per_round_ratios(SCENARIO, OFF, ON, "last_ttft_ms", model)


def ws_ratios(results: ResultSet, model: str) -> list[float]:
    """Whole-loop time HTTP / WebSocket of each round."""
    return results.per_round_ratios(SCENARIO, ON, WS, "loop_s", model)


def prewarmed_ratios(results: ResultSet, model: str, counted: bool = False) -> list[float]:
    """Whole-loop time HTTP / the WebSocket loop after Codex's prewarm, per round; ``counted``: the
    prewarm's time added to that loop's."""
    rounds = sorted({r.round for r in results.matching(SCENARIO, WS_PREWARMED, model)})
    values = []
    for index in rounds:
        http = _metric(results, ON, model, index, "loop_s")
        loop = _metric(results, WS_PREWARMED, model, index, "loop_s")
        prewarm = _metric(results, WS_PREWARMED, model, index, "prewarm_s") or 0.0
        value = ratio(http, None if loop is None else loop + (prewarm if counted else 0.0))
        if value is not None:
            values.append(value)
    return values


def _median_or_none(values: Sequence[float]) -> float | None:
    return median(values) if values else None


def agent_targets(results: ResultSet, model: str) -> list[Target]:
    """B6's targets on ``model``: TTFT off / on, cached pages of the shared prefix, HTTP / WebSocket."""
    cached = [
        record.metrics["last_cached_of_pages"]
        for record in results.matching(SCENARIO, ON, model)
        if "last_cached_of_pages" in record.metrics
    ]
    return [
        Target(f"{SCENARIO} {model}: last-turn TTFT, prefix caching off / on (median of per-round ratios)", _median_or_none(ttft_ratios(results, model)), TTFT_TARGET, "min", "x"),
        Target(f"{SCENARIO} {model}: last-turn cached_tokens / whole pages of the shared prefix (median of rounds)", _median_or_none(cached), CACHED_TARGET, "min", "x"),
        Target(f"{SCENARIO} {model}: whole loop, HTTP SSE / WebSocket (median of per-round ratios)", _median_or_none(ws_ratios(results, model)), WS_TARGET, "min", "x"),
    ]  # fmt: skip


def _metric(results: ResultSet, system: str, model: str, round_index: int, metric: str) -> float | None:
    for record in results.matching(SCENARIO, system, model):
        if record.round == round_index and metric in record.metrics:
            return record.metrics[metric]
    return None


def round_ratio(
    results: ResultSet, model: str, numerator: str, denominator: str, metric: str, round_index: int
) -> float | None:
    """``numerator / denominator`` of ``metric`` in one round (the pair :meth:`ResultSet.per_round_ratios` takes)."""
    return ratio(
        _metric(results, numerator, model, round_index, metric),
        _metric(results, denominator, model, round_index, metric),
    )


def rounds_table(results: ResultSet, model: str, orders: dict[int, list[str]] | None = None) -> Table:
    """Per round: last-turn TTFT of both stacks, its cached tokens, both loops' times; medians last."""
    rounds = sorted({r.round for r in results.records if r.scenario == SCENARIO and r.model == model})
    rows = []
    for index in rounds:
        cached = fmt(_metric(results, ON, model, index, "last_cached_tokens"), 0)
        shared = fmt(_metric(results, ON, model, index, "last_shared_tokens"), 0)
        cached_off = fmt(_metric(results, OFF, model, index, "last_cached_tokens"), 0)
        rows.append(
            [
                str(index + 1),
                " > ".join((orders or {}).get(index, [])) or "-",
                fmt(_metric(results, OFF, model, index, "last_ttft_ms")),
                fmt(_metric(results, ON, model, index, "last_ttft_ms")),
                fmt_ratio(round_ratio(results, model, OFF, ON, "last_ttft_ms", index)),
                f"{cached} / {shared} (off: {cached_off})",
                fmt(_metric(results, ON, model, index, "loop_s"), 2),
                fmt(_metric(results, WS, model, index, "loop_s"), 2),
                fmt_ratio(round_ratio(results, model, ON, WS, "loop_s", index)),
            ]
        )

    def med(system: str, metric: str, digits: int = 1) -> str:
        return fmt(results.scalar(SCENARIO, system, metric, model), digits)

    rows.append(
        [
            "median",
            "",
            med(OFF, "last_ttft_ms"),
            med(ON, "last_ttft_ms"),
            fmt_paired(ttft_ratios(results, model)),
            f"{med(ON, 'last_cached_tokens', 0)} / {med(ON, 'last_shared_tokens', 0)}",
            med(ON, "loop_s", 2),
            med(WS, "loop_s", 2),
            fmt_paired(ws_ratios(results, model)),
        ]
    )
    headers = [
        "round", "order", "last TTFT off ms", "on ms", "off / on",
        "last cached / shared prefix", "loop HTTP s", "loop WS s", "HTTP / WS",
    ]  # fmt: skip
    return Table(f"{SCENARIO} agent loop on {model}: per round (ratios paired per round)", headers, rows)


def _turn_median(results: ResultSet, system: str, model: str, sample: str, turn: int) -> float | None:
    values = [
        record.samples[sample][turn]
        for record in results.matching(SCENARIO, system, model)
        if len(record.samples.get(sample, [])) > turn
        and record.samples[sample][turn] == record.samples[sample][turn]
    ]
    return _median_or_none(values)


def turns_table(results: ResultSet, model: str) -> Table:
    """Per turn, medians over rounds: prompt, shared prefix, cached tokens, TTFT of each system."""
    counts = [
        len(record.samples.get("ttft_ms", [])) for record in results.records if record.scenario == SCENARIO
    ]
    rows = []
    for turn in range(max(counts, default=0)):
        prompt = _turn_median(results, ON, model, "input_tokens", turn)
        shared = _turn_median(results, ON, model, "input_tokens", turn - 1) if turn else 0.0
        cached = _turn_median(results, ON, model, "cached_tokens", turn)
        rows.append(
            [
                str(turn + 1),
                fmt(prompt, 0),
                fmt(shared, 0),
                fmt(cached, 0),
                f"{cached / prompt * 100:.0f}%" if cached is not None and prompt else "-",
                f"{cached / shared * 100:.0f}%" if cached is not None and shared else "-",
                fmt(_turn_median(results, OFF, model, "cached_tokens", turn), 0),
                fmt(_turn_median(results, OFF, model, "ttft_ms", turn)),
                fmt(_turn_median(results, ON, model, "ttft_ms", turn)),
                fmt(_turn_median(results, WS, model, "ttft_ms", turn)),
                fmt(_turn_median(results, WS_PREWARMED, model, "ttft_ms", turn)),
            ]
        )
    headers = [
        "turn", "prompt tokens", "shared prefix", "cached (on)", "cached / prompt", "cached / shared",
        "cached (off)", "TTFT off ms", "TTFT on ms", "TTFT on WS ms", "TTFT on WS, prewarmed ms",
    ]  # fmt: skip
    return Table(f"{SCENARIO} agent loop on {model}: per turn (medians over rounds)", headers, rows)


def verdict_lines(results: ResultSet, model: str) -> list[str]:
    """Each target with what was measured (per-round values where paired) and its verdict, then the
    prewarmed WebSocket loop's ratios (not a target: the like-for-like loop is)."""
    paired = {0: fmt_paired(ttft_ratios(results, model)), 2: fmt_paired(ws_ratios(results, model))}
    lines = []
    for index, target in enumerate(agent_targets(results, model)):
        measured = paired.get(index) or fmt_ratio(target.measured)
        lines.append(f"{target.name}: {measured}, target >= {target.bound:g}x: {target.verdict()}")
    if results.matching(SCENARIO, WS_PREWARMED, model):
        lines.append(
            f"{SCENARIO} {model}: whole loop, HTTP SSE / WebSocket after Codex's prewarm (generate: false at "
            f"the session's start), prewarm not timed: {fmt_paired(prewarmed_ratios(results, model))}; "
            f"timed: {fmt_paired(prewarmed_ratios(results, model, counted=True))}; first-turn TTFT "
            f"{fmt(_turn_median(results, WS_PREWARMED, model, 'ttft_ms', 0))} ms against "
            f"{fmt(_turn_median(results, WS, model, 'ttft_ms', 0))} ms without it (medians of rounds)"
        )
    return lines


def session_tag(run: str, round_index: int, system: str) -> str:
    """The session of one loop: the two HTTP loops of a round send the very same requests (they run on
    stacks of their own); the WebSocket loop, on the prefix-on stack, gets its own, so it reuses
    nothing the HTTP loop cached there."""
    return f"{run}-r{round_index}" + {WS: "-ws", WS_PREWARMED: "-wsp"}.get(system, "")


# --- running it ------------------------------------------------------------------------------------


@dataclass
class AgentRun:
    """Both stacks, and every loop run on them."""

    model: str
    shape: LoopShape
    on: ResqStack
    off: ResqStack
    results: ResultSet = field(default_factory=ResultSet)
    orders: dict[int, list[str]] = field(default_factory=dict)

    async def one(
        self, client: httpx.AsyncClient, system: str, session: str
    ) -> tuple[list[Turn], float, float | None]:
        """One loop of ``system`` (a fresh session)."""
        name = self.on.model.served_name
        if system in (WS, WS_PREWARMED):
            turns, wall, prewarm_s = await ws_loop(
                self.on.base_url, name, session, self.shape, prewarm=system == WS_PREWARMED
            )
            return turns, wall, prewarm_s
        stack = self.on if system == ON else self.off
        turns, wall = await http_loop(client, stack.base_url, name, session, self.shape)
        return turns, wall, None

    async def measure(self, rounds: int, on_run: Callable[[LoopRun], None]) -> None:
        """A warm-up loop of every system, then ``rounds`` rounds of one loop each, order rotated."""
        tag = f"{int(time.time())}"
        async with httpx.AsyncClient(timeout=httpx.Timeout(TURN_TIMEOUT_S, connect=60.0)) as client:
            for system in SYSTEMS:
                await self.one(client, system, session_tag(tag, -1, system))
            for round_index in range(rounds):
                order = alternated(list(SYSTEMS), round_index)
                self.orders[round_index] = order
                for system in order:
                    turns, wall, prewarm_s = await self.one(
                        client, system, session_tag(tag, round_index, system)
                    )
                    run = LoopRun(system, round_index, turns, wall, prewarm_s)
                    self.results.add(run.record(self.model))
                    on_run(run)


def _echo_run(run: LoopRun) -> None:
    ttft = [fmt(None if t.ttft_s is None else t.ttft_s * 1000, 0) for t in run.turns]
    cached = [str(t.cached_tokens) for t in run.turns]
    prewarm = f" (after a {run.prewarm_s:.2f} s prewarm)" if run.prewarm_s is not None else ""
    click.echo(
        f"round {run.round_index + 1}: {run.system:13s} loop {run.wall_s:6.2f} s{prewarm}; "
        f"TTFT ms per turn {', '.join(ttft)}; cached {', '.join(cached)}"
    )


@click.command()
@click.option("--model", type=click.Choice(["tiny", "bench"]), default="bench", show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--turns", type=int, default=LoopShape.turns, show_default=True)
@click.option("--instructions-chars", type=int, default=LoopShape.instructions_chars, show_default=True)
@click.option("--turn-chars", type=int, default=LoopShape.turn_chars, show_default=True)
@click.option("--max-output-tokens", type=int, default=LoopShape.max_output_tokens, show_default=True)
def main(
    model: str, rounds: int, turns: int, instructions_chars: int, turn_chars: int, max_output_tokens: int
) -> None:
    """An agent loop: prefix caching on vs off (per-turn TTFT, cached tokens) and WebSocket vs HTTP SSE."""
    shape = LoopShape(turns, instructions_chars, turn_chars, max_output_tokens)
    cache = Path.home() / ".cache" / "resq" / "bench-models"
    served = ensure_text_model(cache, ensure_bench(cache) if model == "bench" else ensure_tiny(cache))
    redis_on, redis_off = EmbeddedRedis(), EmbeddedRedis()
    group = ProcGroup(Path(tempfile.mkdtemp(prefix="resq-bench-agent-")))
    on = ResqStack(group, redis_on.url, served)
    off = ResqStack(group, redis_off.url, served, gpu_worker_env={"RESQ_PREFIX_CACHING": "false"})
    try:
        redis_on.start()
        redis_off.start()
        on.start()
        off.start()
        on.wait_ready()
        off.wait_ready()
        click.echo(
            f"model {served.key}: {served.description}; {shape.turns} turns, instructions "
            f"{shape.instructions_chars} chars, {shape.turn_chars} chars per turn, "
            f"max_output_tokens {shape.max_output_tokens}; logs in {group.log_dir}"
        )
        run = AgentRun(served.key, shape, on, off)
        asyncio.run(run.measure(rounds, _echo_run))
        click.echo("")
        click.echo(to_markdown(rounds_table(run.results, served.key, run.orders)))
        click.echo("")
        click.echo(to_markdown(turns_table(run.results, served.key)))
        click.echo("")
        for line in verdict_lines(run.results, served.key):
            click.echo(line)
    finally:
        group.stop_all()
        redis_off.stop()
        redis_on.stop()


if __name__ == "__main__":
    main()
