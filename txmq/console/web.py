"""Rendering a page (or its live fragment) with the browser's CSRF token, and error pages;
the client a page or an action asks the brokers with (:func:`client_of`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from txmq.console import render
from txmq.console.security import COOKIE, FIELD, token_for
from txmq.console.sessions import SCOPE_KEY, Session
from txmq.console.state import ConsoleState, OperatorClient

__all__ = ["HERE", "client_of", "error_page", "page", "session_of", "state_of"]

log = logging.getLogger("txmq.console")
HERE = Path(__file__).resolve().parent

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"),
    autoescape=True,  # every value a page shows is escaped, whatever the template
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.globals.update(
    show_ms=render.show_ms,
    show_number=render.show_number,
    url_pieces=render.url_pieces,
    human_bytes=render.human_bytes,
    csrf_field=FIELD,
)
templates = Jinja2Templates(env=_env)


def state_of(request: Request) -> ConsoleState:
    state: ConsoleState = request.app.state.console
    return state


def session_of(request: Request) -> Session | None:
    """The logged-in session of the request (None: login is off, or an open page)."""
    session = request.scope.get(SCOPE_KEY)
    return session if isinstance(session, Session) else None


async def client_of(request: Request) -> OperatorClient:
    """The client every page and action asks the brokers with: the logged-in user's own
    (``--login``: the brokers check each request under that user's rules), else the
    console's shared one."""
    session = session_of(request)
    if session is not None:
        return session.client
    state = state_of(request)
    if state.config.login:  # an open path (never one that asks the brokers)
        raise HTTPException(401, "log in first")
    return await state.client()


def page(
    request: Request,
    name: str,
    context: Mapping[str, Any],
    *,
    status: int = 200,
) -> Response:
    """Render ``name``.html, or its live fragment ``_name``.html for ``?partial=1``; set
    the browser's CSRF cookie if it has none yet."""
    state = state_of(request)
    token, new = token_for(request, state.secret)
    partial = request.query_params.get("partial") == "1"
    flash = state.flashes.pop(request.query_params.get("flash", ""), None)
    session = session_of(request)
    response = templates.TemplateResponse(
        request,
        f"_{name}.html" if partial else f"{name}.html",
        {
            **context,
            "csrf": token,
            "flash": flash,
            "refresh_ms": int(state.config.refresh_s * 1000),
            "where": state.where,
            "nav": request.url.path,
            "login_on": state.config.login,
            "login_user": session.user if session is not None else "",
        },
        status_code=status,
    )
    if new:
        # over https (--tls-cert) the browser sends it back over https only
        secure = request.url.scheme == "https"
        response.set_cookie(
            COOKIE, token, httponly=True, samesite="strict", path="/", secure=secure
        )
    return response


def error_page(request: Request, status: int, title: str, detail: str) -> Response:
    return page(request, "error", {"status": status, "title": title, "detail": detail},
                status=status)  # fmt: skip
