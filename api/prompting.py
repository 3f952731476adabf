"""From a request to the prompt the engine sees: its items, its history, truncation, its token ids.

``POST /v1/responses`` and ``POST /v1/responses/input_tokens`` share this path, so
the count the second returns is exactly the prompt the first would enqueue.

1. :func:`gather_items`: the request's input (references resolved, sealed
   reasoning opened, compaction items checked) and the history it continues:
   a ``previous_response_id``'s conversation or a ``conversation``'s items.
2. :func:`fit_prompt` (CPU-bound: on the prompt pool): the items from the last
   compaction on, through the chat template, and for ``truncation: "auto"`` the
   oldest turns dropped until prompt and output budget fit the context
   (:mod:`resq.truncation`), found by bisection over the number of turns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from api.caller import Caller
from api.conversations import check_item_id
from api.errors import OpenAIError, invalid_value
from api.generation_plan import GenerationPlan, plan_generation
from api.input_items import duplicate_id, normalise_input
from api.schemas import CreateResponseRequest
from api.sealed_items import opened_text
from api.state import AppState
from api.store import EarlierConversation
from resq import ids, sealed
from resq.catalog import TextTokenizer
from resq.chat_template import ChatTemplateError
from resq.conversation import (
    continue_conversation,
    input_to_items,
    items_to_messages,
    since_last_compaction,
    unanswerable_output,
)
from resq.prompt_tokens import PromptTooLongError
from resq.sealed import Sealer, SealError
from resq.settings import Settings
from resq.truncation import drop_oldest_turns, droppable_turns

log = logging.getLogger(__name__)

Item = dict[str, Any]

DEFAULT_ANSWER_SHARE = 4
"""Without ``max_output_tokens``, truncation leaves the answer 1/this of the context (or the default, if less)."""
COUNT_BOUND_CONTEXTS = 4
"""``input_tokens`` counts a prompt up to this many context lengths (beyond: a 400, as a create)."""


@dataclass(frozen=True)
class RequestItems:
    """The items of one request: its own (as ``input_items`` lists them) and all the model is given."""

    own: list[Item]
    """The request's input items, normalised, with ids, as sent: what is stored (sealed reasoning
    stays sealed)."""
    conversation: list[Item]
    """The history it continues, then ``own``, sealed reasoning opened: what the model sees before
    truncation."""
    sealed_conversation: list[Item]
    """``conversation`` item for item, with reasoning sent sealed still sealed: what a record, or a
    socket's memory, keeps of it (never opened text; opened again for each prompt)."""
    conversation_id: str | None = None
    """The ``conversation`` the response belongs to, if any."""
    linked: bool = True
    """The history is a chain of turns the response's turn extends (:mod:`resq.turns`); False
    when it continues a response stored whole (before turns existed, or a WebSocket's unstored
    one)."""

    def compacted(self, summary: Item, first_kept: int) -> RequestItems:
        """These items after a compaction: ``summary``, then the conversation from ``first_kept`` on."""
        return replace(
            self,
            conversation=[summary, *self.conversation[first_kept:]],
            sealed_conversation=[summary, *self.sealed_conversation[first_kept:]],
        )


def has_cache_breakpoint(items: list[Item]) -> bool:
    """Whether any part of ``items`` (a message's ``content``, a tool output's ``output``) carries a
    ``prompt_cache_breakpoint``."""
    for item in items:
        for field in ("content", "output"):
            parts = item.get(field)
            if isinstance(parts, list) and any(
                isinstance(part, dict) and part.get("prompt_cache_breakpoint") is not None for part in parts
            ):
                return True
    return False


@dataclass(frozen=True)
class FittedPrompt:
    """The prompt's token ids, and what truncation left out to fit them."""

    token_ids: list[int]
    dropped_turns: int = 0
    dropped_items: int = 0


async def resolve_input(state: AppState, items: list[Item], caller: Caller) -> list[Item]:
    """``items`` with every ``item_reference`` replaced by the item it names, sealed content checked.

    Sealed items stay sealed: they are stored as the client sent them (a reasoning item sent with
    only its ``encrypted_content``, by a ``store: false`` client such as Codex, was stored and
    listed with its text opened). :func:`opened_for_prompt` opens them for a prompt. A reference
    to no item the caller may read, or a blob that does not open, is a 400 naming the item.
    """
    references = [
        (index, item["id"]) for index, item in enumerate(items) if item.get("type") == "item_reference"
    ]
    resolved = await state.store.referenced_items(references, caller)
    checked: list[Item] = []
    for index, item in enumerate(items):
        item = resolved.get(index, item)
        opened_text(item, state.sealer, caller.owner, f"input[{index}]")
        checked.append(item)
    return checked


def opened_for_prompt(items: list[Item], sealer: Sealer, owner: str) -> list[Item]:
    """A request's own ``items`` as a prompt renders them: a reasoning item's ``encrypted_content``
    (issued with ``include: ["reasoning.encrypted_content"]``) becomes its ``content`` again, the
    reasoning text exactly as the model wrote it. A compaction item stays sealed (its summary is
    opened for the template later). Never stored so. Checked by :func:`resolve_input` first."""
    opened: list[Item] = []
    for index, item in enumerate(items):
        text = (
            opened_text(item, sealer, owner, f"input[{index}]") if item.get("type") == "reasoning" else None
        )
        if text is not None:
            item = {**item, "content": [{"type": "reasoning_text", "text": text}]}
        opened.append(item)
    return opened


def opened_history(items: list[Item], sealer: Sealer, owner: str) -> list[Item]:
    """Stored history as a prompt renders it: a reasoning item kept sealed (sent back with its blob
    only) is opened; one stored with its text (a response's own output) is used as it is. A blob
    that no longer opens (the secret changed) leaves its item without the text, with a warning,
    instead of a 400 that no request could get past: the history is stored, not the client's to
    resend."""
    opened: list[Item] = []
    for item in items:
        if item.get("type") == "reasoning" and not item.get("content") and item.get("encrypted_content"):
            try:
                text = opened_text(item, sealer, owner, "history")
            except OpenAIError:
                log.warning("a sealed reasoning item of the history no longer opens; left out of the prompt")
                text = None
            if text is not None:
                item = {**item, "content": [{"type": "reasoning_text", "text": text}]}
        opened.append(item)
    return opened


def conflicting_history(request: CreateResponseRequest) -> OpenAIError | None:
    """The 400 for a request that names both kinds of history, if it does."""
    if request.previous_response_id is not None and request.conversation is not None:
        return invalid_value(
            "Mutually exclusive parameters: 'previous_response_id' and 'conversation'. Send one: a "
            "conversation already holds the earlier responses' items.",
            "conversation",
        )
    return None


def check_outputs_answer_calls(items: RequestItems) -> RequestItems:
    """``items``, or a 400 naming the first new tool output whose call the conversation lacks."""
    first_own = len(items.conversation) - len(items.own)
    orphan = unanswerable_output(items.conversation, first_own)
    if orphan is not None:
        call_id = items.conversation[orphan].get("call_id")
        raise invalid_value(
            f"No tool call found for function call output with call_id '{call_id}'.",
            f"input[{orphan - first_own}].call_id",
        )
    return items


async def gather_items(
    state: AppState,
    request: CreateResponseRequest,
    caller: Caller,
    response_id: str,
    local_history: dict[str, EarlierConversation] | None = None,
    input_required: bool = True,
    instructions_alone: bool = False,
) -> RequestItems:
    """The request's items and the history it continues (400/404 for what cannot be continued).

    A ``previous_response_id`` found in ``local_history`` (a WebSocket's memory of its last
    response) continues from there, stored or not. ``input_required`` False: a request that
    continues a history may bring no new input (a count, or a compaction, of that history alone).
    ``instructions_alone``: a prefill-only request (a prewarm) may bring its instructions and no
    input.
    """
    conflict = conflicting_history(request)
    if conflict is not None:
        raise conflict
    new_items = input_to_items(
        [item.model_dump(exclude_none=True) for item in request.input]
        if isinstance(request.input, list)
        else request.input
    )
    continues = request.previous_response_id is not None or request.conversation_id is not None
    # A prewarm of the instructions alone (the session's start, before its first message) has a prompt.
    instructions_prewarm = instructions_alone and bool(request.instructions)
    if not new_items and (input_required or not continues) and not instructions_prewarm:
        raise invalid_value("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    # Stored as sent (sealed reasoning stays sealed); the prompt gets them opened.
    own = normalise_input(await resolve_input(state, new_items, caller), response_id)
    sealer, owner = state.sealer, caller.owner
    own_opened = opened_for_prompt(own, sealer, owner)
    conversation_id = request.conversation_id
    if request.previous_response_id is not None:
        earlier = (local_history or {}).get(request.previous_response_id) or (
            await state.store.earlier_conversation(request.previous_response_id, caller)
        )
        _check_unique_ids(own, [*earlier.conversation, *earlier.output])
        history = opened_history(earlier.conversation, sealer, owner)
        conversation = continue_conversation(history, earlier.output, own_opened)
        # A continuation of a response kept whole stores its history whole: as sealed as it came.
        sealed = continue_conversation(earlier.conversation, earlier.output, own)
        return check_outputs_answer_calls(RequestItems(own, conversation, sealed, linked=earlier.linked))
    if conversation_id is not None:
        # A client may have added sealed reasoning to the conversation (checked as it was added,
        # and holding no item references): opened like stored history.
        stored_history = await state.conversations.prompt_items(conversation_id, caller)
        history = opened_history(stored_history, sealer, owner)
        _check_unique_ids(own, history)
        for index, item in enumerate(own):
            # They join the conversation: ids the item routes could not address are refused,
            # as when they are added there directly.
            check_item_id(str(item.get("id", "")), f"input[{index}].id")
        return check_outputs_answer_calls(
            RequestItems(own, [*history, *own_opened], [*stored_history, *own], conversation_id)
        )
    _check_unique_ids(own, [])
    return check_outputs_answer_calls(RequestItems(own, own_opened, own))


def _check_unique_ids(own: list[Item], history: list[Item]) -> None:
    duplicate = duplicate_id(own, history)
    if duplicate is not None:
        raise duplicate_item(duplicate)


def duplicate_item(item_id: str) -> OpenAIError:
    """The 400 of an input item whose id the input or the history it joins holds already."""
    # OpenAI's words; its code is null.
    return OpenAIError(
        400,
        f"Duplicate item found with id {item_id}. Remove duplicate items from your input and try again.",
        param="input",
    )


def _opened_compactions(items: list[Item], sealer: Sealer, owner: str) -> list[Item]:
    """``items`` with each compaction item's summary opened for the template (never stored so)."""
    opened: list[Item] = []
    for item in items:
        if item.get("type") == "compaction":
            try:
                summary = sealer.open(sealed.COMPACTION, owner, str(item.get("encrypted_content", "")))
            except SealError as exc:
                raise invalid_value(
                    f"A compaction item of the conversation cannot be opened: {exc}.",
                    "input",
                    "invalid_encrypted_content",
                ) from None
            item = {**item, "summary": summary}
        opened.append(item)
    return opened


def context_length_exceeded(
    context_length: int, prompt_tokens: str, wanted: int, truncating: bool = False
) -> OpenAIError:
    """The 400 for a prompt (``prompt_tokens`` long, as said) that leaves too little room;
    ``truncating``: the request sent ``truncation: "auto"``, and its last turn alone is too long."""
    advice = (
        "With truncation 'auto' the most recent turn is kept whole, and it alone does not fit: "
        "shorten it, or reduce max_output_tokens."
        if truncating
        else "Please reduce the input or max_output_tokens, or send truncation 'auto'."
    )
    return OpenAIError(
        400,
        f"This model's maximum context length is {context_length} tokens. However, your input has "
        f"{prompt_tokens} tokens and asks for {wanted} output tokens. {advice}",
        param="input",
        code="context_length_exceeded",
    )


def render_prompt(
    tokenizer: TextTokenizer,
    messages: list[dict[str, Any]],
    plan: GenerationPlan,
    max_tokens: int | None = None,
    wanted_output: int = 1,
    owner: str | None = None,
) -> list[int]:
    """Prompt token ids of the conversation, through the model's chat template.

    Every client string is tokenized as text, never as control tokens. A prompt that must
    have more than ``max_tokens`` tokens is a 400 ``context_length_exceeded`` before the
    tokenizer runs (``wanted_output`` is for the error's message). ``owner``: the caller whose
    prompt pieces encoded before are reused (an agent's resent history). CPU-bound: off the event loop.
    """
    try:
        token_ids = tokenizer.prompt_ids(
            messages, plan.template_tools, plan.template_context, max_tokens, cache_owner=owner
        )
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


@dataclass(frozen=True)
class PromptRequest:
    """What :func:`fit_prompt` renders: the items, how, and how much room the answer needs."""

    items: list[Item]
    instructions: str | None
    plan: GenerationPlan
    owner: str
    output_budget: int
    """The output tokens the request asks for (``max_output_tokens`` or the default)."""
    budget_is_explicit: bool = False
    """``max_output_tokens`` was sent; otherwise truncation keeps at most a quarter of the context
    for the answer (:data:`DEFAULT_ANSWER_SHARE`), so a large default does not drop every turn."""
    reserved: int = 0
    """Prompt tokens added after rendering (the forced prefix)."""
    truncate: bool = False
    counting: bool = False
    """For ``input_tokens``: count past the context (up to a bound) instead of refusing."""


def _messages(request: PromptRequest, items: list[Item], sealer: Sealer) -> list[dict[str, Any]]:
    try:
        return items_to_messages(_opened_compactions(items, sealer, request.owner), request.instructions)
    except ValueError as exc:
        raise invalid_value(str(exc), "input") from exc


def fit_prompt(tokenizer: TextTokenizer, sealer: Sealer, request: PromptRequest) -> FittedPrompt:
    """The prompt for ``request``: everything from the last compaction on, truncated if asked and needed.

    Without truncation the prompt must leave one token of room (a 400 otherwise, before
    tokenizing when it is far too long). With it, the fewest oldest turns are dropped so
    that the prompt leaves room for the whole output budget; when even the last turn alone
    does not, that is what is rendered and the caller's limit check decides. CPU-bound.
    """
    context_length = tokenizer.card.context_length
    items = since_last_compaction(request.items)
    if request.counting and not request.truncate:
        bound = COUNT_BOUND_CONTEXTS * context_length
    else:
        bound = context_length - request.reserved - 1
    budget = request.output_budget
    if not request.budget_is_explicit:
        budget = min(budget, context_length // DEFAULT_ANSWER_SHARE)
    full_room = context_length - request.reserved - budget
    if not request.truncate:
        messages = _messages(request, items, sealer)
        return FittedPrompt(
            render_prompt(tokenizer, messages, request.plan, bound, request.output_budget, request.owner)
        )

    def attempt(turns: int) -> list[int] | None:
        kept = drop_oldest_turns(items, turns)
        try:
            return render_prompt(
                tokenizer,
                _messages(request, kept, sealer),
                request.plan,
                max(full_room, 0),
                request.output_budget,
                request.owner,
            )
        except OpenAIError as exc:
            if exc.code != "context_length_exceeded":
                raise
            return None

    whole = attempt(0)
    if whole is not None and len(whole) <= full_room:
        return FittedPrompt(whole)
    # Fewest turns dropped such that the prompt fits: prompts shrink as turns go, so bisect.
    low, high = 1, droppable_turns(items)
    best: tuple[int, list[int]] | None = None
    while low <= high:
        middle = (low + high) // 2
        token_ids = attempt(middle)
        if token_ids is not None and len(token_ids) <= full_room:
            best, high = (middle, token_ids), middle - 1
        else:
            low = middle + 1
    if best is None:
        # Not even the last turn leaves the whole budget: keep only it, and let the limit decide.
        turns = droppable_turns(items)
        kept = drop_oldest_turns(items, turns)
        token_ids = render_prompt(
            tokenizer,
            _messages(request, kept, sealer),
            request.plan,
            bound,
            request.output_budget,
            request.owner,
        )
        best = (turns, token_ids)
    turns, token_ids = best
    dropped = len(items) - len(drop_oldest_turns(items, turns))
    if turns:
        log.info(
            "truncation auto: dropped the %d oldest turns (%d items) to fit %d prompt tokens in %d",
            turns,
            dropped,
            len(token_ids) + request.reserved,
            context_length,
        )
    return FittedPrompt(token_ids, turns, dropped)


@dataclass(frozen=True)
class PromptPlan:
    """How one request's prompt is made for its model: the generation plan, the forced prefix
    (server text, so its markup stays control tokens) and the default output budget."""

    tokenizer: TextTokenizer
    plan: GenerationPlan
    forced_ids: list[int]
    default_output: int

    def prompt_request(
        self, request: CreateResponseRequest, items: RequestItems, owner: str, counting: bool = False
    ) -> PromptRequest:
        """What :func:`fit_prompt` renders for ``request``'s items."""
        return PromptRequest(
            items=items.conversation,
            instructions=request.instructions,
            plan=self.plan,
            owner=owner,
            output_budget=request.max_output_tokens or self.default_output,
            budget_is_explicit=request.max_output_tokens is not None,
            reserved=len(self.forced_ids),
            truncate=request.truncation == "auto",
            counting=counting,
        )

    async def fit(
        self,
        state: AppState,
        request: CreateResponseRequest,
        items: RequestItems,
        caller: Caller,
        counting: bool = False,
    ) -> FittedPrompt:
        """:func:`fit_prompt`, on the prompt threads unless the prompt is small (:func:`renders_inline`):
        rendering and tokenizing take seconds for a few MB, and a tenth of a millisecond for a chat turn."""
        prompt = self.prompt_request(request, items, caller.owner, counting)
        if renders_inline(prompt):
            return fit_prompt(self.tokenizer, state.sealer, prompt)
        return await state.off_loop(fit_prompt, self.tokenizer, state.sealer, prompt)

    def total(self, fitted: FittedPrompt) -> int:
        """The tokens the engine is given: the rendered prompt and the forced prefix."""
        return len(fitted.token_ids) + len(self.forced_ids)


INLINE_PROMPT_CHARS = 2048
"""Prompts with at most this much text (items, instructions, tools) render on the event loop.

A hop to the prompt threads and back costs about as much CPU as rendering and tokenizing a
small prompt (~0.2 ms each on the development machine, ``docs/benchmarks.md``, B2), and adds a
thread wake-up to the request's latency; past a few kB the render's own time would stall the
loop's other requests for longer than the hop costs."""


def renders_inline(prompt: PromptRequest) -> bool:
    """Whether ``prompt`` is small enough to render on the event loop (:data:`INLINE_PROMPT_CHARS`)."""
    budget = INLINE_PROMPT_CHARS - len(prompt.instructions or "")
    budget = _text_left(prompt.items, budget)
    if prompt.plan.template_tools:
        budget = _text_left(prompt.plan.template_tools, budget)
    return budget >= 0


def _text_left(value: Any, budget: int) -> int:
    """``budget`` less the length of every string in ``value`` (keys included); stops once negative."""
    if isinstance(value, str):
        return budget - len(value)
    if isinstance(value, dict):
        for key, inner in value.items():
            budget = _text_left(inner, budget - len(key))
            if budget < 0:
                return budget
    elif isinstance(value, list | tuple):
        for inner in value:
            budget = _text_left(inner, budget)
            if budget < 0:
                return budget
    return budget


def plan_prompt(settings: Settings, request: CreateResponseRequest, tokenizer: TextTokenizer) -> PromptPlan:
    """The :class:`PromptPlan` of ``request`` (400 for what its tools, choice or format cannot have)."""
    plan = plan_generation(
        request,
        tokenizer.card,
        settings.tool_parser,
        settings.reasoning_parser,
        refuse_hosted=settings.hosted_tools == "refuse",
    )
    forced_ids = tokenizer.encode(plan.forced_prefix) if plan.forced_prefix else []
    default_output = min(settings.default_max_output_tokens, settings.max_output_tokens_cap)
    return PromptPlan(tokenizer, plan, forced_ids, default_output)


async def summary_sees_nothing(
    state: AppState, summarising: CreateResponseRequest, tokenizer: TextTokenizer, caller: Caller
) -> bool:
    """Whether a compaction's summary request (:mod:`api.compaction`), truncated to fit the
    context, would keep nothing of the conversation, only its own prompt: the conversation's most
    recent turn alone is longer than the context. Rendered and counted as its create will be."""
    items = await gather_items(state, summarising, caller, ids.new_response_id())
    plan = plan_prompt(state.settings, summarising, tokenizer)
    fitted = await plan.fit(state, summarising, items, caller, counting=True)
    considered = len(since_last_compaction(items.conversation))
    return considered > 1 and fitted.dropped_items >= considered - 1
