"""Typed request handling: a :class:`Router` decodes each incoming frame into its request
class (by code and version) and calls the handler registered for that class.

The broker's processor and the clients (check-backs, rebalance notices) use the same
router; handlers see typed requests and return typed answers, never frames::

    router = Router("this broker")
    router.route(GetMaxOffset, lambda req, call: Offset(offset=store.max_offset(...)))
    connection = Connection(stream, router.handle)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from txmq.protocol.connection import Connection, HandlerResult
from txmq.protocol.wire.base import Request, decode, request_class
from txmq.protocol.wire.errors import UnsupportedRequest
from txmq.protocol.wire.frame import Frame, FrameKind


class Gate(Protocol):
    """A server's access control (:class:`txmq.security.acl.guard.Guard`): who signed a frame, and
    whether they may make its request (each raises the error to answer)."""

    def authenticate(self, conn: Connection, frame: Frame, kind: type[Request[Any]]) -> Any: ...

    def authorize(self, user: Any, request: Request[Any], conn: Connection) -> None: ...


__all__ = ["Call", "Gate", "Router"]

Q = TypeVar("Q", bound=Request[Any])


@dataclass(slots=True, frozen=True)
class Call:
    """What a handler gets beside its request: the connection it came on, its body, and
    the user who signed it (None: the server has no access control)."""

    conn: Connection
    body: bytes
    #: a :class:`txmq.security.acl.policy.User` (typed loosely: the client floor does not import
    #: the servers' access control)
    user: Any = None
    #: the request came oneway: nobody waits for its answer (a handler need not wait for
    #: what only the answer would have said, such as a flush)
    oneway: bool = False


class Router:
    """Request class -> handler; :meth:`handle` is a :class:`Connection`'s handler."""

    def __init__(self, who: str, guard: Gate | None = None) -> None:
        self.who = who
        #: access control: every request must be signed by a user allowed to make it
        self.guard = guard
        self._routes: dict[type[Request[Any]], Callable[[Any, Call], HandlerResult]] = {}

    def route(self, kind: type[Q], handler: Callable[[Q, Call], HandlerResult]) -> None:
        if kind in self._routes:
            raise ValueError(f"{kind.__name__} is routed twice")
        self._routes[kind] = handler

    def serve(self, request: Request[Any], call: Call) -> HandlerResult:
        """A typed request that came without a frame (an in-process client's: no signature
        to check, so not with access control)."""
        handler = self._routes.get(type(request))
        if handler is None:
            raise UnsupportedRequest(
                f"{type(request).__name__} (request code {request.CODE}) is not supported by "
                f"{self.who}"
            )
        if self.guard is not None:
            raise UnsupportedRequest(f"{self.who} checks signatures: unsigned requests are refused")
        return handler(request, call)

    def handle(self, conn: Connection, frame: Frame) -> HandlerResult:
        kind = request_class(frame.code, frame.version)
        handler = self._routes.get(kind)
        if handler is None:
            raise UnsupportedRequest(
                f"{kind.__name__} (request code {frame.code}) is not supported by {self.who}"
            )
        guard = self.guard
        oneway = frame.kind == FrameKind.ONEWAY
        if guard is None:
            return handler(decode(kind, frame.header), Call(conn, frame.body, None, oneway))
        user = guard.authenticate(conn, frame, kind)
        request = decode(kind, frame.header)
        guard.authorize(user, request, conn)
        return handler(request, Call(conn, frame.body, user, oneway))
