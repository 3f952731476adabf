"""FastAPI dependencies, as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.auth import missing_api_key
from api.caller import ANONYMOUS, Caller
from api.gate import caller_of
from api.state import AppState

# Both are ``async``: FastAPI runs a plain ``def`` dependency on its thread pool, a thread hop
# (two per request) for what is an attribute read.


async def get_state(request: Request) -> AppState:
    """The process's :class:`AppState`."""
    state: AppState = request.app.state.resq
    return state


async def get_caller(request: Request) -> Caller:
    """The identity of the request's sender: what :class:`api.gate.Gate` proved, anonymous on an open API."""
    caller = caller_of(request.scope)
    if caller is not None:
        return caller
    if (await get_state(request)).keyring.open:
        return ANONYMOUS
    # A route the gate does not guard asked who is calling: fail closed.
    raise missing_api_key()


StateDep = Annotated[AppState, Depends(get_state)]
CallerDep = Annotated[Caller, Depends(get_caller)]
