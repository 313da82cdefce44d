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
from typing import Any, TypeVar

from txmq.errors import UnsupportedRequest
from txmq.remoting import Connection, HandlerResult
from txmq.wire.base import Request, decode, request_class
from txmq.wire.frame import Frame

__all__ = ["Call", "Router"]

Q = TypeVar("Q", bound=Request[Any])


@dataclass(slots=True, frozen=True)
class Call:
    """What a handler gets beside its request: the connection it came on, and its body."""

    conn: Connection
    body: bytes


class Router:
    """Request class -> handler; :meth:`handle` is a :class:`Connection`'s handler."""

    def __init__(self, who: str) -> None:
        self.who = who
        self._routes: dict[type[Request[Any]], Callable[[Any, Call], HandlerResult]] = {}

    def route(self, kind: type[Q], handler: Callable[[Q, Call], HandlerResult]) -> None:
        if kind in self._routes:
            raise ValueError(f"{kind.__name__} is routed twice")
        self._routes[kind] = handler

    def handle(self, conn: Connection, frame: Frame) -> HandlerResult:
        kind = request_class(frame.code, frame.version)
        handler = self._routes.get(kind)
        if handler is None:
            raise UnsupportedRequest(
                f"{kind.__name__} (request code {frame.code}) is not supported by {self.who}"
            )
        return handler(decode(kind, frame.header), Call(conn, frame.body))
