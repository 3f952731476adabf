"""Runs a :class:`~bench.plan.Plan`: starts the systems, alternates them round by round, records everything."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import platform
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import psutil
from redis import Redis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench import capacity, clients, cpu_accounting, postprocess, structured
from bench.clients import StreamTiming
from bench.models import BenchModel, ensure_bench, ensure_tiny
from bench.plan import Plan
from bench.procs import ProcGroup, free_port, http_ok, wait_until
from bench.results import ResultSet, RunRecord
from bench.stats import alternated
from bench.systems import DirectEngine, Floor, HttpSystems, ResqStack, TransformersServe, resq_env
from bench.token_streams import make_streams
from resq import keys
from resq.celery_app import make_celery
from resq.embedded_redis import EmbeddedRedis
from resq.settings import load_settings

WARMUP_CONCURRENCY = 8
WARMUP_TOKENS = 16


def warm_up_widths(plan: Plan) -> tuple[int, ...]:
    """The warm-up rounds' client counts: a narrow one, then the widest the measured rounds use.

    The first 32-client round of resq ran 35% below its others when the warm-up was 8 wide:
    batches that wide (their shapes, allocations, the engine's first full batch) were first
    seen in a measured round.
    """
    widest = max((*plan.b1_concurrencies, *plan.b4_concurrencies, WARMUP_CONCURRENCY))
    return (WARMUP_CONCURRENCY, widest) if widest > WARMUP_CONCURRENCY else (WARMUP_CONCURRENCY,)


B3_TIMEOUT_S = 300.0
CAPACITY_TIMEOUT_S = 180.0


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _git_commit(root: Path) -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        # A copy of the tree without its history (the GPU check's device machine) says it here.
        return os.environ.get("RESQ_BENCH_COMMIT", "unknown")


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def redis_server_version(info: dict[str, Any]) -> str:
    """The server's version from its ``INFO server``; a fork's own name and version first
    (Valkey answers ``redis_version`` 7.2.4, the Redis it is compatible with)."""
    redis_version = str(info.get("redis_version", "?"))
    name = info.get("server_name")
    if isinstance(name, str) and name != "redis" and f"{name}_version" in info:
        return f"{name} {info[f'{name}_version']} (as Redis {redis_version})"
    return redis_version


class BenchRun:
    """One execution of a plan; :meth:`run` returns every record."""

    def __init__(
        self,
        plan: Plan,
        run_dir: Path,
        console: Console,
        redis_url: str | None = None,
        redis_server: str | None = None,
    ) -> None:
        """``redis_url``: a Redis database to use (flushed); else a private server of
        ``redis_server``'s binary (the bundled redis-server when unset)."""
        self.plan = plan
        self.run_dir = run_dir
        self.console = console
        self.results = ResultSet()
        self._redis_url = redis_url
        self._redis_server = redis_server
        self._group = ProcGroup(run_dir / "logs")
        self._progress: Progress | None = None
        self._task: Any = None
        self._runner: asyncio.Runner | None = None
        self._b7_unmeasured = False

    # --- plumbing ------------------------------------------------------------------------------

    def note(self, message: str) -> None:
        """A line above the progress bar."""
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}")

    def _step(self, description: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=description)
            if not self.console.is_terminal:
                # No live bar in a log file or a pipe: one line per step instead.
                done = int(self._progress.tasks[0].completed)
                self.note(f"[{done}/{self.plan.runs()}] {description}")

    def _advance(self) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)

    def _await(self, coroutine: Any) -> Any:
        assert self._runner is not None
        return self._runner.run(coroutine)

    @contextlib.contextmanager
    def _redis(self) -> Iterator[str]:
        if self._redis_url is not None:
            client = Redis.from_url(self._redis_url)
            client.flushdb()
            client.close()
            yield self._redis_url
            return
        server = EmbeddedRedis(binary=self._redis_server)
        server.start()
        try:
            yield server.url
        finally:
            server.stop()

    def _context(self, redis_url: str, models: list[BenchModel]) -> dict[str, Any]:
        import torch
        import transformers

        info = Redis.from_url(redis_url).info("server")
        return {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "commit": _git_commit(Path(__file__).resolve().parents[1]),
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "load_before": [round(value, 2) for value in os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "redis_server": redis_server_version(info),
            "plan": asdict(self.plan),
            "models": {model.key: model.description for model in models},
        }

    # --- the run -------------------------------------------------------------------------------

    def run(self) -> ResultSet:
        """Run every scenario of the plan; the records, also saved under the run directory."""
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        )
        with progress, self._redis() as redis_url, asyncio.Runner(loop_factory=_uvloop_factory()) as runner:
            self._progress = progress
            self._task = progress.add_task("building models", total=self.plan.runs())
            self._runner = runner
            try:
                models = self._models()
                self.results.context = self._context(redis_url, models)
                scenarios = set(self.plan.scenarios)
                for model in models:
                    compare = model.key in self.plan.models and bool({"B1", "B2"} & scenarios)
                    api_cpu = model.key == "tiny" and "B4" in scenarios
                    if compare or api_cpu:
                        self._http_part(redis_url, model, compare, api_cpu)
                tiny = next(model for model in models if model.key == "tiny")
                if "B3" in self.plan.scenarios:
                    self._b3(redis_url, tiny)
                if "B4" in self.plan.scenarios:
                    self._capacity(redis_url, tiny)
                if "B5" in self.plan.scenarios:
                    for model in models:
                        if model.key in self.plan.models:
                            self._b5(redis_url, model)
            finally:
                self._group.stop_all()
                self.results.context["load_after"] = [round(value, 2) for value in os.getloadavg()]
                self.results.save(self.run_dir / "results.json")
        return self.results

    def _models(self) -> list[BenchModel]:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "resq" / "bench-models"
        keys_wanted = set(self.plan.models) | {"tiny"}
        models = []
        if "tiny" in keys_wanted:
            models.append(ensure_tiny(cache))
        if "bench" in keys_wanted:
            self._step("building the bench model")
            models.append(ensure_bench(cache))
        for model in models:
            self.note(f"model [bold]{model.key}[/bold]: {model.description} ({model.path})")
        return [model for model in models if model.key in self.plan.models or model.key == "tiny"]

    # --- B1, B2, B4 (API CPU): everything that needs the model served -------------------------------

    def _http_part(self, redis_url: str, model: BenchModel, compare: bool, api_cpu: bool) -> None:
        """B1 and B2 (``compare``) and B4's API CPU (``api_cpu``) on ``model``, all systems up at once."""
        plan = self.plan
        up = HttpSystems(
            stack=ResqStack(self._group, redis_url, model, postprocess_workers=plan.postprocess_workers),
            direct=DirectEngine(self._group, redis_url, model) if compare else None,
            upstream=DirectEngine(self._group, redis_url, model, upstream=True) if compare else None,
            serve=TransformersServe(self._group, model) if compare and plan.with_serve else None,
            serve_defaults=(
                TransformersServe(self._group, model, own_defaults=True)
                if compare and plan.with_serve
                else None
            ),
        )
        # B4 weighs the API's CPU against the relay floor; B2 probes its first frame, the HTTP round
        # trip any Python SSE server pays before its first token, to read resq's overhead against.
        runs_b2 = compare and "B2" in plan.scenarios
        floor = Floor(self._group) if api_cpu or runs_b2 else None
        started: list[ResqStack | DirectEngine | TransformersServe | Floor] = [
            system
            for system in (up.stack, up.direct, up.upstream, up.serve, up.serve_defaults, floor)
            if system is not None
        ]
        self._step(f"{model.key}: starting " + ", ".join(type(process).__name__ for process in started))
        for process in started:
            process.start()
        client = clients.new_client()
        try:
            for process in started:
                process.wait_ready()
            up.redis_pid = cpu_accounting.redis_server_pid(Redis.from_url(redis_url).info("server"))
            self.note(f"{model.key}: every system is up; warming up")
            self._warm_up(client, up)
            for round_index in range(plan.rounds):
                if compare and "B1" in plan.scenarios:
                    for concurrency in plan.b1_concurrencies:
                        for system in alternated(up.b1_systems(), round_index):
                            self._step(f"B1 {model.key} round {round_index + 1}: {system} x{concurrency}")
                            self._b1(client, system, model, concurrency, round_index, up)
                            self._advance()
                if runs_b2:
                    for system in alternated([*up.b2_systems(), "floor"], round_index):
                        self._step(f"B2 {model.key} round {round_index + 1}: {system} TTFT probes")
                        self._b2(client, system, model, round_index, up, floor)
                        self._advance()
                if floor is not None and api_cpu:
                    for concurrency in plan.b4_concurrencies:
                        for system in alternated(["resq", "floor"], round_index):
                            self._step(f"B4 round {round_index + 1}: {system} API CPU x{concurrency}")
                            self._b4(client, system, concurrency, round_index, up.stack, floor)
                            self._advance()
        finally:
            self._await(client.aclose())
            for process in reversed(started):
                process.stop()

    def _warm_up(self, client: httpx.AsyncClient, up: HttpSystems) -> None:
        model = up.stack.model
        for width in warm_up_widths(self.plan):
            self._await(
                clients.concurrently(
                    width,
                    lambda: clients.resq_stream(client, up.stack.base_url, model.served_name, WARMUP_TOKENS),
                )
            )
            for engine in (up.direct, up.upstream):
                if engine is not None:
                    engine.run(width, WARMUP_TOKENS)
            for serve in (up.serve, up.serve_defaults):
                if serve is not None:
                    # The first request makes transformers serve build its batching manager: tens of seconds.
                    self._await(
                        clients.concurrently(
                            width,
                            functools.partial(
                                clients.serve_stream, client, serve.base_url, serve.model_id, WARMUP_TOKENS
                            ),
                        )
                    )

    def _http_streams(
        self, client: httpx.AsyncClient, system: str, concurrency: int, tokens: int, up: HttpSystems
    ) -> tuple[list[StreamTiming], float]:
        if system == "resq":
            name = up.stack.model.served_name
            result: tuple[list[StreamTiming], float] = self._await(
                clients.concurrently(
                    concurrency, lambda: clients.resq_stream(client, up.stack.base_url, name, tokens)
                )
            )
            return result
        serve = up.serve_of(system)
        result = self._await(
            clients.concurrently(
                concurrency, lambda: clients.serve_stream(client, serve.base_url, serve.model_id, tokens)
            )
        )
        return result

    def _check(self, system: str, timings: list[StreamTiming], tokens: int) -> int:
        bad = [timing for timing in timings if timing.error is not None or timing.tokens != tokens]
        if bad:
            first = bad[0]
            self.note(
                f"[yellow]{system}: {len(bad)} of {len(timings)} streams failed or were short "
                f"(e.g. {first.tokens} tokens, {first.error})[/yellow]"
            )
        return len(bad)

    def _engine_threads(self, meter: cpu_accounting.CpuMeter, system: str) -> set[tuple[int, int]] | None:
        """The engine threads of ``meter``'s processes; None (noted once) when they cannot be named."""
        try:
            return meter.engine_keys()
        except cpu_accounting.EngineThreadNotFoundError as error:
            if not self._b7_unmeasured:
                self.note(f"[yellow]B7 not measured for {system}: {error}[/yellow]")
            self._b7_unmeasured = True
            return None

    def _b1(
        self,
        client: httpx.AsyncClient,
        system: str,
        model: BenchModel,
        concurrency: int,
        round_index: int,
        up: HttpSystems,
    ) -> None:
        tokens = self.plan.b1_tokens
        cpu: dict[str, float] = {}
        if system in ("direct", "upstream"):
            result = up.engine_of(system).run(concurrency, tokens)
            requests = result["requests"]
            wall = float(result["wall_s"])
            timings = [
                StreamTiming(r["ttft_s"], r["decode_s"], r["total_s"], int(r["tokens"])) for r in requests
            ]
        else:
            meter = up.meter(system)
            engine_keys = self._engine_threads(meter, system)
            before = cpu_accounting.thread_times(meter.pids)
            timings, wall = self._http_streams(client, system, concurrency, tokens, up)
            after = cpu_accounting.thread_times(meter.pids)
            if engine_keys is not None and engine_keys <= after.keys():
                spent = cpu_accounting.split(before, after, engine_keys, meter.labels)
                cpu = spent.per_token(sum(timing.tokens for timing in timings))
        bad = self._check(system, timings, tokens)
        total_tokens = sum(timing.tokens for timing in timings)
        frames = sum(timing.frames for timing in timings)
        per_frame = {"tokens_per_frame": total_tokens / frames} if frames else {}
        self.results.add(
            RunRecord(
                "B1",
                system,
                model.key,
                concurrency,
                round_index,
                metrics={
                    "tok_s": total_tokens / wall,
                    "wall_s": wall,
                    "bad_streams": bad,
                    **per_frame,
                    **cpu,
                },
                samples={
                    "ttft_ms": [timing.ttft_s * 1000 for timing in timings if timing.error is None],
                    "itl_ms": [
                        itl * 1000
                        for timing in timings
                        if (itl := timing.itl_s) is not None and timing.error is None
                    ],
                },
            )
        )

    def _b2(
        self,
        client: httpx.AsyncClient,
        system: str,
        model: BenchModel,
        round_index: int,
        up: HttpSystems,
        floor: Floor | None,
    ) -> None:
        tokens = self.plan.b2_probe_tokens
        ttfts: list[float] = []
        bad = 0
        for _ in range(self.plan.b2_probes):
            if system == "direct":
                request = up.engine_of(system).run(1, tokens)["requests"][0]
                ttfts.append(request["ttft_s"] * 1000)
                continue
            if system == "floor":
                assert floor is not None
                timings = [self._await(clients.floor_stream(client, floor.base_url, tokens, 0.0))]
            else:
                timings, _ = self._http_streams(client, system, 1, tokens, up)
            bad += self._check(system, timings, tokens)
            ttfts.append(timings[0].ttft_s * 1000)
        self.results.add(
            RunRecord(
                "B2",
                system,
                model.key,
                1,
                round_index,
                metrics={"bad_streams": bad},
                samples={"ttft_ms": ttfts},
            )
        )

    def _b4(
        self,
        client: httpx.AsyncClient,
        system: str,
        concurrency: int,
        round_index: int,
        stack: ResqStack,
        floor: Floor,
    ) -> None:
        tokens = self.plan.b4_tokens
        repeats = max(1, -(-self.plan.b4_min_tokens // (tokens * concurrency)))
        interval = self.plan.b4_floor_interval_s
        name = stack.model.served_name

        def one() -> Awaitable[StreamTiming]:
            if system == "resq":
                return clients.resq_stream(client, stack.base_url, name, tokens)
            return clients.floor_stream(client, floor.base_url, tokens, interval)

        proc = stack.api if system == "resq" else floor.proc
        assert proc is not None
        pid = proc.pid
        before = _cpu_seconds(pid)
        timings, wall = self._await(clients.concurrently(concurrency, one, repeats))
        cpu = _cpu_seconds(pid) - before
        bad = self._check(system, timings, tokens)
        streamed = sum(timing.tokens for timing in timings)
        frames = sum(timing.frames for timing in timings)
        self.results.add(
            RunRecord(
                "B4",
                system,
                "tiny",
                concurrency,
                round_index,
                metrics={
                    "cpu_us_per_token": cpu * 1e6 / max(1, streamed),
                    # Per delta frame too: resq packs a stream interval's tokens into one frame.
                    "cpu_us_per_frame": cpu * 1e6 / max(1, frames),
                    "tokens_per_frame": streamed / max(1, frames),
                    "cpu_s": cpu,
                    "wall_s": wall,
                    "bad_streams": bad,
                },
            )
        )

    # --- B3 ---------------------------------------------------------------------------------------

    def _b3(self, redis_url: str, model: BenchModel) -> None:
        plan = self.plan
        self._step("B3: starting post-process workers")
        redis = Redis.from_url(redis_url)
        tokenizer = postprocess.register(redis, model)
        streams = make_streams(tokenizer.tokenizer, plan.b3_streams, plan.b3_tokens)
        env = resq_env(redis_url, model)
        celery = make_celery(load_settings(redis_url=redis_url))

        def send(response_id: str) -> None:
            celery.send_task(
                keys.POSTPROCESS_TASK, kwargs={"response_id": response_id}, queue=keys.POSTPROCESS_QUEUE
            )

        def workers_alive(count: int) -> bool:
            now = time.time()
            fresh = redis.zrangebyscore(keys.POSTPROCESS_WORKERS, now - 3, "+inf")
            return len(fresh) >= count

        first = self._group.start_role("postprocess-worker", "b3-postprocess-0", env)
        try:
            wait_until(lambda: workers_alive(1), 120, "a post-process worker", [first])
            # One untimed pass: imports, tokenizer load, connection pools.
            postprocess.run_through_workers(redis, send, model.served_name, streams[:4], B3_TIMEOUT_S)
            for round_index in range(plan.rounds):
                for system in alternated(["pp1", "pp2", "builder"], round_index):
                    self._step(f"B3 round {round_index + 1}: {system}")
                    if system == "builder":
                        events, seconds = postprocess.run_builder(tokenizer, model.served_name, streams)
                    elif system == "pp1":
                        events, seconds = postprocess.run_through_workers(
                            redis, send, model.served_name, streams, B3_TIMEOUT_S
                        )
                    else:
                        second = self._group.start_role("postprocess-worker", "b3-postprocess-1", env)
                        try:
                            redis.delete(keys.POSTPROCESS_WORKERS)
                            wait_until(
                                lambda: workers_alive(2), 120, "two post-process workers", [first, second]
                            )
                            postprocess.run_through_workers(
                                redis, send, model.served_name, streams[:4], B3_TIMEOUT_S
                            )
                            events, seconds = postprocess.run_through_workers(
                                redis, send, model.served_name, streams, B3_TIMEOUT_S
                            )
                        finally:
                            self._group.stop(second)
                    self.results.add(
                        RunRecord(
                            "B3",
                            system,
                            "tiny",
                            plan.b3_streams,
                            round_index,
                            metrics={"events_s": events / seconds, "events": events, "seconds": seconds},
                        )
                    )
                    self._advance()
        finally:
            self._group.stop(first)
            redis.close()

    # --- B4: streams held by one API process ------------------------------------------------------

    def _b5(self, redis_url: str, model: BenchModel) -> None:
        """B5: json_schema vs plain streams on ``model``, alternated round by round."""
        plan = self.plan
        metrics_port = free_port()
        stack = ResqStack(
            self._group, redis_url, model, gpu_worker_env=structured.gpu_worker_env(metrics_port)
        )
        self._step(f"B5 {model.key}: starting resq")
        stack.start()

        def progress(run: structured.KindRun) -> None:
            self._advance()
            self._step(f"B5 {model.key} round {run.round_index + 1}: {run.kind} done")

        try:
            stack.wait_ready()
            metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            result = self._await(
                structured.measure(stack, metrics_url, plan.rounds, plan.b5_clients, plan.b5_tokens, progress)
            )
            for record in result.records(model.key, plan.b5_clients):
                self.results.add(record)
        finally:
            stack.stop()

    def _capacity(self, redis_url: str, model: BenchModel) -> None:
        count = self.plan.capacity_streams
        self._step(f"B4: holding {count} streams on one API process")
        redis = Redis.from_url(redis_url)
        postprocess.register(redis, model)
        port = free_port()
        # No GPU worker runs here, so every held stream is a queued generation: admission
        # (RESQ_MAX_PENDING, a cluster-wide bound) must let them all in, or this would
        # measure the bound instead of what one API process holds.
        env = resq_env(
            redis_url,
            model,
            RESQ_PORT=str(port),
            RESQ_POSTPROCESS_WORKERS="2",
            RESQ_SSE_PING_S="600",
            RESQ_MAX_PENDING=str(count + 64),
        )
        api = self._group.start_role("api", "capacity-api", env)
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: http_ok(f"{base_url}/v1/models"), 120, "the capacity API", [api])
            result = self._await(
                capacity.hold_streams(base_url, model.served_name, api.pid, count, CAPACITY_TIMEOUT_S)
            )
        finally:
            self._group.stop(api)
            # Nothing consumes the jobs those streams enqueued: drop them with the rest of the run's data.
            redis.flushdb()
            redis.close()
        if result.errors:
            self.note(f"[yellow]capacity: {result.errors}[/yellow]")
        self.results.add(
            RunRecord(
                "B4cap",
                "resq",
                "tiny",
                count,
                0,
                metrics={
                    "held": result.held,
                    "rss_idle_mb": result.rss_idle_mb,
                    "rss_held_mb": result.rss_held_mb,
                    "kb_per_stream": result.kb_per_stream,
                    "open_s": result.open_seconds,
                    "models_latency_ms": result.models_latency_ms,
                },
            )
        )
        self._advance()
