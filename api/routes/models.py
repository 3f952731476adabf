"""``GET /v1/models``: the models GPU workers serve."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from api.deps import StateDep
from api.http import json_response
from resq.catalog import card_to_openai_model

router = APIRouter(prefix="/v1")


@router.get("/models")
async def list_models(state: StateDep) -> Response:
    """Every registered model, OpenAI's list shape."""
    cards = await state.catalog.cards()
    return json_response({"object": "list", "data": [card_to_openai_model(card) for card in cards]})
