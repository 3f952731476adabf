"""Merging runs of delta events, for a streaming client that fell behind.

A client that reads slowly (TCP backpressure on the API's writes) comes back to a
batch of hundreds of pending events, most of them one-token deltas. Several tokens
in one ``response.output_text.delta`` (or reasoning, summary, call-arguments or custom
tool input delta) are as valid as one (TensorRT-LLM's "stream interval" sends them so),
so the relay sends each run of consecutive deltas of one target as one event: fewer
frames to write and for the client to parse, the same text. A post-processor that fell
behind and logs a burst at once is lag too, and merged the same way.

The merged event is the run's first event with its text (and logprobs) concatenated
and the run's *last* ``sequence_number``: a client that resumes with
``starting_after=<the last number it saw>`` gets exactly what followed the run, no
event twice and none lost. Everything else goes out as the very bytes of the log.

Whether a batch is merged at all is :func:`lagging`'s rule: never the first batch of
a follower (the catch-up, so a replay equals the live events exactly), never the few
events at a time a keeping-up client gets, only a batch above a threshold.
"""

from __future__ import annotations

from typing import Any, Final

from resq import jsonutil
from resq.events import types

Batch = list[tuple[bytes, bytes]]
"""``(type, data)`` of events, as :func:`api.relay.follow_event_batches` yields them."""

CONCATENATED: Final[dict[bytes, tuple[str, ...]]] = {
    types.OUTPUT_TEXT_DELTA.encode(): ("delta", "logprobs"),
    types.REASONING_TEXT_DELTA.encode(): ("delta",),
    types.REASONING_SUMMARY_TEXT_DELTA.encode(): ("delta",),
    types.FUNCTION_CALL_ARGUMENTS_DELTA.encode(): ("delta",),
    types.CUSTOM_TOOL_CALL_INPUT_DELTA.encode(): ("delta",),
}
"""The mergeable event types, and the fields a merge concatenates (strings, or lists).

Two consecutive events of one of these types merge when every *other* field but
``sequence_number`` is equal: their target (``item_id``, ``output_index`` and
``content_index`` or ``summary_index``, as :mod:`resq.events.builders` shapes them),
and anything a later shape adds, so a merge can never drop a field that differed."""

SEQUENCE_NUMBER: Final = "sequence_number"


def lagging(first_batch: bool, size: int, coalesce_after: int) -> bool:
    """Whether a batch of ``size`` events is a lagging client's, to merge (``coalesce_after`` 0: never).

    The first batch a follower yields is the catch-up (a replay, or what was logged before
    the stream started): it stays exact, so a replay of a response equals its live events.
    Later batches hold what arrived while the client was being written to: more than
    ``coalesce_after`` events means it did not keep up.
    """
    return not first_batch and coalesce_after > 0 and size > coalesce_after


def coalesce(batch: Batch) -> Batch:
    """``batch`` with each run of consecutive deltas of one type and target merged into one event.

    A run of one, and every other event, is passed through as the same bytes (no decoding,
    no re-encoding); only deltas next to a delta of the same type are parsed at all.
    """
    merged: Batch = []
    start = 0
    while start < len(batch):
        event_type = batch[start][0]
        end = start + 1
        fields = CONCATENATED.get(event_type)
        if fields is not None:
            # Checking the type bytes is enough to find a run: only a run is parsed.
            while end < len(batch) and batch[end][0] == event_type:
                end += 1
        if fields is None or end - start == 1:
            merged.append(batch[start])
        else:
            merged += _merge_runs(batch[start:end], fields)
        start = end
    return merged


def _merge_runs(same_type: Batch, fields: tuple[str, ...]) -> Batch:
    """Consecutive deltas of one type: one event per run of one target (a run of one as it was)."""
    out: Batch = []
    run: list[dict[str, Any]] = []
    run_start = 0
    for index, (_, data) in enumerate(same_type):
        event = jsonutil.loads(data)
        if run and not _same_target(run[0], event, fields):
            out.append(_merged(same_type, run_start, run, fields))
            run, run_start = [], index
        run.append(event)
    out.append(_merged(same_type, run_start, run, fields))
    return out


def _merged(
    same_type: Batch, run_start: int, run: list[dict[str, Any]], fields: tuple[str, ...]
) -> tuple[bytes, bytes]:
    """The event that stands for ``run`` (which begins at ``same_type[run_start]``)."""
    if len(run) == 1:
        return same_type[run_start]  # alone: the log's bytes, untouched
    return same_type[run_start][0], _merge(run, fields)


def _same_target(first: dict[str, Any], event: dict[str, Any], fields: tuple[str, ...]) -> bool:
    """Whether ``event`` continues ``first``'s run: equal in every field but the merged ones."""
    if first.keys() != event.keys():
        return False
    return all(
        value == event[key] for key, value in first.items() if key not in fields and key != SEQUENCE_NUMBER
    )


def _merge(run: list[dict[str, Any]], fields: tuple[str, ...]) -> bytes:
    """One event for ``run``: the first's fields in their order, ``fields`` concatenated, the last number."""
    event = dict(run[0])
    for name in fields:
        if name not in event:
            continue
        if isinstance(event[name], list):
            event[name] = [entry for part in run for entry in part[name]]
        else:
            event[name] = "".join(part[name] for part in run)
    if SEQUENCE_NUMBER in event:
        event[SEQUENCE_NUMBER] = run[-1][SEQUENCE_NUMBER]
    return jsonutil.dumps(event)
