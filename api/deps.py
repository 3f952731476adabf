"""FastAPI dependencies, as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.caller import ANONYMOUS, Caller
from api.state import AppState


def get_state(request: Request) -> AppState:
    """The process's :class:`AppState`."""
    state: AppState = request.app.state.resq
    return state


def get_caller(request: Request) -> Caller:
    """The identity of the request's sender (anonymous until authentication exists)."""
    return ANONYMOUS


StateDep = Annotated[AppState, Depends(get_state)]
CallerDep = Annotated[Caller, Depends(get_caller)]
