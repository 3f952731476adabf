"""The systems under test, started as processes: resq's roles, the direct engine, ``transformers serve``, the floor.

Every engine (resq's GPU worker, the direct engine, ``transformers serve``) runs
with one torch thread: on a GPU deployment the model runs on a device of its
own and the CPU cores are left to everything else; here one core plays the GPU
and the other is left to the API, the post-processors, Redis and the clients.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.cpu_accounting import CpuMeter
from bench.direct import RESULT_PREFIX
from bench.models import BenchModel
from bench.procs import Proc, ProcGroup, free_port, http_ok, wait_until

START_TIMEOUT_S = 300.0
ENGINE_THREADS = 1
KV_CACHE_TOKENS = 32768
KV_PAGE_SIZE = 64
MAX_BATCH = 64
MAX_BATCH_TOKENS = 512


def serve_device() -> str:
    """Where ``transformers serve`` runs its model: where resq's engines run, which pick theirs
    from ``RESQ_DEVICE`` (``auto``, the default, prefers CUDA)."""
    from gpu_worker.model_loading import pick_device  # torch: only for a bench that starts `serve`

    return pick_device(os.environ.get("RESQ_DEVICE", "auto")).type


def engine_env() -> dict[str, str]:
    """Thread limits of an engine process (see the module docstring)."""
    threads = str(ENGINE_THREADS)
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def resq_env(redis_url: str, model: BenchModel, **extra: str) -> dict[str, str]:
    """``RESQ_*`` settings shared by every resq process of the bench."""
    return {
        "RESQ_REDIS_URL": redis_url,
        "RESQ_MODEL": str(model.path),
        "RESQ_MODEL_NAME": model.served_name,
        "RESQ_MAX_BATCH": str(MAX_BATCH),
        "RESQ_MAX_BATCH_TOKENS": str(MAX_BATCH_TOKENS),
        "RESQ_KV_CACHE_TOKENS": str(KV_CACHE_TOKENS),
        "RESQ_KV_PAGE_SIZE": str(KV_PAGE_SIZE),
        "RESQ_LOG_LEVEL": "warning",
        "RESQ_HEARTBEAT_S": "1",
        **extra,
    }


def reports_gpu_workers(health: dict[str, Any], started: int) -> bool:
    """Whether a ``/health`` body counts at least the ``started`` GPU workers (each reports in
    once its model is loaded)."""
    counted = health.get("gpu_workers", 0)
    return isinstance(counted, int) and counted >= started


@dataclass
class ResqStack:
    """A GPU worker, post-process workers and one API on a model."""

    group: ProcGroup
    redis_url: str
    model: BenchModel
    postprocess_workers: int = 2
    gpu_worker_env: dict[str, str] = field(default_factory=dict)
    """Extra settings of the GPU worker (B5 gives it a metrics port)."""
    gpu_workers: int = 1
    """GPU worker processes (the affinity bench runs two)."""
    procs: list[Proc] = field(default_factory=list)
    gpu_worker_procs: list[Proc] = field(default_factory=list)
    """The GPU workers among :attr:`procs` (the processes that run an engine)."""
    api: Proc | None = None
    base_url: str = ""

    def start(self) -> None:
        """Start every process (does not wait; see :meth:`wait_ready`)."""
        env = resq_env(self.redis_url, self.model, RESQ_POSTPROCESS_WORKERS=str(self.postprocess_workers))
        for index in range(self.gpu_workers):
            name = f"{self.model.key}-gpu-worker" + (f"-{index}" if index else "")
            worker = self.group.start_role("gpu-worker", name, {**env, **engine_env(), **self.gpu_worker_env})
            self.gpu_worker_procs.append(worker)
            self.procs.append(worker)
        for index in range(self.postprocess_workers):
            self.procs.append(
                self.group.start_role("postprocess-worker", f"{self.model.key}-postprocess-{index}", env)
            )
        port = free_port()
        self.api = self.group.start_role("api", f"{self.model.key}-api", {**env, "RESQ_PORT": str(port)})
        self.procs.append(self.api)
        self.base_url = f"http://127.0.0.1:{port}"

    def wait_ready(self) -> None:
        """Wait until ``/health`` says every role answers, with as many GPU workers as this stack
        started, and ``/v1/models`` lists this stack's model.

        ``/health`` alone is not enough on a Redis an earlier stack used: that stack's GPU
        worker stays listed until its heartbeat expires, before this one has loaded its model.
        Nor with two GPU workers: it answers 200 once one has loaded its model, and the agent
        loops of a round started then all stay with that one (cache-aware routing).
        """
        wait_until(
            lambda: self._every_gpu_worker_reports() and self._serves_model(),
            START_TIMEOUT_S,
            "resq",
            self.procs,
        )

    def _every_gpu_worker_reports(self) -> bool:
        reply = httpx.get(f"{self.base_url}/health", timeout=2)
        return reply.status_code == 200 and reports_gpu_workers(reply.json(), self.gpu_workers)

    def _serves_model(self) -> bool:
        listed = httpx.get(f"{self.base_url}/v1/models", timeout=2).json().get("data", [])
        return any(model.get("id") == self.model.served_name for model in listed)

    def stop(self) -> None:
        """Stop every process of the stack."""
        for proc in reversed(self.procs):
            self.group.stop(proc)
        self.procs.clear()
        self.gpu_worker_procs.clear()


@dataclass
class DirectEngine:
    """The engine alone, in its own process, driven over a pipe."""

    group: ProcGroup
    redis_url: str
    model: BenchModel
    upstream: bool = False
    """transformers' continuous batching as it ships instead of the GPU worker's ``Engine``."""
    proc: Proc | None = None

    def start(self) -> None:
        """Start the process (loads the model)."""
        env = {**resq_env(self.redis_url, self.model), **engine_env()}
        name = f"{self.model.key}-{'upstream' if self.upstream else 'direct'}"
        argv = [sys.executable, "-m", "bench.direct", *(["--upstream"] if self.upstream else [])]
        self.proc = self.group.start(name, argv, env, pipes=True)

    def wait_ready(self) -> None:
        """Wait for the engine to report ready."""
        self._read_result()

    def run(self, concurrency: int, max_tokens: int) -> dict[str, Any]:
        """``concurrency`` requests of ``max_tokens`` tokens at once; the engine's timings."""
        from bench.clients import PROMPT

        command = {
            "op": "run",
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": PROMPT}],
        }
        assert self.proc is not None and self.proc.popen.stdin is not None
        self.proc.popen.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.popen.stdin.flush()
        return self._read_result()

    def _read_result(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.popen.stdout is not None
        while True:
            line = self.proc.popen.stdout.readline()
            if not line:
                raise RuntimeError(f"the direct engine exited:\n{self.proc.log_tail()}")
            text = line.decode(errors="replace")
            if text.startswith(RESULT_PREFIX):
                result: dict[str, Any] = json.loads(text[len(RESULT_PREFIX) :])
                return result

    def stop(self) -> None:
        """Stop the process."""
        if self.proc is not None:
            self.group.stop(self.proc)
            self.proc = None


@dataclass
class TransformersServe:
    """``transformers serve --continuous-batching`` on the same model, same cache and batch sizes.

    With ``own_defaults`` it runs with none of the ``--cb-*`` sizes: transformers then sizes
    its cache from the machine's memory (60% of it on CPU) and its batches itself.
    """

    group: ProcGroup
    model: BenchModel
    own_defaults: bool = False
    proc: Proc | None = None
    base_url: str = ""

    @property
    def model_id(self) -> str:
        """What its clients send as ``model`` (the preloaded model's path)."""
        return str(self.model.path)

    def start(self) -> None:
        """Start the server (loads the model)."""
        port = free_port()
        argv = [
            sys.executable, "-m", "transformers.cli.transformers", "serve", str(self.model.path),
            "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), "--device", serve_device(),
            "--log-level", "warning",
        ]  # fmt: skip
        if not self.own_defaults:
            argv += [
                "--cb-block-size", str(KV_PAGE_SIZE), "--cb-num-blocks", str(KV_CACHE_TOKENS // KV_PAGE_SIZE),
                "--cb-max-batch-tokens", str(MAX_BATCH_TOKENS),
            ]  # fmt: skip
        name = f"{self.model.key}-transformers-serve" + ("-defaults" if self.own_defaults else "")
        self.proc = self.group.start(name, argv, engine_env())
        self.base_url = f"http://127.0.0.1:{port}"

    def wait_ready(self) -> None:
        """Wait until it answers ``/health``."""
        assert self.proc is not None
        wait_until(
            lambda: http_ok(f"{self.base_url}/health"), START_TIMEOUT_S, "transformers serve", [self.proc]
        )

    def stop(self) -> None:
        """Stop the server."""
        if self.proc is not None:
            self.group.stop(self.proc)
            self.proc = None


@dataclass
class Floor:
    """The bare ``StreamingResponse`` relay of B4."""

    group: ProcGroup
    proc: Proc | None = None
    base_url: str = ""

    def start(self) -> None:
        """Start it."""
        port = free_port()
        self.proc = self.group.start("floor", [sys.executable, "-m", "bench.floor", "--port", str(port)])
        self.base_url = f"http://127.0.0.1:{port}"

    def wait_ready(self) -> None:
        """Wait until it answers."""
        assert self.proc is not None
        wait_until(lambda: http_ok(f"{self.base_url}/health"), 60, "the relay floor", [self.proc])

    def stop(self) -> None:
        """Stop it."""
        if self.proc is not None:
            self.group.stop(self.proc)
            self.proc = None


B1_SYSTEMS = ("resq", "direct", "upstream", "serve", "serve-defaults")
"""B1's systems, in the order of a round's first rotation."""
B2_SYSTEMS = ("resq", "direct", "serve")
"""B2's systems: TTFT against the engine resq runs, and against ``transformers serve``."""


@dataclass
class HttpSystems:
    """Everything B1 and B2 run side by side on one model: resq and its baselines."""

    stack: ResqStack
    direct: DirectEngine | None = None
    """The GPU worker's ``Engine`` alone."""
    upstream: DirectEngine | None = None
    """transformers' continuous batching alone, without resq's step."""
    serve: TransformersServe | None = None
    """``transformers serve`` with resq's cache and batch sizes."""
    serve_defaults: TransformersServe | None = None
    """``transformers serve`` at its own defaults."""
    redis_pid: int | None = None
    """The Redis server resq uses, when it runs here (its CPU is resq's)."""

    def _present(self, names: tuple[str, ...]) -> list[str]:
        systems = {
            "resq": self.stack,
            "direct": self.direct,
            "upstream": self.upstream,
            "serve": self.serve,
            "serve-defaults": self.serve_defaults,
        }
        return [name for name in names if systems[name] is not None]

    def b1_systems(self) -> list[str]:
        """The systems B1 compares, of those that run."""
        return self._present(B1_SYSTEMS)

    def b2_systems(self) -> list[str]:
        """The systems B2 probes, of those that run."""
        return self._present(B2_SYSTEMS)

    def engine_of(self, system: str) -> DirectEngine:
        """The in-process engine named ``system`` (``direct`` or ``upstream``)."""
        engine = self.direct if system == "direct" else self.upstream if system == "upstream" else None
        if engine is None:
            raise KeyError(f"no in-process engine {system!r} runs")
        return engine

    def serve_of(self, system: str) -> TransformersServe:
        """The ``transformers serve`` named ``system`` (``serve`` or ``serve-defaults``)."""
        serve = (
            self.serve if system == "serve" else self.serve_defaults if system == "serve-defaults" else None
        )
        if serve is None:
            raise KeyError(f"no transformers serve {system!r} runs")
        return serve

    def meter(self, system: str) -> CpuMeter:
        """What B7 reads for ``system``: every process of it, and those that run its engine."""
        if system == "resq":
            labels = {proc.pid: _role_of(proc.name) for proc in self.stack.procs}
            if self.redis_pid is not None:
                labels[self.redis_pid] = "redis"
            return CpuMeter(labels, [proc.pid for proc in self.stack.gpu_worker_procs])
        serve = self.serve_of(system)
        assert serve.proc is not None
        return CpuMeter({serve.proc.pid: "serve"}, [serve.proc.pid])


def _role_of(name: str) -> str:
    # The stack names its processes "<model>-<role>[-<index>]".
    for role in ("gpu-worker", "postprocess", "api"):
        if f"-{role}" in name:
            return role
    return name
