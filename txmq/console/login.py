"""Logging in to the console (``txmq console --login``): the console's users are the
brokers' users.

Every page and action but ``/login``, ``/logout`` and ``/static/...`` wants a session
(:mod:`txmq.console.sessions`); without one a page is sent to ``/login?next=<it>`` (a
page's live part gets a 401 fragment instead).  A login is checked by the brokers: the
console starts an :class:`~txmq.console.state.OperatorClient` signing with the access key
and secret key typed in and asks who it is (``GetUser``: the broker given, or the name
servers).  That client is the session's: every request of that browser is then checked
by the brokers under that user's rules; a refusal (``NoPermission``) is a 403 page naming
what was refused, and a user the brokers no longer know (``AuthenticationFailed``) is
logged out.

A wrong access key or secret key is one answer (which one is never said), 401; after
:attr:`~txmq.console.sessions.LoginLimiter.failures` failures from one client address
within a minute that address gets 429 until the minute is over.
"""

from __future__ import annotations

import logging
import math
from urllib.parse import urlencode, urlsplit

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from txmq.console.security import check_csrf
from txmq.console.sessions import COOKIE, SCOPE_KEY, Session, Sessions
from txmq.console.state import ConsoleConfig, OperatorClient
from txmq.console.web import error_page, page, session_of, state_of
from txmq.protocol.settings import SettingsError
from txmq.protocol.wire import AclUser, GetUser
from txmq.protocol.wire.errors import AuthenticationFailed, BadRequest
from txmq.security.credentials import Credentials

__all__ = [
    "LoginRequired",
    "logged_out",
    "login",
    "login_page",
    "logout",
    "safe_next",
    "sessions_of",
    "verify",
]

log = logging.getLogger("txmq.console")

#: where a login goes when it is not told (or told somewhere else than this console)
HOME = "/cluster"
#: paths open without a session
OPEN = ("/login", "/logout")
WRONG = "access key or secret key is wrong"
_ACL_OFF = "access control is off"


class AccessControlOff(Exception):
    """The brokers check no user: a login means nothing."""


def sessions_of(request: Request) -> Sessions:
    sessions: Sessions = request.app.state.sessions
    return sessions


def safe_next(value: object) -> str:
    """``value`` if it is a path of this console (never another site: no scheme, no
    host, no ``//`` or backslash, no control character), else :data:`HOME`."""
    if not isinstance(value, str):
        return HOME
    value = value.strip()
    if (
        not value.startswith("/")
        or value.startswith("//")
        or "\\" in value
        or any(ord(c) < 32 or ord(c) == 127 for c in value)
    ):
        return HOME
    parts = urlsplit(value)
    if parts.scheme or parts.netloc or parts.path in OPEN:
        return HOME
    return value


def _address(request: Request) -> str:
    return request.client.host if request.client else "?"


def _here(request: Request) -> str:
    """Where the browser was going, for ``next`` (a page: its path and query; a POST
    cannot be replayed by a redirect: nothing)."""
    if request.method not in ("GET", "HEAD"):
        return ""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def _to_login(next_path: str, **query: str) -> str:
    params = {"next": next_path, **query} if next_path else query
    return f"/login?{urlencode(params)}" if params else "/login"


def _cookie(response: Response, request: Request, value: str | None) -> None:
    secure = request.url.scheme == "https"
    if value is None:
        response.delete_cookie(COOKIE, path="/", secure=secure, httponly=True, samesite="strict")
    else:
        response.set_cookie(
            COOKIE, value, path="/", secure=secure, httponly=True, samesite="strict"
        )


class LoginRequired:
    """ASGI middleware: a request without a live session gets no further than
    :data:`OPEN` paths and static files; with one, the session goes in its scope
    (:data:`~txmq.console.sessions.SCOPE_KEY`, read by :func:`~txmq.console.web.client_of`)."""

    def __init__(self, app: ASGIApp, sessions: Sessions) -> None:
        self.app = app
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN or path.startswith("/static/"):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        partial = request.query_params.get("partial") == "1"
        # a page's live refresh is not a use: a tab left open expires like any other
        session = await self.sessions.get(request.cookies.get(COOKIE, ""), touch=not partial)
        if session is not None:
            scope[SCOPE_KEY] = session
            await self.app(scope, receive, send)
            return
        if partial:
            response = error_page(
                request,
                401,
                "Not logged in",
                "you are not logged in (or your session has ended): reload the page to log in",
            )
        else:
            response = RedirectResponse(_to_login(_here(request)), status_code=303)
        await response(scope, receive, send)


# -- checking a login -----------------------------------------------------------------------


async def verify(
    config: ConsoleConfig, access_key: str, secret_key: str
) -> tuple[OperatorClient, AclUser]:
    """A started client signing as ``access_key`` and the user the brokers (or the name
    servers) said it is; AuthenticationFailed for credentials they refuse,
    :class:`AccessControlOff`, or the error that kept them from answering."""
    try:
        Credentials(access_key, secret_key)
    except SettingsError:
        raise AuthenticationFailed(WRONG) from None
    client = OperatorClient(
        config.broker,
        namesrv=config.namesrv,
        request_timeout=config.request_timeout,
        connect_timeout=config.request_timeout,
        access_key=access_key,
        secret_key=secret_key,
    )
    await client.start()
    try:
        me: AclUser
        if client.direct is not None:
            me = await client.call(GetUser())
        else:
            me = await client.ask_namesrv(GetUser())
        if me.name != access_key:  # pragma: no cover - a server answers for the signer
            raise AuthenticationFailed(f"the server answered for {me.name!r}")
    except BadRequest as exc:
        await client.stop()
        if _ACL_OFF in str(exc):
            raise AccessControlOff(str(exc)) from None
        raise AuthenticationFailed(str(exc)) from None  # "no user ...": removed meanwhile
    except BaseException:
        await client.stop()
        raise
    return client, me


def _form_text(form: FormData, name: str) -> str:
    value = form.get(name, "")
    return value if isinstance(value, str) else ""


def _login_form(
    request: Request, next_path: str, *, status: int = 200, problem: str = "", access_key: str = ""
) -> Response:
    return page(
        request,
        "login",
        {"next": next_path, "problem": problem, "access_key": access_key},
        status=status,
    )


async def login_page(request: Request) -> Response:
    """GET /login: the form (a browser already logged in goes on to ``next``)."""
    next_path = safe_next(request.query_params.get("next", HOME))
    cookie = request.cookies.get(COOKIE, "")
    if await sessions_of(request).get(cookie, touch=False) is not None:
        return RedirectResponse(next_path, status_code=303)
    return _login_form(request, next_path)


async def login(request: Request) -> Response:
    """POST /login: check the credentials with the brokers; a session, or the form
    again."""
    state = state_of(request)
    sessions = sessions_of(request)
    form = await request.form()
    check_csrf(request, form, state.secret)
    next_path = safe_next(form.get("next", HOME))
    access_key = _form_text(form, "access_key").strip()
    secret_key = _form_text(form, "secret_key")
    address = _address(request)
    wait = sessions.limiter.wait_s(address)
    if wait > 0:
        response = _login_form(
            request,
            next_path,
            status=429,
            problem=f"too many failed logins from {address}: try again in {math.ceil(wait)} s",
        )
        response.headers["retry-after"] = str(math.ceil(wait))
        return response
    try:
        client, me = await verify(state.config, access_key, secret_key)
    except AuthenticationFailed as exc:
        sessions.limiter.failed(address)
        log.warning("console: login as %r from %s refused: %s", access_key, address, exc)
        return _login_form(request, next_path, status=401, problem=WRONG, access_key=access_key)
    except AccessControlOff as exc:
        return _login_form(
            request,
            next_path,
            status=400,
            problem=f"{exc}. With access control off the brokers check no user, so logging "
            "in makes no sense: start the console without --login (or the brokers with an "
            "ACL file).",
        )
    sessions.limiter.succeeded(address)
    old = request.cookies.get(COOKIE, "")
    if old:  # a new id at each login (never one a browser had before)
        await sessions.end(old)
    session = await sessions.add(me.name, client, super_user=me.super)
    log.info("console: %s logged in from %s", me.name, address)
    response = RedirectResponse(next_path, status_code=303)
    _cookie(response, request, session.id)
    return response


async def logout(request: Request) -> Response:
    """POST /logout: end the browser's session and stop its client."""
    state = state_of(request)
    form = await request.form()
    check_csrf(request, form, state.secret)
    ended = await sessions_of(request).end(request.cookies.get(COOKIE, ""))
    if ended is not None:
        log.info("console: %s logged out from %s", ended.user, _address(request))
    response = RedirectResponse(
        _to_login("", flash=state.flash("ok", "logged out")), status_code=303
    )
    _cookie(response, request, None)
    return response


async def logged_out(request: Request, exc: AuthenticationFailed) -> Response | None:
    """A broker no longer accepts the session's user (deleted, or its secret key
    changed): the session ends and the browser goes to the login page (None: the
    request had no session)."""
    session: Session | None = session_of(request)
    if session is None:
        return None
    await sessions_of(request).end(session.id)
    request.scope.pop(SCOPE_KEY, None)
    state = state_of(request)
    log.warning("console: %s logged out: %s refused the user: %s", session.user, state.where, exc)
    text = f"you were logged out: {state.where} no longer accepts user {session.user!r} ({exc})"
    if request.query_params.get("partial") == "1":
        response = error_page(request, 401, "Logged out", text)
    else:
        response = RedirectResponse(
            _to_login(_here(request), flash=state.flash("warn", text)), status_code=303
        )
    _cookie(response, request, None)
    return response
