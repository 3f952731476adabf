"""Logging set-up shared by every role."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str, role: str) -> None:
    """Plain text logs on stderr, naming the role of the process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Chatty libraries stay at warnings unless debugging.
    if level.lower() != "debug":
        for name in ("httpx", "urllib3", "transformers", "celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(name).setLevel(logging.WARNING)
