"""Which GPU worker owns a generation job, fenced by an epoch.

The API stages the job in the response's generation hash (``keys.generation``)
before it sends the Celery message; the message carries only the response id.
A GPU worker *claims* the job, which bumps the epoch, and names ``(owner,
epoch)`` on every token-stream append: a Lua script appends only while both
still match. When the reaper finds the owner dead (no heartbeat), it releases
the job, which fences the old owner off for good, and dispatches it again; the
next claimant resumes from the tokens already in the stream.

Hash fields:

- ``job``: the :class:`~resq.wire.GenerationJob` JSON as accepted (original prompt and budget);
- ``model``: the job's model (whose queue its messages go to);
- ``prompt_tokens``: the length of that prompt;
- ``state``: ``pending`` until the finish entry is appended, then ``finished``
  (or ``failed`` when the reaper ended it);
- ``owner``: id of the GPU worker holding the claim, ``""`` while unowned;
- ``epoch``: claims so far; ``losses``: owners found dead so far;
- ``generated``: tokens appended so far; ``started``: ``1`` once the start entry is in;
- ``unowned_since`` / ``dispatched_at``: unix ms when it last lost its owner (or was
  accepted) and when its latest Celery message was sent;
- ``progressed_at``: unix ms (Redis' clock) of its latest claim or append: a job whose live
  owner shows no progress for ``RESQ_GPU_STALL_TIMEOUT_S`` is released as lost (the watchdog).

Times are the writers' clocks (like heartbeats): hosts are assumed NTP-synchronised
to well within ``RESQ_WORKER_TTL_S``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from pydantic import ValidationError
from redis import Redis
from redis.asyncio.client import Pipeline as AsyncPipeline
from redis.client import Pipeline
from redis.typing import EncodableT

from resq import keys
from resq.redis_types import StreamFields, range_entries
from resq.wire import FinishEntry, GenerationJob, StartEntry, TokensEntry, TokenStreamEntry, decode_entry
from resq.wire import encode_entry as encode_stream_entry

PENDING: Final = "pending"
APPENDED: Final = 1
ALREADY_APPENDED: Final = 2
FENCED_OFF: Final = 0
OUT_OF_ORDER: Final = -1
GONE: Final = -2
"""A publish found no job at all: the response was deleted, or its unstored stream dropped."""
FINISHED: Final = "finished"
FAILED: Final = "failed"

CLAIM_LUA: Final = """
-- KEYS: generation, cancel flag, tokens; ARGV: worker id, '1' to publish the start entry, TTL s.
-- Returns {outcome, epoch, job, published, cancelled, started}: published is 1 when an earlier
-- claim appended to the token stream (only then must the claimer read it to resume), cancelled
-- 1 when the response's cancel flag is set, started 1 when this claim appended the start entry
-- (asked for by a claimer with room in its engine now, for a job never started nor cancelled).
-- All ride on the claim so that a fresh job reaches the engine after one round trip.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return {'missing', 0, '', 0, 0, 0}
end
if state ~= 'pending' then
  return {state, 0, '', 0, 0, 0}
end
if redis.call('HGET', KEYS[1], 'owner') ~= '' then
  return {'owned', 0, '', 0, 0, 0}
end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
local now = redis.call('TIME')
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'unowned_since', '', 'progressed_at', now[1] * 1000 + math.floor(now[2] / 1000))
local already_started = redis.call('HGET', KEYS[1], 'started') == '1'
local published = 0
if already_started or (tonumber(redis.call('HGET', KEYS[1], 'generated')) or 0) > 0 then
  published = 1
end
local cancelled = redis.call('EXISTS', KEYS[2])
local started = 0
local prompt_tokens = redis.call('HGET', KEYS[1], 'prompt_tokens')
if ARGV[2] == '1' and not already_started and cancelled == 0 and prompt_tokens then
  -- The fields of wire.encode_entry(StartEntry(prompt_tokens)), in its order.
  redis.call('XADD', KEYS[3], '*', 'type', 'start', 'prompt_tokens', prompt_tokens)
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
  redis.call('HSET', KEYS[1], 'started', '1')
  started = 1
end
return {'claimed', epoch, redis.call('HGET', KEYS[1], 'job'), published, cancelled, started}
"""

_PUBLISH_ONE_LUA = """
-- KEYS: generation, tokens[, cancel flag (tokens) or generations set (finish)]; ARGV: owner,
-- epoch, TTL, kind, at, count, field/value pairs[, the response id (finish with the set)].
-- Appends only for the current claim, and exactly once: a retried append (its reply was lost)
-- finds its tokens already counted. Returns 1 appended, 2 already appended, 0 fenced off (the
-- claim is no longer (owner, epoch), or the job ended), -1 out of order, -2 gone (no job at all:
-- the response was deleted, or its unstored stream dropped); given the cancel
-- flag's key, {that, 1 when the flag is set}: the publisher's per-round cancel check rides on
-- the append instead of costing a command of its own. A finish given the generations set takes
-- the job off it in the same step (the reaper's list, and the admission count).
-- A function whose KEYS and ARGV are one append's (they shadow the script's own), so that
-- PUBLISH_LUA runs it once and PUBLISH_ROUND_LUA once per append of a round.
local function publish_one(KEYS, ARGV)
  local kind = ARGV[4]
  local last = #ARGV
  local listed = KEYS[3] and kind == 'finish'
  local function reply(code)
    if KEYS[3] and kind == 'tokens' then
      return {code, redis.call('EXISTS', KEYS[3])}
    end
    return code
  end
  local function unlist()
    if listed then
      redis.call('ZREM', KEYS[3], ARGV[#ARGV])
    end
  end
  if listed then
    last = last - 1
  end
  local job = redis.call('HMGET', KEYS[1], 'owner', 'epoch', 'state', 'generated', 'started')
  if job[1] ~= ARGV[1] or job[2] ~= ARGV[2] then
    if not job[1] and redis.call('EXISTS', KEYS[1]) == 0 then
      unlist()
      return reply(-2)
    end
    return reply(0)
  end
  if job[3] ~= 'pending' then
    if job[3] == 'finished' and kind == 'finish' then
      unlist()
      return reply(2)
    end
    return reply(0)
  end
  local generated = tonumber(job[4]) or 0
  local now = redis.call('TIME')
  local progressed_at = now[1] * 1000 + math.floor(now[2] / 1000)
  if kind == 'tokens' then
    local at = tonumber(ARGV[5])
    local count = tonumber(ARGV[6])
    if generated ~= at then
      if generated >= at + count then
        return reply(2)
      end
      return reply(-1)
    end
    redis.call('HSET', KEYS[1], 'generated', at + count, 'progressed_at', progressed_at)
  elseif kind == 'start' then
    if job[5] == '1' then
      return reply(2)
    end
    redis.call('HSET', KEYS[1], 'started', '1', 'progressed_at', progressed_at)
  elseif kind == 'finish' then
    -- A finish counts the tokens before it: after an out-of-order tokens append it must not land.
    if generated < tonumber(ARGV[5]) then
      return reply(-1)
    end
    redis.call('HSET', KEYS[1], 'state', 'finished', 'progressed_at', progressed_at)
    unlist()
  end
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, 7, last))
  local ttl = tonumber(ARGV[3])
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('EXPIRE', KEYS[1], ttl)
  return reply(1)
end
"""

PUBLISH_LUA: Final = _PUBLISH_ONE_LUA + "return publish_one(KEYS, ARGV)\n"
"""One fenced, exactly-once append (:meth:`Generations.publish`)."""

PUBLISH_ROUND_LUA: Final = (
    _PUBLISH_ONE_LUA
    + """
-- ARGV, for each append in turn: its key count k, its argument count n, then its n arguments
-- (PUBLISH_LUA's ARGV); KEYS: each append's k keys (PUBLISH_LUA's KEYS) in the same order.
-- Returns, per append, what PUBLISH_LUA returns for it.
local replies = {}
local key_at, at = 1, 1
while at <= #ARGV do
  local key_count, arg_count = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
  local entry_keys, entry_args = {}, {}
  for index = 1, key_count do
    entry_keys[index] = KEYS[key_at + index - 1]
  end
  for index = 1, arg_count do
    entry_args[index] = ARGV[at + 1 + index]
  end
  replies[#replies + 1] = publish_one(entry_keys, entry_args)
  key_at = key_at + key_count
  at = at + 2 + arg_count
end
return replies
"""
)
"""A round's appends of every request as one script call (:class:`PublishRound`): one command
and one reply instead of one ``EVALSHA`` (and its queued reply) per request."""

UNCLAIM_LUA: Final = """
-- KEYS[1] generation; ARGV: owner, epoch, now ms, counts as a loss ('1'/'0').
-- Returns the losses so far, or -1 when the claim is no longer (owner, epoch).
if redis.call('HGET', KEYS[1], 'state') ~= 'pending'
   or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1]
   or redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[2] then
  return -1
end
redis.call('HSET', KEYS[1], 'owner', '', 'unowned_since', ARGV[3], 'dispatched_at', ARGV[3])
if ARGV[4] == '1' then
  return redis.call('HINCRBY', KEYS[1], 'losses', 1)
end
return tonumber(redis.call('HGET', KEYS[1], 'losses'))
"""

REDISPATCHED_LUA: Final = """
-- KEYS[1] generation; ARGV: epoch, now ms. Records a new message for a still unowned job.
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' or redis.call('HGET', KEYS[1], 'owner') ~= ''
   or redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'dispatched_at', ARGV[2])
return 1
"""

END_UNOWNED_LUA: Final = """
-- KEYS: generation, tokens; ARGV: epoch, TTL, final state, field/value pairs of the finish entry.
-- Ends a job nobody owns (no GPU worker came back, or it was cancelled meanwhile).
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' or redis.call('HGET', KEYS[1], 'owner') ~= ''
   or redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then
  return 0
end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'state', ARGV[3])
return 1
"""

ADMIT_LUA: Final = """
-- KEYS[1] the generations set[, KEYS[2] the caller's own set]; ARGV: response id, unix time,
-- most generations listed[, most of the caller's, the own set's TTL (s)].
-- Lists the response (as track does) only while fewer than the limit are, and, given the
-- caller's set, while fewer than the caller's limit of its generations are still listed:
-- one script, so the bounds hold across every API process. The caller's set is pruned of
-- generations that left the generations set (they ended), so nothing else maintains it.
-- Returns 1 when listed, 0 when a bound is reached.
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  return 0
end
if KEYS[2] then
  for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if not redis.call('ZSCORE', KEYS[1], member) then
      redis.call('ZREM', KEYS[2], member)
    end
  end
  if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then
    return 0
  end
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[5])
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""

AnyPipeline = Pipeline | AsyncPipeline
ClaimOutcome = Literal["claimed", "unreadable", "owned", "finished", "failed", "missing"]


@dataclass(frozen=True, slots=True)
class Fence:
    """The claim a GPU worker names on every append."""

    owner: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Claim:
    """What :meth:`Generations.claim` found."""

    outcome: ClaimOutcome
    fence: Fence | None = None
    job: GenerationJob | None = None
    error: str | None = None
    """``unreadable``: why the job did not parse (claimed all the same, so that it can be ended)."""
    published: bool = False
    """Claimed: an earlier claim appended to the token stream, which the resumption must read."""
    cancelled: bool = False
    """Claimed: the response's cancel flag was set when it was claimed."""
    started: bool = False
    """Claimed: this claim appended the start entry (it was asked to, and the job had none)."""


@dataclass(frozen=True, slots=True)
class Progress:
    """What the token stream of a job already holds."""

    started: bool
    token_ids: list[int]
    finished: bool


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The fields the reaper decides on."""

    state: str | None
    owner: str
    epoch: int
    losses: int
    prompt_tokens: int
    generated: int
    unowned_since_ms: int | None
    dispatched_at_ms: int
    progressed_at_ms: int | None = None
    """Its latest claim or append (Redis' clock); None before its first claim."""
    model: str = ""
    """The model the job is for (whose queue a dispatch goes to)."""


SNAPSHOT_FIELDS: Final = (
    "state",
    "owner",
    "epoch",
    "losses",
    "prompt_tokens",
    "generated",
    "unowned_since",
    "dispatched_at",
    "progressed_at",
    "model",
)


def stage(pipe: AnyPipeline, job: GenerationJob, ttl_s: int, now_ms: int) -> None:
    """Queue the commands that record a new, unowned job (in the API's create transaction)."""
    key = keys.generation(job.response_id)
    pipe.hset(
        key,
        mapping={
            # Fields at their defaults are left out: a GPU worker of an older release (a rolling
            # upgrade) still reads every job that does not use a field it lacks.
            "job": job.model_dump_json(exclude_defaults=True),
            "model": job.model,
            "prompt_tokens": len(job.prompt_token_ids),
            "state": PENDING,
            "owner": "",
            "epoch": 0,
            "losses": 0,
            "generated": 0,
            "started": 0,
            "unowned_since": now_ms,
            "dispatched_at": now_ms,
        },
    )
    pipe.expire(key, ttl_s)


def track(pipe: AnyPipeline, response_id: str, now_s: float) -> None:
    """Queue the command that puts a job on the reaper's list (before the job is staged)."""
    pipe.zadd(keys.GENERATIONS, {response_id: now_s})


def admit(
    pipe: AnyPipeline,
    response_id: str,
    now_s: float,
    max_pending: int,
    owner: str = "",
    max_per_owner: int = 0,
    owner_ttl_s: int = 3600,
) -> None:
    """Queue :func:`track` bounded by ``max_pending`` (``RESQ_MAX_PENDING``) and, given an
    ``owner`` and ``max_per_owner`` (``RESQ_MAX_PENDING_PER_KEY``), by that owner's share; its
    reply is 1 or 0.

    The set is the backpressure count and cannot leak: the GPU worker removes an entry
    when its job ends (finished, failed, cancelled), and the reaper removes entries
    whose job ended otherwise or whose response was deleted (see :mod:`resq.recovery.reaper`).
    An owner's set follows it: what left the generations set leaves it at the owner's next
    admission.
    """
    if owner and max_per_owner > 0:
        pipe.eval(
            ADMIT_LUA,
            2,
            keys.GENERATIONS,
            keys.pending_of(owner),
            response_id,
            repr(now_s),
            max_pending,
            max_per_owner,
            owner_ttl_s,
        )
        return
    pipe.eval(ADMIT_LUA, 1, keys.GENERATIONS, response_id, repr(now_s), max_pending)


def _flatten(fields: StreamFields) -> list[EncodableT]:
    flat: list[EncodableT] = []
    for name, value in fields.items():
        flat += [name, value]
    return flat


def parse_snapshot(values: list[bytes | None]) -> Snapshot:
    """A :class:`Snapshot` from ``HMGET`` of :data:`SNAPSHOT_FIELDS`."""
    (
        state,
        owner,
        epoch,
        losses,
        prompt_tokens,
        generated,
        unowned_since,
        dispatched_at,
        progressed_at,
        model,
    ) = values
    return Snapshot(
        state=state.decode() if state is not None else None,
        owner=(owner or b"").decode(),
        epoch=int(epoch or 0),
        losses=int(losses or 0),
        prompt_tokens=int(prompt_tokens or 0),
        generated=int(generated or 0),
        unowned_since_ms=int(unowned_since) if unowned_since else None,
        dispatched_at_ms=int(dispatched_at or 0),
        progressed_at_ms=int(progressed_at) if progressed_at else None,
        model=(model or b"").decode(),
    )


def read_progress(entries: list[TokenStreamEntry]) -> Progress:
    """What a token stream's entries say about the job so far."""
    started = False
    token_ids: list[int] = []
    finished = False
    for entry in entries:
        if isinstance(entry, StartEntry):
            started = True
        elif isinstance(entry, TokensEntry):
            token_ids += entry.token_ids
        elif isinstance(entry, FinishEntry):
            finished = True
    return Progress(started, token_ids, finished)


class Generations:
    """The ownership protocol of generation jobs, over a blocking client."""

    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._claim = redis.register_script(CLAIM_LUA)
        self._publish = redis.register_script(PUBLISH_LUA)
        self._publish_round = redis.register_script(PUBLISH_ROUND_LUA)
        self._unclaim = redis.register_script(UNCLAIM_LUA)
        self._redispatched = redis.register_script(REDISPATCHED_LUA)
        self._end_unowned = redis.register_script(END_UNOWNED_LUA)

    # --- GPU worker ----------------------------------------------------------------------------

    def claim(self, response_id: str, worker_id: str, publish_start: bool = False) -> Claim:
        """Take the job for ``worker_id`` if nobody owns it and it has not ended.

        ``publish_start``: the claimer has room in its engine now, so the claim also appends the
        start entry of a job never started (:attr:`Claim.started`): the post-processor opens the
        response while the engine computes its first token, instead of after it.
        """
        outcome, epoch, job_json, published, cancelled, started = self._claim(
            keys=[keys.generation(response_id), keys.cancel(response_id), keys.tokens(response_id)],
            args=[worker_id, "1" if publish_start else "0", self._ttl_s],
        )
        name = outcome.decode()
        if name != "claimed":
            return Claim(name)
        fence = Fence(worker_id, int(epoch))
        published, cancelled, started = bool(published), bool(cancelled), bool(started)
        try:
            job = GenerationJob.model_validate_json(job_json)
        except ValidationError as unreadable:
            # A job of a newer release that uses a field this worker lacks (a rolling upgrade):
            # the claim is held, so the caller ends it at once instead of leaving it to the watchdog.
            error = str(unreadable).splitlines()[0]
            return Claim(
                "unreadable", fence, None, error, published=published, cancelled=cancelled, started=started
            )
        return Claim("claimed", fence, job, published=published, cancelled=cancelled, started=started)

    def progress(self, response_id: str) -> Progress:
        """What the job's token stream holds (read after a claim: nobody else appends then)."""
        entries = range_entries(self._redis.xrange(keys.tokens(response_id)))
        return read_progress([decode_entry(fields) for _, fields in entries])

    def progress_after(self, response_id: str, claim: Claim) -> Progress:
        """:meth:`progress` for the holder of ``claim``, without a read when no earlier claim published
        (then the stream holds at most the start entry this claim appended)."""
        if not claim.published:
            return Progress(started=claim.started, token_ids=[], finished=False)
        return self.progress(response_id)

    def publish(
        self,
        pipe: Pipeline,
        response_id: str,
        fence: Fence,
        entry: TokenStreamEntry,
        at: int,
        check_cancel: bool = False,
    ) -> None:
        """Queue a fenced, exactly-once append on ``pipe`` (see :data:`PUBLISH_LUA` for its reply).

        ``at`` is the number of tokens of the response generated before ``entry``. With
        ``check_cancel`` (a tokens entry) the reply is ``[that, 1 when the response's cancel flag
        is set]`` (:func:`cancel_checked`). A finish entry also takes the job off the reaper's list
        (what :meth:`forget` does) in the same step.
        """
        streams, args = self._append_arguments(response_id, fence, entry, at, check_cancel)
        self._publish(keys=streams, args=args, client=pipe)

    def round(self) -> PublishRound:
        """An empty round of appends, to be queued as one command (:class:`PublishRound`)."""
        return PublishRound(self)

    def _append_arguments(
        self, response_id: str, fence: Fence, entry: TokenStreamEntry, at: int, check_cancel: bool
    ) -> tuple[list[str], list[EncodableT]]:
        """:data:`PUBLISH_LUA`'s KEYS and ARGV for one append (:meth:`publish`)."""
        streams = [keys.generation(response_id), keys.tokens(response_id)]
        fields = _flatten(encode_stream_entry(entry))
        if isinstance(entry, TokensEntry):
            kind, count = "tokens", len(entry.token_ids)
            if check_cancel:
                streams.append(keys.cancel(response_id))
        elif isinstance(entry, StartEntry):
            kind, count = "start", 0
        else:
            kind, count = "finish", 0
            streams.append(keys.GENERATIONS)
            fields.append(response_id)
        return streams, [fence.owner, fence.epoch, self._ttl_s, kind, at, count, *fields]

    def hand_back(self, response_id: str, fence: Fence, now_ms: int) -> bool:
        """Give an unfinished job back (the worker is stopping); True when it still held it."""
        losses = self._unclaim(
            keys=[keys.generation(response_id)], args=[fence.owner, fence.epoch, now_ms, "0"]
        )
        return int(losses) >= 0

    # --- reaper --------------------------------------------------------------------------------

    def release_lost(self, response_id: str, fence: Fence, now_ms: int) -> int | None:
        """Take the job from a dead owner; the losses so far, or None when the claim changed."""
        losses = int(
            self._unclaim(keys=[keys.generation(response_id)], args=[fence.owner, fence.epoch, now_ms, "1"])
        )
        return losses if losses >= 0 else None

    def mark_redispatched(self, response_id: str, epoch: int, now_ms: int) -> bool:
        """Record a new message for an unowned job; False when it was claimed or ended meanwhile."""
        return bool(self._redispatched(keys=[keys.generation(response_id)], args=[epoch, now_ms]))

    def end_unowned(self, response_id: str, epoch: int, entry: FinishEntry) -> bool:
        """Append the finish entry of a job nobody owns; False when it was claimed or ended meanwhile."""
        state = FAILED if entry.finish_reason == "error" else FINISHED
        return bool(
            self._end_unowned(
                keys=[keys.generation(response_id), keys.tokens(response_id)],
                args=[epoch, self._ttl_s, state, *_flatten(encode_stream_entry(entry))],
            )
        )

    def forget(self, response_id: str) -> None:
        """Take an ended (or vanished) job off the reaper's list."""
        self._redis.zrem(keys.GENERATIONS, response_id)


class PublishRound:
    """A round's fenced appends of every request, queued as one :data:`PUBLISH_ROUND_LUA` call.

    Each append is what :meth:`Generations.publish` queues, with the same reply; together they
    are one command and one reply in the publisher's transaction (one ``EVALSHA`` per request,
    and a queued reply for each, before). A round that fails fails whole, as its transaction
    did: every append is safe to send again.
    """

    def __init__(self, generations: Generations) -> None:
        self._generations = generations
        self._keys: list[str] = []
        self._args: list[EncodableT] = []
        self._count = 0

    def add(
        self, response_id: str, fence: Fence, entry: TokenStreamEntry, at: int, check_cancel: bool = False
    ) -> None:
        """Add the append :meth:`Generations.publish` would queue for the same arguments."""
        streams, args = self._generations._append_arguments(response_id, fence, entry, at, check_cancel)
        self._keys += streams
        self._args += [len(streams), len(args), *args]
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def queue(self, pipe: Pipeline) -> None:
        """Queue the round on ``pipe`` (nothing when it is empty); its reply is the list of the
        appends' replies, in the order added. The script rides on ``pipe``'s scripts, so a
        ``NOSCRIPT`` (a restarted Redis) loads it (:func:`gpu_worker.pipelines.execute`)."""
        if self._count:
            self._generations._publish_round(keys=self._keys, args=self._args, client=pipe)


def cancel_checked(reply: Any) -> tuple[int, bool]:
    """A ``check_cancel`` publish's reply (:meth:`Generations.publish`): its outcome, and whether
    the response's cancel flag is set."""
    outcome, cancelled = reply
    return int(outcome), bool(cancelled)


@dataclass(frozen=True, slots=True)
class Resumption:
    """How a claimed job enters the engine: from scratch, or after tokens a lost worker published."""

    job: GenerationJob
    """What the engine runs: the prompt plus the tokens already published, and the remaining budget."""
    prompt_tokens: int
    """The length of the original prompt (what the finish entry reports)."""
    already_generated: int
    """Tokens published before this claim; the engine's outputs come after them."""
    publish_start: bool
    """Whether the start entry is still missing from the token stream."""


def plan_resume(
    job: GenerationJob, progress: Progress, eos_token_ids: frozenset[int]
) -> Resumption | FinishEntry:
    """How to (re)start ``job`` given its stream, or the finish entry that is all it still lacks."""
    prompt_tokens = len(job.prompt_token_ids)
    already = len(progress.token_ids)
    if already and progress.token_ids[-1] in eos_token_ids:
        return FinishEntry("stop", prompt_tokens, already)
    if already >= job.max_output_tokens:
        return FinishEntry("length", prompt_tokens, already)
    if already:
        job = job.model_copy(
            update={
                "prompt_token_ids": job.prompt_token_ids + progress.token_ids,
                "max_output_tokens": job.max_output_tokens - already,
            }
        )
    return Resumption(job, prompt_tokens, already, not progress.started)
