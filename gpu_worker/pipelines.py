"""One round trip per pipeline, Lua scripts included.

redis-py's ``Pipeline.execute`` first asks ``SCRIPT EXISTS`` for every script
queued on the pipeline (``Pipeline.load_scripts``): a second round trip on
every execute, i.e. on every engine step of the publisher. :func:`execute`
skips that check and sends the queued ``EVALSHA``s as they are. When Redis
answers ``NOSCRIPT`` (it restarted, or its scripts were flushed) it loads the
scripts and sends the same commands once more: everything the GPU worker
pipelines is safe to repeat (fenced exactly-once appends, reads, ``ZREM``).
"""

from __future__ import annotations

from typing import Any

from redis import Redis
from redis.client import Pipeline
from redis.exceptions import NoScriptError


def execute(redis: Redis, pipe: Pipeline) -> list[Any]:
    """``pipe.execute()`` in one round trip; reloads the scripts and retries once on ``NOSCRIPT``."""
    scripts = list(pipe.scripts)
    commands = list(pipe.command_stack)
    pipe.scripts.clear()
    try:
        return pipe.execute()
    except NoScriptError:
        for script in scripts:
            # The SHA is the script text's, so the queued EVALSHAs stay valid once it is loaded.
            script.sha = redis.script_load(script.script)
        pipe.command_stack = commands
        return pipe.execute()
