"""Whether this API process is stopping: then its clients' streams end because it does.

On SIGTERM (a deploy, a scale-in) uvicorn stops taking connections, lets the open ones run for
:data:`GRACEFUL_SHUTDOWN_S`, then cancels their tasks; WebSockets it closes at once (1012). To
the foreground paths that looked like clients leaving, which cancels a generation: a stored
response then ended ``cancelled`` where the client would have resumed it on another replica,
as it does after a ``kill -9`` of the API. The flag is set by the signal handler of the server
(``resq api``) before any of that starts; :func:`api.foreground.client_left` reads it.
"""

from __future__ import annotations

GRACEFUL_SHUTDOWN_S = 10.0
"""How long uvicorn lets open requests run after SIGTERM before it cancels them."""
ANSWER_MARGIN_S = 2.0
"""How long before that a non-streaming request still waiting is answered (a 503), so that it
gets an OpenAI error rather than the bare 500 of a cancelled task."""

_stopping = False


def mark_stopping() -> None:
    """This process got its stop signal (called from the server's signal handler)."""
    global _stopping
    _stopping = True


def is_stopping() -> bool:
    """Whether :func:`mark_stopping` was called in this process."""
    return _stopping
