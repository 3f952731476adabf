"""FastAPI dependencies, as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.state import AppState


def get_state(request: Request) -> AppState:
    """The process's :class:`AppState`."""
    state: AppState = request.app.state.resq
    return state


StateDep = Annotated[AppState, Depends(get_state)]
