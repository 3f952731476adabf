"""A pipeline's commands run as one Redis script, behind a guard: one round trip where two were.

The API admitted a new response's generation (``RESQ_MAX_PENDING``, :func:`resq.recovery.
generations.admit`) in a round trip of its own, and then recorded the response in a ``MULTI``.
Here the staging helpers queue both on one pipeline, as before, and :func:`execute` sends the
pipeline's queued commands to one script instead: it runs the first commands, the guards, and the
others only when no guard answered 0. A script is atomic, as the ``MULTI`` was, and nothing is
written when a guard refuses. Only the last guard may write (the admission): a guard before it
only reads (a continued response's parent turn must still be there), so that a refusal by any
guard leaves Redis as it was.

A script cannot call ``EVAL``, so the scripts the staging helpers queue run inlined, as Lua
functions of the script (:data:`EMBEDDED`); any other script queued is refused before anything
is sent. Redis reads the other commands as they were queued (redis-py's ``command_stack``, the
arguments the pipeline would have sent), so what a step writes is what the ``MULTI`` wrote:
``tests/unit/test_guarded_step.py`` compares the two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript

from resq import conversations, item_index, records, turns
from resq.recovery import generations, leases

EMBEDDED: Final[tuple[str, ...]] = (
    generations.ADMIT_LUA,
    leases.REGISTER_LUA,
    turns.CREATE_LUA,
    item_index.INDEX_LUA,
    records.FINALIZE_LUA,
    conversations.APPEND_LUA,
    conversations.FREE_IDS_LUA,
)
"""The scripts a guarded step may hold: the admission, the lease's registration, a turn's creation,
the item index's holders of its input; and for a response recorded already ended (no generation),
its final record, its conversation's append and that append's guard."""

_RUNNER: Final = """
-- ARGV[1]: how many of the commands are guards; then the commands, each as its count n of
-- arguments, then the n: a command's name and its arguments, or an embedded script's name
-- ('@<i>'), its key count, its keys and its arguments.
-- Runs the guards in order; when one replies 0 returns its position (from 1) and runs nothing
-- after it, else runs every other command in order and returns 0.
local function run(at)
  local count = tonumber(ARGV[at])
  local script = EMBEDDED[ARGV[at + 1]]
  local reply
  if script then
    local numkeys = tonumber(ARGV[at + 2])
    local script_keys, script_args = {}, {}
    for index = at + 3, at + 2 + numkeys do
      script_keys[#script_keys + 1] = ARGV[index]
    end
    for index = at + 3 + numkeys, at + count do
      script_args[#script_args + 1] = ARGV[index]
    end
    reply = script(script_keys, script_args)
  else
    reply = redis.call(unpack(ARGV, at + 1, at + count))
  end
  return reply, at + count + 1
end
local at = 2
for position = 1, tonumber(ARGV[1]) do
  local guard, following = run(at)
  if guard == 0 then
    return position
  end
  at = following
end
while at <= #ARGV do
  local _, following = run(at)
  at = following
end
return 0
"""


def _script_source(embedded: Sequence[str]) -> str:
    # Each embedded script becomes a function whose parameters shadow the KEYS and ARGV globals,
    # so its body runs unchanged (a top-level ``return`` returns from the function).
    functions = "".join(
        f"local function embedded_{index}(KEYS, ARGV)\n{body}\nend\n" for index, body in enumerate(embedded)
    )
    table = ", ".join(f"['@{index}'] = embedded_{index}" for index in range(len(embedded)))
    return f"{functions}local EMBEDDED = {{{table}}}\n{_RUNNER}"


GUARDED_STEP_LUA: Final = _script_source(EMBEDDED)
_EMBEDDED_NAMES: Final = {body: f"@{index}" for index, body in enumerate(EMBEDDED)}


class UnembeddedScriptError(ValueError):
    """A pipeline queued a script that :data:`EMBEDDED` lacks (a script cannot run ``EVAL``)."""


def step_arguments(commands: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]]) -> list[Any]:
    """The script's ``ARGV`` for a pipeline's queued ``commands`` (its ``command_stack``)."""
    arguments: list[Any] = []
    for command, _options in commands:
        if command[0] == "EVAL":
            name = _EMBEDDED_NAMES.get(command[1])
            if name is None:
                raise UnembeddedScriptError(f"a guarded step cannot run the script {command[1][:60]!r}...")
            entry: Sequence[Any] = (name, *command[2:])
        else:
            entry = command
        arguments += [len(entry), *entry]
    return arguments


class GuardedStep:
    """Runs pipelines as guarded steps on one Redis (the script is loaded once, by its sha)."""

    def __init__(self, redis: Redis) -> None:
        self._script: AsyncScript = redis.register_script(GUARDED_STEP_LUA)

    async def execute(self, pipe: Pipeline, guards: int = 1) -> int | None:
        """Run ``pipe``'s queued commands as one step, its first ``guards`` commands as its guards.

        Returns None when every command ran, else the position (from 1) of the guard that answered
        0: nothing after it ran, and only the last guard may write. ``pipe`` itself is not
        executed, and is reset.
        """
        if len(pipe.command_stack) < guards:
            raise ValueError(f"a step of {guards} guards has only {len(pipe.command_stack)} commands")
        arguments = [guards, *step_arguments(pipe.command_stack)]
        await pipe.reset()  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
        refused = int(await self._script(keys=[], args=arguments))
        return refused or None
