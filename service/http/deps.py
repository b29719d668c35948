"""FastAPI's typed dependencies: the app's state and the API-key checks of the HTTP routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.config import Settings
from service.state import AppState
from service.wire import check_key, state_of

# Dependencies are `async def` on purpose: FastAPI runs plain `def` dependencies in its thread
# pool, one thread hop each per request.


async def get_state(request: Request) -> AppState:
    return state_of(request)


State = Annotated[AppState, Depends(get_state)]


def check_api_key(request: Request, key) -> None:
    """401 unless the one ``Authorization: Bearer <key>`` carries ``key`` (no check when
    None)."""
    check_key(request.headers.getlist("authorization"), key)


def check_admin_key(request: Request, settings: Settings) -> None:
    """Admin routes take the admin key when one is set, else the API key."""
    check_api_key(request, settings.admin_api_key or settings.api_key)


async def require_api_key(request: Request, state: State) -> None:
    check_api_key(request, state.settings.api_key)


async def require_admin_key(request: Request, state: State) -> None:
    check_admin_key(request, state.settings)
