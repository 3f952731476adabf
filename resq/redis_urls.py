"""``RESQ_REDIS_URL`` over TCP or a Unix socket, as redis-py and kombu each spell it.

resq takes redis-py's URL forms: ``redis://host:port/db`` (``rediss://`` with TLS) and
``unix:///path/to/redis.sock?db=N``. A socket keeps Redis off the network when every role runs
on its host; it is not a speed-up (``make bench-transport``, paired against loopback TCP: 1.04x
and 0.91x the CPU per token in two runs, ``docs/benchmarks.md``). kombu, Celery's transport, names the same socket ``redis+socket:///path`` with the
database as ``virtual_host``: :func:`celery_broker_url` translates.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

UNIX_SCHEME = "unix"


def is_unix_socket(url: str) -> bool:
    """Whether ``url`` names a Unix socket (``unix:///path?db=N``)."""
    return urlsplit(url).scheme == UNIX_SCHEME


def unix_socket_url(path: str, db: int = 0) -> str:
    """redis-py's URL of the Unix socket at ``path``, database ``db``."""
    return f"{UNIX_SCHEME}://{path}?db={db}"


def transport_options(url: str) -> dict[str, Any]:
    """Client options that depend on the transport: TCP keep-alive only where there is TCP
    (redis-py's Unix-socket connection takes no ``socket_keepalive`` and fails on it)."""
    return {} if is_unix_socket(url) else {"socket_keepalive": True}


def celery_broker_url(url: str) -> str:
    """``url`` as kombu's Redis transport reads it: unchanged for TCP, ``redis+socket://`` for a socket.

    ``unix://[user:password@]/path?db=N&...`` becomes ``redis+socket://[user:password@]/path?virtual_host=N&...``
    (kombu reads the database from ``virtual_host``, and passes the other query options on).
    """
    parts = urlsplit(url)
    if parts.scheme != UNIX_SCHEME:
        return url
    query = parse_qsl(parts.query, keep_blank_values=True)
    database = next((value for name, value in query if name == "db"), "0")
    rest = [(name, value) for name, value in query if name != "db"]
    credentials = (
        f"{parts.username or ''}:{parts.password or ''}@" if parts.username or parts.password else ""
    )
    return f"redis+socket://{credentials}{parts.path}?{urlencode([('virtual_host', database), *rest])}"
