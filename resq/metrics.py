"""Prometheus metrics: each process keeps its own and serves them itself.

The API serves ``/metrics`` on its HTTP port; a worker process serves them on
``RESQ_METRICS_PORT`` (an HTTP server thread of prometheus-client). Why one
endpoint per process rather than prometheus-client's multiprocess mode: every
resq process is one Python process (uvicorn runs one, Celery's solo and thread
pools fork nothing), so in-memory metrics are complete, gauges stay live, and no
shared directory or cleanup of dead processes' files is needed. Replicas are
told apart by Prometheus' ``instance`` label; sum or max across them in queries.
"""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

from resq.settings import Settings

log = logging.getLogger(__name__)


def serve_worker_metrics(settings: Settings) -> None:
    """Serve this process's metrics on ``RESQ_METRICS_PORT`` (nothing when it is unset)."""
    if settings.metrics_port is None:
        return
    try:
        start_http_server(settings.metrics_port, addr=settings.host)
    except OSError as exc:
        raise RuntimeError(
            f"cannot serve metrics on {settings.host}:{settings.metrics_port} (RESQ_METRICS_PORT): {exc}"
        ) from exc
    log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)


def stream_entry_age_s(entry_id: bytes | str, now_s: float) -> float:
    """Seconds since Redis stored the stream entry ``entry_id`` (its id starts with Redis' clock in ms)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    stored_ms = int(text.split("-", 1)[0])
    return max(0.0, now_s - stored_ms / 1000.0)
