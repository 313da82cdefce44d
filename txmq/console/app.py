"""The console's ASGI application: routes, page rendering, error pages, lifespan.

A page is a full HTML document; its live part is the same template's fragment, which the
page's script fetches again every few seconds (``?partial=1``) and puts in place.  Errors
are pages too (or fragments, for a live part): 404 for an unknown message, topic or
transaction, 503 naming the broker or name servers when they cannot be reached, 400 for
what the broker or the console refused, 403 for what the user may not do; never a
traceback.  With ``login`` (``txmq console --login``) every page wants a logged-in user of
the brokers' access control (:mod:`txmq.console.login`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from txmq.console import actions, login, outbox_page, pages, reconcile_page, sagas_page
from txmq.console.login import LoginRequired
from txmq.console.security import SecurityHeaders
from txmq.console.sessions import Sessions
from txmq.console.state import ConsoleConfig, ConsoleState
from txmq.console.web import HERE, error_page, state_of
from txmq.protocol.wire.errors import (
    AuthenticationFailed,
    BrokerBusy,
    BrokerUnavailable,
    MessageNotFound,
    NoPermission,
    RequestTimeout,
    TopicNotFound,
    TransactionNotFound,
    TxmqError,
)

__all__ = ["create_app"]

log = logging.getLogger("txmq.console")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    titles = {401: "Not logged in", 403: "Forbidden", 404: "Not found", 405: "Method not allowed"}
    return error_page(request, exc.status_code, titles.get(exc.status_code, "Error"), exc.detail)


async def _txmq_error(request: Request, exc: Exception) -> Response:
    where = state_of(request).where
    if isinstance(exc, AuthenticationFailed):
        ended = await login.logged_out(request, exc)  # a session's user the brokers refuse
        if ended is not None:
            return ended
        return error_page(
            request,
            400,
            "Refused",
            f"{where} refused the console's credentials: {exc} (it signs with "
            "$TXMQ_ACCESS_KEY / $TXMQ_SECRET_KEY; or start it with --login)",
        )
    if isinstance(exc, NoPermission):
        return error_page(request, 403, "Not allowed", f"{where} refused: {exc}")
    if isinstance(exc, (MessageNotFound, TopicNotFound, TransactionNotFound)):
        return error_page(request, 404, "Not found", str(exc))
    if isinstance(exc, (BrokerUnavailable, RequestTimeout, BrokerBusy, OSError)):
        return error_page(
            request, 503, "Broker unavailable", f"{where} did not answer: {exc or type(exc)}"
        )
    if isinstance(exc, TxmqError):
        return error_page(request, 400, "Refused", f"{where} refused: {exc}")
    return error_page(request, 400, "Bad request", str(exc))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_page(
        request,
        500,
        "Internal error",
        f"the console failed ({type(exc).__name__}); its log has the details",
    )


async def _home(request: Request) -> Response:
    return RedirectResponse("/cluster", status_code=303)


def create_app(config: ConsoleConfig | None = None, *, sample: bool = True) -> Starlette:
    """The console application (``sample``: run the background sampler behind the
    charts)."""
    state = ConsoleState(config or ConsoleConfig())
    sessions = Sessions(state.config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            if sample:
                tg.start_soon(state.sample_forever)
            if state.config.login:
                tg.start_soon(sessions.sweep_forever)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
                await sessions.close()
                await state.close()

    logins = [
        Route("/login", login.login_page),
        Route("/login", login.login, methods=["POST"]),
        Route("/logout", login.logout, methods=["POST"]),
    ]
    login_required = [Middleware(LoginRequired, sessions=sessions)]

    app = Starlette(
        routes=[
            Route("/", _home),
            Route("/cluster", pages.cluster),
            Route("/topics", pages.topics),
            Route("/topics", actions.create_topic, methods=["POST"]),
            Route("/topics/delete", actions.delete_topic, methods=["POST"]),
            Route("/topic", pages.topic),
            Route("/groups", pages.groups),
            Route("/group", pages.group),
            Route("/group/reset", actions.reset_offsets, methods=["POST"]),
            Route("/message", pages.message),
            Route("/message/body", pages.message_body),
            Route("/transactions", pages.transactions),
            Route("/transactions/decide", actions.decide_transaction, methods=["POST"]),
            Route("/dlq", pages.dlq),
            Route("/dlq/resend", actions.dlq_resend, methods=["POST"]),
            Route("/outbox", outbox_page.outbox),
            Route("/outbox/requeue", outbox_page.requeue, methods=["POST"]),
            Route("/sagas", sagas_page.sagas),
            Route("/saga", sagas_page.saga),
            Route("/saga/act", sagas_page.act, methods=["POST"]),
            Route("/reconcile", reconcile_page.reconcile),
            *(logins if state.config.login else []),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        middleware=[
            Middleware(TrustedHostMiddleware, allowed_hosts=state.config.allowed_hosts),
            Middleware(SecurityHeaders),
            *(login_required if state.config.login else []),
        ],
        exception_handlers={
            HTTPException: _http_error,
            TxmqError: _txmq_error,
            OSError: _txmq_error,
            ValueError: _txmq_error,
            Exception: _unexpected,
        },
        lifespan=lifespan,
    )
    app.state.console = state
    app.state.sessions = sessions
    return app
