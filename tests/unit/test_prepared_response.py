"""A response prepared without output (the WebSocket mode's ``generate: false``): what its one
step writes (``api/submission.py``, ``_record_prepared``). The pipeline is a recording fake; the
e2e test in ``tests/e2e/test_websocket.py`` runs it for real."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from api.submission import _NewResponse, _record_prepared
from resq import conversations, item_index, keys, records
from resq.options import ProcessingOptions

RESPONSE_ID = "resp_" + "0" * 32


class _Pipeline:
    """Records the commands queued on it, in order."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, tuple[Any, ...]]] = []
        self.executed = False

    def __getattr__(self, name: str) -> Any:
        def queue(*args: Any, **kwargs: Any) -> None:
            assert not self.executed, f"{name} queued after the step ran"
            self.commands.append((name, args))

        return queue

    async def execute(self) -> list[Any]:
        self.executed = True
        return []


class _Step:
    """Runs a pipeline as the guarded step would: records how many guards it was given."""

    def __init__(self) -> None:
        self.guards: list[int] = []

    async def execute(self, pipe: _Pipeline, guards: int = 1) -> int | None:
        self.guards.append(guards)
        await pipe.execute()
        return None


class _Opened:
    def __init__(self) -> None:
        self.staged_on: list[_Pipeline] = []

    def stage_wake(self, pipe: _Pipeline) -> None:
        self.staged_on.append(pipe)


def _record(
    store: bool,
    opened: _Opened | None,
    parent: str | None = None,
    step: _Step | None = None,
    conversation_id: str | None = None,
) -> _Pipeline:
    pipe = _Pipeline()
    state: Any = SimpleNamespace(
        settings=SimpleNamespace(transient_ttl_s=600, store_ttl_s=86_400),
        redis=SimpleNamespace(pipeline=lambda transaction: pipe),
        guarded_step=step or _Step(),
    )
    own = [{"id": "msg_1", "type": "message", "role": "user", "content": [], "status": "completed"}]
    record = records.NewRecord("in_progress", b"{}", ProcessingOptions(model="m"), store, False, "owner")
    new = _NewResponse(RESPONSE_ID, record, [], {"items": own}, own, parent, store)
    asyncio.run(_record_prepared(state, new, b'{"status":"completed"}', conversation_id, opened))  # type: ignore[arg-type]
    assert pipe.executed
    return pipe


def test_a_continuation_is_guarded_by_its_parents_turn() -> None:
    """The parent's turn must still be there when the step runs (a delete since the request read
    it would leave a response no request could continue): the step's first command, its guard."""
    step = _Step()
    pipe = _record(store=True, opened=None, parent="resp_parent", step=step)
    assert step.guards == [1]
    assert pipe.commands[0] == ("exists", (keys.turn("resp_parent"),))
    unlinked = _Step()
    _record(store=True, opened=None, step=unlinked)
    assert unlinked.guards == [0]


def test_the_step_ends_the_response_and_wakes_the_relays_hub() -> None:
    opened = _Opened()
    pipe = _record(store=True, opened=opened)
    finalize = [args for name, args in pipe.commands if name == "eval" and args[0] == records.FINALIZE_LUA]
    assert len(finalize) == 1
    assert finalize[0][2:6] == (
        keys.record(RESPONSE_ID),
        keys.events(RESPONSE_ID),
        keys.input_items(RESPONSE_ID),
        keys.turn(RESPONSE_ID),
    )
    assert finalize[0][6] == "completed" and finalize[0][8] == 86_400  # a stored one's TTL
    # The join owed the hub a wake-up that other joiners counted on: it goes in this step.
    assert opened.staged_on == [pipe]
    # No generation: nothing is admitted, queued or leased.
    names = {name for name, _ in pipe.commands}
    assert "lpush" not in names and "zadd" not in names
    # A stored one's input is indexed for item references.
    index = [args for name, args in pipe.commands if name == "eval" and args[0] == item_index.INDEX_LUA]
    assert len(index) == 1 and index[0][1:4] == (1, keys.item_holders("owner", "msg_1"), f"{RESPONSE_ID} i")


def test_an_unstored_one_lives_the_transient_ttl_and_is_not_indexed() -> None:
    pipe = _record(store=False, opened=None)
    finalize = [args for name, args in pipe.commands if name == "eval" and args[0] == records.FINALIZE_LUA]
    assert finalize[0][8] == 600
    assert all(args[0] != item_index.INDEX_LUA for name, args in pipe.commands if name == "eval")


def test_joining_a_conversation_is_guarded_by_its_ids_being_free() -> None:
    """Its items are appended in the step: an id the conversation took since the request was
    accepted would be replaced, so the step's guard refuses it first."""
    step = _Step()
    pipe = _record(store=False, opened=None, step=step, conversation_id="conv_" + "c" * 32)
    assert step.guards == [1]
    name, args = pipe.commands[0]
    assert name == "eval" and args[0] == conversations.FREE_IDS_LUA
    assert args[1:] == (4, *keys.conversation_keys("conv_" + "c" * 32), "msg_1")
