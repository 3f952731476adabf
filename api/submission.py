"""Accepting a request: prompt, limits, the response record, and the two Celery messages."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from api.caller import Caller
from api.constraints import request_grammar
from api.errors import OpenAIError, invalid_value, rate_limited
from api.generation_plan import GenerationPlan, plan_generation
from api.input_items import normalise_input
from api.schemas import CreateResponseRequest, CustomTool, FunctionTool, JsonSchemaFormat, NamespaceTool, Tool
from api.state import AppState
from resq import ids, item_index, jsonutil, keys, sealed
from resq.catalog import TextTokenizer
from resq.chat_template import ChatTemplateError
from resq.conversation import continue_conversation, input_to_items, items_to_messages
from resq.events import builders as build
from resq.events import types
from resq.events.emitter import EncodedEvent, EventEmitter
from resq.logs import bind_response_id
from resq.options import ProcessingOptions
from resq.prompt_tokens import PromptTooLongError
from resq.recovery import generations
from resq.sealed import SealError
from resq.wire import GenerationJob

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
RETRY_AFTER_S = 1
"""``Retry-After`` of a 429 at capacity: slots free as generations end, typically within seconds."""


@dataclass(frozen=True)
class Accepted:
    """A response the API has recorded and enqueued."""

    response_id: str
    created: dict[str, Any]
    background: bool
    store: bool
    logged_events: list[EncodedEvent]


def initial_response(
    request: CreateResponseRequest, response_id: str, model: str, background: bool, store: bool
) -> dict[str, Any]:
    """The Response as ``response.created`` shows it: every SDK field, output empty."""
    return {
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
        "reasoning": request.reasoning.model_dump()
        if request.reasoning
        else {"effort": None, "summary": None},
        "safety_identifier": request.safety_identifier,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        # resq serves one tier, whichever the request asked for.
        "service_tier": "default",
        "store": store,
        "temperature": DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        "text": _text_echo(request),
        "tool_choice": _tool_choice_echo(request),
        "tools": [tool_echo(tool) for tool in request.tools or []],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": DEFAULT_TOP_P if request.top_p is None else request.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": request.user,
        "completed_at": None,
    }


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


async def resolve_input(state: AppState, items: list[dict[str, Any]], caller: Caller) -> list[dict[str, Any]]:
    """``items`` with every ``item_reference`` replaced by the item it names, and sealed reasoning opened.

    A reasoning item's ``encrypted_content`` (issued with ``include: ["reasoning.encrypted_content"]``)
    becomes its ``content`` again, the reasoning text exactly as the model wrote it. A reference
    to no item the caller may read, or a blob that does not open, is a 400 naming the item.
    """
    references = [
        (index, item["id"]) for index, item in enumerate(items) if item.get("type") == "item_reference"
    ]
    resolved = await state.store.referenced_items(references, caller)
    opened: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        item = resolved.get(index, item)
        blob = item.get("encrypted_content") if item.get("type") == "reasoning" else None
        if isinstance(blob, str):
            try:
                text = state.sealer.open(sealed.REASONING, caller.owner, blob)
            except SealError as exc:
                raise invalid_value(
                    f"Invalid 'input[{index}].encrypted_content': {exc}.",
                    f"input[{index}].encrypted_content",
                    "invalid_encrypted_content",
                ) from None
            item = {**item, "content": [{"type": "reasoning_text", "text": text}]}
        opened.append(item)
    return opened


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


def render_prompt(
    tokenizer: TextTokenizer,
    messages: list[dict[str, Any]],
    plan: GenerationPlan,
    max_tokens: int | None = None,
    wanted_output: int = 1,
) -> list[int]:
    """Prompt token ids of the conversation, through the model's chat template.

    Every client string is tokenized as text, never as control tokens. A prompt that must
    have more than ``max_tokens`` tokens is a 400 ``context_length_exceeded`` before the
    tokenizer runs (``wanted_output`` is for the error's message). CPU-bound: off the event loop.
    """
    try:
        token_ids = tokenizer.prompt_ids(messages, plan.template_tools, plan.template_context, max_tokens)
    except ChatTemplateError as exc:
        raise invalid_value(
            f"The model's chat template rejected the input: {exc}", "input", "invalid_prompt"
        ) from exc
    except PromptTooLongError as exc:
        context_length = tokenizer.card.context_length
        raise context_length_exceeded(context_length, f"at least {exc.at_least}", wanted_output) from None
    if not token_ids:
        raise invalid_value("The input renders to an empty prompt.", "input")
    return token_ids


def stop_token_ids(tokenizer: TextTokenizer, plan: GenerationPlan) -> list[int]:
    """Tokens that end this request besides the model's own end tokens.

    Only a stop text that is one token of the vocabulary can stop the engine; otherwise
    the post-processor alone ends the answer there (generation runs on, unseen).
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
        raise context_length_exceeded(context_length, str(prompt_tokens), wanted)
    return min(wanted, room)


def context_length_exceeded(context_length: int, prompt_tokens: str, wanted: int) -> OpenAIError:
    """The 400 for a prompt (``prompt_tokens`` long, as said) that leaves too little room."""
    return OpenAIError(
        400,
        f"This model's maximum context length is {context_length} tokens. However, your input has "
        f"{prompt_tokens} tokens and asks for {wanted} output tokens. Please reduce the input or "
        "max_output_tokens.",
        param="input",
        code="context_length_exceeded",
    )


async def accept(state: AppState, request: CreateResponseRequest, caller: Caller) -> Accepted:
    """Validate what pydantic cannot, record the response, log its first events, and enqueue it."""
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

    tokenizer = await state.catalog.get(request.model)
    if tokenizer is None:
        raise OpenAIError(
            404,
            f"The model '{request.model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    new_items = input_to_items(
        [item.model_dump(exclude_none=True) for item in request.input]
        if isinstance(request.input, list)
        else request.input
    )
    if not new_items:
        raise invalid_value("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    new_items = await resolve_input(state, new_items, caller)
    response_id = ids.new_response_id()
    bind_response_id(response_id)
    own_items = normalise_input(new_items, response_id)
    conversation = own_items
    if request.previous_response_id is not None:
        earlier = await state.store.earlier_conversation(request.previous_response_id, caller)
        conversation = continue_conversation(earlier.conversation, earlier.output, own_items)
    try:
        messages = items_to_messages(conversation, request.instructions)
    except ValueError as exc:
        raise invalid_value(str(exc), "input") from exc
    plan = plan_generation(
        request,
        tokenizer.card,
        settings.tool_parser,
        settings.reasoning_parser,
        refuse_hosted=settings.hosted_tools == "refuse",
    )
    # Compiling a grammar can take a while for a large schema: never on the event loop.
    grammar = await asyncio.to_thread(request_grammar, request, plan, tokenizer)
    # The forced prefix is server text: its markup must stay control tokens.
    forced_ids = tokenizer.encode(plan.forced_prefix) if plan.forced_prefix else []
    context_length = tokenizer.card.context_length
    default_output = min(settings.default_max_output_tokens, cap)
    # Rendering and tokenizing take seconds for a few MB: never on the event loop, and never
    # on more text than the context can hold (render_prompt refuses that before tokenizing).
    # The bound leaves out max_output_tokens: a prompt that fits is counted exactly, below.
    max_prompt_tokens = context_length - len(forced_ids) - 1
    prompt_ids = await state.off_loop(
        render_prompt,
        tokenizer,
        messages,
        plan,
        max_prompt_tokens,
        request.max_output_tokens or default_output,
    )
    prompt_ids += forced_ids
    limit = generation_limit(request, len(prompt_ids), context_length, default_output)

    model = tokenizer.card.name
    created = initial_response(request, response_id, model, background, store)
    emitter = EventEmitter(0)
    logged = [emitter.emit(build.response_event(types.CREATED, created))]
    if background:
        logged.append(emitter.emit(build.response_event(types.QUEUED, created)))
    options = ProcessingOptions(
        model=model,
        background=background,
        store=store,
        first_sequence_number=len(logged),
        reasoning_parser=settings.reasoning_parser,
        tool_parser=settings.tool_parser,
        tools_enabled=plan.tools_enabled,
        custom_tools=plan.custom_tools,
        raw_input_tools=plan.raw_input_tools,
        max_function_calls=plan.max_calls,
        forced_prefix_ids=tuple(forced_ids),
        logprobs=plan.logprobs,
        reasoning_summary=request.reasoning is not None and request.reasoning.wants_summary,
        seal_reasoning_for=caller.owner if request.wants_encrypted_reasoning else None,
    )
    # The conversation is stored whole (not as a link to the earlier response), so a
    # continuation keeps working when an earlier response expires or is deleted.
    input_record = {"items": own_items, "conversation": conversation}

    job = GenerationJob(
        response_id=response_id,
        model=model,
        prompt_token_ids=prompt_ids,
        max_output_tokens=limit,
        temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=DEFAULT_TOP_P if request.top_p is None else request.top_p,
        stop_token_ids=stop_token_ids(tokenizer, plan),
        logprobs=plan.logprobs,
        grammar=grammar,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
    )

    created_json = jsonutil.dumps(created)
    ttl = settings.transient_ttl_s
    if not await state.track_for_recovery(response_id):
        raise rate_limited(
            f"The server is at capacity ({settings.max_pending} generations queued or running); "
            "please retry shortly.",
            RETRY_AFTER_S,
        )
    pipe = state.redis.pipeline(transaction=True)
    pipe.hset(
        keys.record(response_id),
        mapping={
            "status": created["status"],
            "created": created_json,
            "response": created_json,
            "options": options.model_dump_json(),
            "store": "1" if store else "0",
            "background": "1" if background else "0",
            "owner": caller.owner,
        },
    )
    pipe.expire(keys.record(response_id), ttl)
    for event in logged:
        pipe.xadd(
            keys.events(response_id),
            {"type": event.type, "data": event.data},
            id=keys.event_entry_id(event.sequence_number),
        )
    pipe.expire(keys.events(response_id), ttl)
    pipe.set(keys.input_items(response_id), jsonutil.dumps(input_record), ex=ttl)
    if store:
        item_index.index_items(
            pipe, caller.owner, response_id, own_items, item_index.INPUT, settings.store_ttl_s
        )
    generations.stage(pipe, job, ttl, int(time.time() * 1000))
    await pipe.execute()

    # Both messages at once: each publish is a blocking round trip (~1 ms) on a pool thread,
    # and the first token waits for the generate message.
    await asyncio.gather(state.dispatch_generation(response_id), state.start_postprocessing(response_id))
    log.info(
        "accepted: %d prompt tokens, at most %d new, stream=%s", len(prompt_ids), limit, bool(request.stream)
    )
    return Accepted(response_id, created, background, store, logged)
