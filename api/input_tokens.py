"""``POST /v1/responses/input_tokens``: the prompt a create would enqueue, counted, not generated.

It walks the create path up to the token ids (:mod:`api.prompting`): the same
history (``previous_response_id``, ``conversation``), tools, instructions, forced
prefix, compaction and ``truncation``, on the same prompt threads. Nothing is
recorded and nothing is enqueued.
"""

from __future__ import annotations

from api.caller import Caller
from api.errors import invalid_value
from api.generation_plan import plan_generation
from api.prompting import fit_prompt, gather_items
from api.schemas import InputTokensRequest
from api.state import AppState
from api.submission import prompt_request, served_tokenizer
from resq import ids


async def default_model(state: AppState) -> str:
    """The one model this server serves, for a count that names none; 400 when it serves several."""
    names = sorted(card.name for card in await state.catalog.cards())
    if len(names) != 1:
        served = ", ".join(repr(name) for name in names) or "none right now"
        raise invalid_value(
            f"Missing required parameter: 'model' (this server serves {served}).",
            "model",
            "missing_required_parameter",
        )
    return names[0]


async def count_input_tokens(state: AppState, request: InputTokensRequest, caller: Caller) -> int:
    """The number of prompt tokens the engine would see for ``request`` sent as a create."""
    settings = state.settings
    model = request.model if request.model is not None else await default_model(state)
    creating = request.model_copy(update={"model": model})
    tokenizer = await served_tokenizer(state, model)
    # Input item ids are numbered from a response id; none is issued for a count.
    items = await gather_items(state, creating, caller, ids.new_response_id())
    plan = plan_generation(
        creating,
        tokenizer.card,
        settings.tool_parser,
        settings.reasoning_parser,
        refuse_hosted=settings.hosted_tools == "refuse",
    )
    forced_ids = tokenizer.encode(plan.forced_prefix) if plan.forced_prefix else []
    default_output = min(settings.default_max_output_tokens, settings.max_output_tokens_cap)
    fitted = await state.off_loop(
        fit_prompt,
        tokenizer,
        state.sealer,
        prompt_request(creating, items, plan, caller, default_output, forced_ids, counting=True),
    )
    return len(fitted.token_ids) + len(forced_ids)
