"""Logging set-up shared by every role: text for people, or one JSON object a line.

Lines about a response carry its id (``response_id`` in JSON). Code that handles
one response binds the id in a context variable (:func:`response_context`,
:func:`bind_response_id`) and a handler filter copies it onto every record made
meanwhile, whatever library logs it. Where one thread serves many responses (the
GPU worker's publisher), a log call passes ``extra=about(response_id)`` instead.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import TracebackType

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.orjson import OrjsonFormatter

RESPONSE_ID: ContextVar[str | None] = ContextVar("resq_response_id", default=None)
"""The response the current task, thread or request is about."""

RESPONSE_ID_FIELD = "response_id"

_QUIET_LIBRARIES = ("httpx", "urllib3", "transformers", "celery.worker.strategy", "celery.app.trace")
_SELF_HANDLED_LIBRARY_LOGGERS = ("ContinuousBatchingLogger",)
"""Loggers that add a handler of their own at import unless ``propagate`` is already off."""


def bind_response_id(response_id: str) -> None:
    """Tag the rest of the current request (or task) with ``response_id``."""
    RESPONSE_ID.set(response_id)


@contextmanager
def response_context(response_id: str) -> Iterator[None]:
    """Tag every log line made inside the block with ``response_id``."""
    token = RESPONSE_ID.set(response_id)
    try:
        yield
    finally:
        RESPONSE_ID.reset(token)


def about(response_id: str) -> dict[str, str]:
    """``extra`` of a log call about ``response_id`` made outside its context."""
    return {RESPONSE_ID_FIELD: response_id}


class ResponseIdFilter(logging.Filter):
    """Copies the bound response id onto records that do not name one already."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Always keeps the record; only adds the field."""
        if getattr(record, RESPONSE_ID_FIELD, None) is None:
            response_id = RESPONSE_ID.get()
            if response_id is not None:
                setattr(record, RESPONSE_ID_FIELD, response_id)
        return True


def json_formatter(role: str) -> logging.Formatter:
    """``{"time", "level", "logger", "message", "role", "pid", "response_id"?, ...extra}``."""
    return OrjsonFormatter(
        ["levelname", "name", "message", "process"],
        rename_fields={"levelname": "level", "name": "logger", "process": "pid"},
        static_fields={"role": role},
        timestamp="time",
        # uvicorn repeats each message with terminal colours as an extra field.
        reserved_attrs=[*RESERVED_ATTRS, "color_message"],
    )


_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """``text`` with every control character (newlines too) written as its escape (``\\n``)."""
    return _CONTROL_CHARACTERS.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)


class _PrintableFormatter(logging.Formatter):
    """Writes each message on one line: client text in it (a path's ``%0A``) cannot forge a line.

    Only the message is escaped: a traceback that follows it keeps its lines.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        message = record.message
        record.message = printable(message)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message


def text_formatter(role: str) -> logging.Formatter:
    """The human format: time, level, role, logger, message (control characters escaped)."""
    return _PrintableFormatter(f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s")


def configure_logging(level: str, role: str, log_format: str = "text") -> None:
    """Send every log line of this process to stderr, in ``log_format``, naming ``role``."""
    json_lines = log_format == "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter(role) if json_lines else text_formatter(role))
    handler.addFilter(ResponseIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    for name in _SELF_HANDLED_LIBRARY_LOGGERS:
        # Pre-empt the library's own stderr handler so its lines come out in our format too.
        library_logger = logging.getLogger(name)
        library_logger.handlers[:] = [handler]
        library_logger.propagate = False
    # Chatty libraries stay at warnings unless debugging.
    if level.lower() != "debug":
        for name in _QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
    if json_lines:
        _keep_stderr_json()


def _keep_stderr_json() -> None:
    """Route what would otherwise reach stderr raw (crashes, progress bars) through logging."""
    # Progress bars (model loading) draw on stderr; tqdm and the HF hub read these at import.
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    crash_log = logging.getLogger("resq.crash")

    def log_uncaught(
        kind: type[BaseException], error: BaseException, traceback: TracebackType | None
    ) -> None:
        crash_log.critical("uncaught exception", exc_info=(kind, error, traceback))

    def log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is None or isinstance(args.exc_value, SystemExit):
            return
        crash_log.critical(
            "uncaught exception in thread %s",
            args.thread.name if args.thread else "?",
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
        )

    sys.excepthook = log_uncaught
    threading.excepthook = log_uncaught_in_thread
