"""``POST /v1/responses/input_tokens``: the prompt a create would enqueue, counted, not generated.

It walks the create path up to the token ids (:mod:`api.prompting`): the same
history (``previous_response_id``, ``conversation``), tools, instructions, forced
prefix, compaction and ``truncation``, on the same prompt threads. Nothing is
recorded and nothing is enqueued.
"""

from __future__ import annotations

from api.caller import Caller
from api.errors import invalid_value
from api.prompting import gather_items, plan_prompt
from api.schemas import InputTokensRequest
from api.state import AppState
from api.submission import served_tokenizer
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
    model = request.model if request.model is not None else await default_model(state)
    creating = request.model_copy(update={"model": model})
    tokenizer = await served_tokenizer(state, model)
    # Input item ids are numbered from a response id; none is issued for a count.
    # A count of a history alone needs no new input (openai-agents compacts by previous_response_id).
    items = await gather_items(state, creating, caller, ids.new_response_id(), input_required=False)
    prompt = plan_prompt(state.settings, creating, tokenizer)
    return prompt.total(await prompt.fit(state, creating, items, caller, counting=True))
