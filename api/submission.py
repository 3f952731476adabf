"""Accepting a request: prompt, limits, the response record, and the two Celery messages."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from api import compaction
from api.caller import Caller
from api.chat import ChatExtras, completion_template
from api.constraints import request_grammar
from api.errors import OpenAIError, invalid_value, rate_limited
from api.event_hub import EventHub, OpenedLog
from api.generation_plan import GenerationPlan
from api.prompting import (
    FittedPrompt,
    PromptPlan,
    RequestItems,
    context_length_exceeded,
    gather_items,
    has_cache_breakpoint,
    plan_prompt,
    summary_sees_nothing,
)
from api.relay import wait_for_terminal
from api.sampling import OPENAI_SAMPLING, Sampling, request_sampling
from api.schemas import CreateResponseRequest, CustomTool, FunctionTool, JsonSchemaFormat, NamespaceTool, Tool
from api.state import AppState, in_an_accept_slot
from api.store import EarlierConversation, previous_response_not_found
from resq import affinity, faults, ids, item_index, jsonutil, keys, records, turns
from resq.catalog import TextTokenizer
from resq.conversation import since_last_compaction
from resq.events import builders as build
from resq.events import types
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.logs import bind_response_id
from resq.options import ProcessingOptions
from resq.postprocess import event_log
from resq.recovery import generations
from resq.settings import Settings
from resq.status import ENDPOINT_OF_PROTOCOL, ResponseStatus
from resq.truncation import turn_starts
from resq.wire import GenerationJob

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 at capacity: slots free as generations end, typically within seconds."""


@dataclass(frozen=True)
class Accepted:
    """A response the API has recorded and enqueued."""

    response_id: str
    created: dict[str, Any]
    background: bool
    store: bool
    conversation: list[dict[str, Any]] = field(default_factory=list)
    """Every item the model was given (before truncation), reasoning sent sealed still sealed: what
    a continuation extends (a WebSocket remembers it for an unstored response)."""
    opened: OpenedLog | None = None
    """The event log, followed since its creation (``accept(..., follow=True)``): the relay's.
    Its relay closes it; unclosed, it stops following when this object is collected."""


def initial_response(
    request: CreateResponseRequest,
    response_id: str,
    model: str,
    background: bool,
    store: bool,
    sampling: Sampling = OPENAI_SAMPLING,
) -> dict[str, Any]:
    """The Response as ``response.created`` shows it: every SDK field, output empty.

    ``sampling``: the ``temperature`` and ``top_p`` used (:func:`api.sampling.request_sampling`).
    """
    response: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "queued" if background else "in_progress",
        "background": background,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "metadata": request.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "prompt_cache_key": request.prompt_cache_key,
        "prompt_cache_retention": request.prompt_cache_retention,
        "prompt_cache_options": request.prompt_cache_options.echo() if request.prompt_cache_options else None,
        "reasoning": request.reasoning.model_dump()
        if request.reasoning
        else {"effort": None, "summary": None},
        "safety_identifier": request.safety_identifier,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        # resq serves one tier, whichever the request asked for.
        "service_tier": "default",
        "store": store,
        "temperature": sampling.temperature,
        "text": _text_echo(request),
        "tool_choice": _tool_choice_echo(request),
        "tools": [tool_echo(tool) for tool in request.tools or []],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": sampling.top_p,
        "truncation": request.truncation or "disabled",
        "usage": None,
        "user": request.user,
        "completed_at": None,
    }
    if request.conversation_id is not None:
        response["conversation"] = {"id": request.conversation_id}
    return response


_NULLABLE_TOOL_KEYS: dict[type[Any], tuple[str, ...]] = {
    FunctionTool: ("description", "parameters", "strict"),
    CustomTool: ("description",),
    NamespaceTool: ("description",),
}
"""Keys the Response shows for a tool even when the request left them out (as null)."""


def tool_echo(tool: Tool) -> dict[str, Any]:
    """A tool as the Response shows it: what was sent, with the nullable keys present."""
    echoed: dict[str, Any] = tool.model_dump(by_alias=True, exclude_unset=True)
    for key in _NULLABLE_TOOL_KEYS.get(type(tool), ()):
        echoed.setdefault(key, None)
    if isinstance(tool, NamespaceTool):
        echoed["tools"] = [tool_echo(inner) for inner in tool.tools]
    return echoed


def _text_echo(request: CreateResponseRequest) -> dict[str, Any]:
    """``text`` as the Response shows it: the format as sent (``{"type": "text"}`` by default), a
    ``json_schema`` one with its ``description`` and ``strict`` keys always present."""
    text = request.text
    echoed: dict[str, Any] = {"format": {"type": "text"}}
    if text is not None and text.format is not None:
        echoed["format"] = text.format.model_dump(by_alias=True, exclude_unset=True)
        if isinstance(text.format, JsonSchemaFormat):
            # Every key the Response has, as the Open Responses spec requires; `strict` says what
            # resq does whatever was sent: the schema is always enforced.
            echoed["format"].setdefault("description", None)
            echoed["format"]["strict"] = True if text.format.strict is None else text.format.strict
    if text is not None and text.verbosity:
        echoed["verbosity"] = text.verbosity
    return echoed


def _tool_choice_echo(request: CreateResponseRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    return choice.model_dump()


def stop_token_ids(tokenizer: TextTokenizer, plan: GenerationPlan) -> list[int]:
    """Tokens that end this request besides the model's own end tokens: the end tag of a single
    forced call, when it is one token of the vocabulary.

    Chat's ``stop`` strings never stop the engine: they are searched in the answer text only
    (:mod:`resq.postprocess.stops`), and the post-processor stops the engine once one matched. As
    engine stop tokens, a one-token stop string ended reasoning and tool calls too, and matched
    the vocabulary's spelling (``Ġ4``), not the text.
    """
    if plan.stop_after is None:
        return []
    token_id = tokenizer.tokenizer.token_to_id(plan.stop_after)
    return [] if token_id is None else [token_id]


def generation_limit(
    request: CreateResponseRequest, prompt_tokens: int, context_length: int, default: int
) -> int:
    """``max_new_tokens`` for the engine; 400 when the prompt leaves no room."""
    wanted = request.max_output_tokens or default
    room = context_length - prompt_tokens
    if room < 1 or (request.max_output_tokens is not None and room < request.max_output_tokens):
        raise context_length_exceeded(
            context_length, str(prompt_tokens), wanted, truncating=request.truncation == "auto"
        )
    return min(wanted, room)


async def _compacted_if_over(
    state: AppState, request: CreateResponseRequest, items: RequestItems, prompt: PromptPlan, caller: Caller
) -> tuple[RequestItems, list[dict[str, Any]], FittedPrompt | None]:
    """``context_management`` compaction: past the threshold, the conversation is summarised first.

    The summary is a generation of its own through the queue (:mod:`api.compaction`), waited for
    here, before this response is recorded. Its compaction item stands for the whole conversation
    so far, input included; the model then sees it and the last turn again, and the Response shows
    it as its first output item (so a conversation, or a continuation, goes on from it). Below the
    threshold, the prompt counted is returned when it is the one the create renders (so it is not
    rendered twice).
    """
    counted = await prompt.fit(state, request, items, caller, counting=True)
    total = prompt.total(counted)
    context_length = prompt.tokenizer.card.context_length
    threshold = request.compact_threshold or context_length - (
        request.max_output_tokens or prompt.default_output
    )
    if total <= threshold:
        # Counting renders past the context (a create would refuse): the same prompt when it fits.
        reusable = request.truncation == "auto" or total < context_length
        return items, [], counted if reusable else None
    history = since_last_compaction(items.conversation)
    budget = compaction.summary_budget(len(counted.token_ids), state.settings.compaction_max_output_tokens)
    summarising = compaction.summary_of(prompt.tokenizer.card.name, history, request.instructions, budget)
    if await summary_sees_nothing(state, summarising, prompt.tokenizer, caller):
        raise compaction.nothing_to_summarise(prompt.tokenizer.card.context_length)
    summary = await accept(state, summarising, caller)
    async with state.accept_slots.given_up():  # the summary may take a while: let others in
        final_json = await wait_for_terminal(state.redis, summary.response_id)
    await state.store.delete_keys(summary.response_id)
    if final_json is None:
        raise OpenAIError(500, "Compaction failed: the summary response vanished.", type="server_error")
    final = compaction.finished_summary(final_json)
    item = compaction.compaction_item(
        state.sealer, caller.owner, summary.response_id, compaction.summary_text(final)
    )
    last_turn = turn_starts(items.conversation)[-1]
    log.info(
        "context_management: %d prompt tokens passed %d; compacted %d items with %s",
        total,
        threshold,
        len(history),
        summary.response_id,
    )
    return items.compacted(item, last_turn), [item], None


def _cache_owner(caches: bool, caller: Caller, response_id: str) -> str:
    """The space the job's prompt pages are hashed in (:mod:`gpu_worker.prefix_cache`): the caller's.

    A request that uses no prompt cache (:func:`_caches`) gets a space of its own, so it reuses no
    page and leaves none another request can reuse, and its ``cached_tokens`` is 0.
    """
    return caller.owner if caches else f"{caller.owner}/uncached/{response_id}"


def _caches(request: CreateResponseRequest, items: RequestItems) -> bool:
    """Whether the request uses the prompt cache: not with ``prompt_cache_options.mode: "explicit"``
    and no breakpoint in its prompt (as OpenAI's). Its own input is read as sent too: a breakpoint on
    an assistant message's part is not kept on the stored item."""
    options = request.prompt_cache_options
    if options is None or options.mode != "explicit":
        return True  # breakpoints decide nothing then: the prompt is not scanned for them
    sent = (
        [item.model_dump(exclude_none=True) for item in request.input]
        if isinstance(request.input, list)
        else []
    )
    return options.caches(has_cache_breakpoint(items.conversation) or has_cache_breakpoint(sent))


async def served_tokenizer(state: AppState, model: str) -> TextTokenizer:
    """The tokenizer (and card) of the served model ``model``; 404 ``model_not_found`` otherwise."""
    tokenizer = await state.catalog.get(model)
    if tokenizer is None:
        raise OpenAIError(
            404,
            f"The model '{model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return tokenizer


@in_an_accept_slot
async def accept(
    state: AppState,
    request: CreateResponseRequest,
    caller: Caller,
    local_history: dict[str, EarlierConversation] | None = None,
    chat: ChatExtras | None = None,
    follow: bool = False,
    generate: bool = True,
) -> Accepted:
    """Validate what pydantic cannot, record the response, log its first events, and enqueue it.

    ``generate`` False (the WebSocket mode's ``generate: false``), like
    ``prompt_cache_options.prewarm``: the prompt is computed and no token generated (a prefill-only
    job): the response completes with no output once the engine has its pages cached, and a later
    turn continues it.

    ``local_history``: earlier responses a WebSocket keeps in memory (``store: false`` ones can be
    continued there), by id. ``chat``: the request came as a chat completion (:mod:`api.chat`):
    it speaks the ``chat`` protocol, and its log starts empty (chunks only). A bounded number of
    requests are accepted at once (:class:`api.state.AcceptSlots`); the others wait their turn
    before any of their work starts. ``follow``: the caller relays the events at once; the
    process's event hub follows the log from its creation (:attr:`Accepted.opened`).
    """
    settings = state.settings
    background = bool(request.background)
    store = True if request.store is None else request.store
    if background and not store:
        raise invalid_value("Background responses require 'store' to be true.", "background")
    cap = settings.max_output_tokens_cap
    if request.max_output_tokens is not None and request.max_output_tokens > cap:
        raise invalid_value(
            f"Invalid 'max_output_tokens': {request.max_output_tokens}. This server allows at most {cap}.",
            "max_output_tokens",
        )

    tokenizer = await served_tokenizer(state, request.model)
    response_id = ids.new_response_id()
    bind_response_id(response_id)
    # `prompt_cache_options.prewarm` or a socket's `generate: false`: the prompt is computed and
    # nothing generated (no forced opening of a call either); its instructions alone may be it.
    prewarm = request.prompt_cache_options is not None and bool(request.prompt_cache_options.prewarm)
    prefill_only = prewarm or not generate
    items = await gather_items(
        state, request, caller, response_id, local_history, instructions_alone=prefill_only
    )
    prompt = plan_prompt(settings, request, tokenizer)
    plan, forced_ids = prompt.plan, prompt.forced_ids
    if prefill_only:
        forced_ids = []
    # Compiling a grammar can take a while for a large schema: never on the event loop. (Without
    # constraints there is nothing to compile, and no thread hop either.)
    grammar = (
        await asyncio.to_thread(request_grammar, request, plan, tokenizer)
        if plan.answer_shape is not None
        else None
    )
    leading_output: list[dict[str, Any]] = []
    fitted: FittedPrompt | None = None
    caches = _caches(request, items)
    if prewarm and not caches:
        raise invalid_value(
            "A prewarm with prompt_cache_options.mode 'explicit' needs a prompt_cache_breakpoint in "
            "its prompt: without one the request uses no cache, and there is nothing to prepare.",
            "prompt_cache_options.mode",
        )
    # A prefill-only request generates nothing, a summary neither: its prompt is computed as it is.
    if request.context_management and not prefill_only:
        items, leading_output, fitted = await _compacted_if_over(state, request, items, prompt, caller)
    # Never on more text than the context can hold: render_prompt refuses that before tokenizing.
    if fitted is None:
        fitted = await prompt.fit(state, request, items, caller)
    prompt_ids = fitted.token_ids + forced_ids
    limit = generation_limit(request, len(prompt_ids), tokenizer.card.context_length, prompt.default_output)

    model = tokenizer.card.name
    sampling = request_sampling(request.temperature, request.top_p, tokenizer.card)
    emitter = EventEmitter(0, stamps=chat is None)
    if chat is not None:
        created = completion_template(response_id, model)
        record_status: ResponseStatus = "in_progress"
        logged = [emitter.emit({"type": types.CHAT_CREATED, **created})]
    else:
        created = initial_response(request, response_id, model, background, store, sampling)
        record_status = created["status"]
        logged = [emitter.emit(build.response_event(types.CREATED, created))]
        # A background response is queued until a GPU worker starts it (its post-processor logs
        # `response.in_progress` then). A foreground one is in progress from its creation, as
        # OpenAI's: both opening events go out now, and the post-processor's start logs nothing,
        # which spares it a round trip and the relay a wake-up while the first token is computed.
        second = types.QUEUED if background else types.IN_PROGRESS
        logged.append(emitter.emit(build.response_event(second, created)))
    options = ProcessingOptions(
        model=model,
        protocol="responses" if chat is None else "chat",
        stop=chat.stop if chat is not None else (),
        include_usage=chat.include_usage if chat is not None else False,
        first_sequence_number=len(logged),
        in_progress_logged=chat is None and not background,
        reasoning_parser=settings.reasoning_parser,
        tool_parser=settings.tool_parser,
        tools_enabled=plan.tools_enabled,
        custom_tools=plan.custom_tools,
        raw_input_tools=plan.raw_input_tools,
        answer_constrained=plan.answer_shape is not None,
        max_function_calls=plan.max_calls,
        forced_prefix_ids=tuple(forced_ids),
        logprobs=plan.logprobs,
        reasoning_summary=request.reasoning is not None and request.reasoning.wants_summary,
        seal_reasoning_for=caller.owner if request.wants_encrypted_reasoning else None,
        conversation_id=items.conversation_id,
        leading_output=tuple(leading_output),
    )
    # Each turn is stored once (resq.turns): a continuation walks the chain of turns. A chain from
    # before turns existed, and a conversation's response, keep what they had. An unstored
    # response's input is never read back (its input items, its continuation and its item
    # references all answer 404) unless its conversation takes its items: not written
    # otherwise, where a Codex turn resends its whole history every time.
    input_record: dict[str, Any] | None = None
    if store or items.conversation_id is not None:
        input_record = {"items": items.own}
        if items.conversation_id is not None:
            input_record["conversation_id"] = items.conversation_id
        elif not items.linked:
            input_record["conversation"] = items.sealed_conversation
    turn_parent = request.previous_response_id if items.linked else None
    linked_turn = store and items.conversation_id is None and items.linked

    routing = affinity.routing_keys(
        model, response_id, request.prompt_cache_key, items.conversation_id, request.previous_response_id
    )
    job = GenerationJob(
        response_id=response_id,
        model=model,
        # A job that uses no cache leaves nothing for a next turn to find on its worker.
        affinity_keys=list(routing.record) if caches else [],
        prompt_token_ids=prompt_ids,
        # A prefill-only job's steps are the engine's to choose (Engine.add), not the request's.
        max_output_tokens=1 if prefill_only else limit,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop_token_ids=stop_token_ids(tokenizer, plan),
        logprobs=plan.logprobs and not prefill_only,
        # Alternatives come with the logprobs they belong to (include message.output_text.logprobs).
        top_logprobs=(request.top_logprobs or 0) if plan.logprobs and not prefill_only else 0,
        grammar=None if prefill_only else grammar,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        seed=chat.seed if chat is not None else None,
        cache_owner=_cache_owner(caches, caller, response_id),
        prefill_only=prefill_only,
    )

    created_json = jsonutil.dumps(created)
    ttl = settings.transient_ttl_s

    record = records.NewRecord(record_status, created_json, options, store, background, caller.owner)
    new = _NewResponse(response_id, record, logged, input_record, items.own, turn_parent, linked_turn)
    routed = await state.route_generation(model, routing.lookup)
    # The relay's follower joins before the log exists: no catch-up read of what is logged here,
    # and the hub's wake-up (if its read needs one) goes in the step below.
    opened = EventHub.of(state.redis).open_new(keys.events(response_id), logged) if follow else None
    try:
        pipe = state.redis.pipeline(transaction=True)
        # The step's guards: nothing below is written when the turn it continues went meanwhile,
        # or when the server is at capacity (the admission, the one guard that writes, goes last).
        guards = _stage_parent_guard(pipe, new)
        state.stage_admission(pipe, response_id, caller.owner)
        state.stage_recovery(pipe, response_id)
        _stage_response(pipe, settings, new)
        generations.stage(pipe, job, ttl, int(time.time() * 1000))
        # The Celery messages go in the same step: no window where the job is recorded but not
        # sent, and no round trip (nor thread hop) of their own before the first token.
        await state.queue_messages(pipe, response_id, model, routed.worker)
        if opened is not None:
            opened.stage_wake(pipe)
        refused = await state.guarded_step.execute(pipe, guards + 1)
        if refused is not None and refused <= guards:
            raise previous_response_not_found(str(new.turn_parent))
        if refused is not None:
            if settings.max_pending_per_key and caller.owner and not await state.cluster_full():
                raise rate_limited(
                    f"This API key has {settings.max_pending_per_key} generations queued or running, "
                    "its share of the server; please retry once one ends.",
                    RETRY_AFTER_S,
                )
            raise rate_limited(
                f"The server is at capacity ({settings.max_pending} generations queued or running); "
                "please retry shortly.",
                RETRY_AFTER_S,
            )
        faults.reached("api.after_record")
    except BaseException:  # refused, failed, or stopped after the step: the relay's join is undone
        if opened is not None:
            await opened.abandon()
        raise
    state.count_routed(routed)
    state.start_inline(response_id)
    log.info(
        "accepted: %d prompt tokens, at most %d new, stream=%s, endpoint=%s",
        len(prompt_ids),
        limit,
        bool(request.stream),
        ENDPOINT_OF_PROTOCOL[options.protocol],
    )
    return Accepted(response_id, created, background, store, items.sealed_conversation, opened)


@dataclass(frozen=True)
class _NewResponse:
    """What recording a new response writes: its record, its first events, its input and turn."""

    response_id: str
    record: records.NewRecord
    logged: list[EncodedEvent]
    input_record: dict[str, Any] | None
    """What its input items are read back from; None for an unstored response (never read)."""
    own: list[dict[str, Any]]
    """Its input items, normalised (the turn's, and the item index's)."""
    turn_parent: str | None
    linked_turn: bool
    """A stored turn of its own extends the chain (:mod:`resq.turns`)."""


def _stage_parent_guard(pipe: Any, new: _NewResponse) -> int:
    """Queue the guard that the turn ``new`` continues is still there; the guards queued (0 or 1).

    The request read that turn's history before its step; a delete of that response in between
    would leave ``new`` recorded with no turn of its own, which could never be continued.
    """
    if new.linked_turn and new.turn_parent:
        turns.stage_parent_check(pipe, new.turn_parent)
        return 1
    return 0


def _stage_response(pipe: Any, settings: Settings, new: _NewResponse) -> None:
    """Queue on ``pipe`` the commands that record ``new`` (expiring as transient until it ends)."""
    ttl = settings.transient_ttl_s
    response_id = new.response_id
    records.create(pipe, response_id, new.record, ttl)
    event_log.stage_first_events(pipe, response_id, new.logged, ttl)
    if new.input_record is not None:
        pipe.set(keys.input_items(response_id), jsonutil.dumps(new.input_record), ex=ttl)
    if new.linked_turn:
        # It may be continued once it ends: no turn may expire before it, nor its children.
        turn_ttl = settings.store_ttl_s + ttl
        pipe.eval(
            turns.CREATE_LUA,
            1,
            keys.turn(response_id),
            *turns.create_arguments(new.turn_parent, new.own, turn_ttl, turn_ttl),
        )
    if new.record.store:
        item_index.index_items(
            pipe, new.record.owner, response_id, new.own, item_index.INPUT, settings.store_ttl_s
        )
