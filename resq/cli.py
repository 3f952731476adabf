"""The ``resq`` command: ``up`` for a laptop, one sub-command per role for compose and scale-out.

Settings come from ``RESQ_*`` environment variables; the flags below override them.
Each command sets up logging before it imports its role: libraries (transformers,
the HF hub) read their progress-bar switches at import, and JSON logs turn those off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from resq.healthcheck import ROLES
from resq.logs import configure_logging
from resq.settings import Settings, load_settings

F = TypeVar("F", bound=Callable[..., Any])


def _common_options(function: F) -> F:
    options = [
        click.option("--host", help="API interface (RESQ_HOST)."),
        click.option("--port", type=int, help="API port (RESQ_PORT)."),
        click.option("--redis-url", help="Redis URL (RESQ_REDIS_URL)."),
        click.option(
            "--model", help="Model directory or cached hub id; `builtin` for the tiny model (RESQ_MODEL)."
        ),
        click.option("--model-name", help="Name clients send as `model` (RESQ_MODEL_NAME)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="RESQ_DEVICE."),
        click.option("--max-batch", type=int, help="Sequences per engine step (RESQ_MAX_BATCH)."),
        click.option(
            "--postprocess-workers",
            type=int,
            help="Post-process worker processes; 0 = inline (RESQ_POSTPROCESS_WORKERS).",
        ),
        click.option(
            "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), help="RESQ_LOG_LEVEL."
        ),
        click.option("--log-format", type=click.Choice(["text", "json"]), help="RESQ_LOG_FORMAT."),
        click.option("--metrics-port", type=int, help="A worker's Prometheus port (RESQ_METRICS_PORT)."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _settings(flags: dict[str, Any]) -> Settings:
    try:
        return load_settings(**flags)
    except ValidationError as exc:
        # A bad variable stops the role at start-up with one line per problem, not a traceback.
        problems = "\n".join(
            f"  RESQ_{'_'.join(str(part) for part in error['loc']).upper()}: "
            + str(error["msg"]).removeprefix("Value error, ")
            for error in exc.errors()
        )
        raise click.ClickException(f"invalid settings:\n{problems}") from exc


def _check_api_keys(settings: Settings) -> None:
    """One line, not the traceback of a failed start-up, for ``RESQ_API_KEYS`` naming no usable key."""
    from api.auth import APIKeyError, parse_api_keys

    try:
        parse_api_keys(settings.api_keys.get_secret_value() if settings.api_keys else None)
    except APIKeyError as exc:
        raise click.ClickException(f"invalid settings:\n  RESQ_API_KEYS: {exc}") from exc


@click.group()
@click.version_option(package_name="resq")
def main() -> None:
    """resq: the OpenAI Responses API for local Hugging Face models, through a task queue."""


@main.command()
@_common_options
def up(**flags: Any) -> None:
    """Run everything: Redis (embedded if none answers), a GPU worker, post-process workers, the API.

    A role that dies once everything is up is started again (after 1, 2, 4, 8, 16, at most 30 s
    while it keeps dying); one that dies 5 times in a row within a minute of starting, or the
    embedded Redis dying, stops everything.
    """
    settings = _settings(flags)
    _check_api_keys(settings)  # before Redis and the workers start, not when the API does
    configure_logging(settings.log_level, "up", settings.log_format)
    from resq.supervisor import Supervisor

    sys.exit(Supervisor(settings).run())


@main.command()
@_common_options
def api(**flags: Any) -> None:
    """Run the API (uvicorn)."""
    settings = _settings(flags)
    _check_api_keys(settings)
    configure_logging(settings.log_level, "api", settings.log_format)
    import uvicorn

    from api import stopping
    from api.main import create_app

    class StoppingServer(uvicorn.Server):
        """uvicorn's server, which says it is stopping before it closes its connections."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            stopping.mark_stopping()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=int(stopping.GRACEFUL_SHUTDOWN_S),
        # A WebSocket message is a request body: the same limit (uvicorn's own is 16 MiB). One over
        # it closes the socket with 1009 (message too big) before it is read whole.
        ws_max_size=settings.max_body_bytes,
    )
    # The SIGINT uvicorn raises again after a clean shutdown (uvicorn.run swallows it too).
    with contextlib.suppress(KeyboardInterrupt):
        StoppingServer(config).run()


@main.command("gpu-worker")
@_common_options
def gpu_worker(**flags: Any) -> None:
    """Run one GPU worker (queue `generate`)."""
    settings = _settings(flags)
    configure_logging(settings.log_level, "gpu-worker", settings.log_format)
    from gpu_worker.main import run

    exit_code = run(settings)
    # Everything is stopped and handed back by now. The interpreter's own teardown of torch and the
    # model has nothing left to save and took 1.5 s of every stop (a supervisor's restart, each
    # stack a test stops): end the process here, its logs flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


@main.command("postprocess-worker")
@_common_options
def postprocess_worker(**flags: Any) -> None:
    """Run one post-process worker (queue `postprocess`)."""
    settings = _settings(flags)
    configure_logging(settings.log_level, "postprocess", settings.log_format)
    from workers.main import run

    run(settings)


@main.command()
@click.argument("role", type=click.Choice(ROLES))
@click.option("--redis-url", help="Redis URL (RESQ_REDIS_URL).")
@click.option("--port", type=int, help="API port (RESQ_PORT).")
def healthcheck(role: str, **flags: Any) -> None:
    """Exit 0 when ROLE, as run in this container (host), works; print why not otherwise."""
    from resq.healthcheck import check

    health = check(role, _settings(flags))
    click.echo(("healthy: " if health.healthy else "unhealthy: ") + health.detail)
    sys.exit(0 if health.healthy else 1)


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Benchmark resq against its baselines (the `bench` extra); `resq bench --help` lists the options."""
    from bench.cli import bench_command

    bench_command.main(args=ctx.args, prog_name="resq bench")
