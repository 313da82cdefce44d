"""How the RPCs of :mod:`txmq.server.grpc.service` answer: a failure as a RocketMQ status
(never a gRPC error), a service's answer awaited when it is a future, the caller's client
id, and what the RPCs need of the endpoint that serves them."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from txmq.protocol.wire.errors import TxmqError
from txmq.server.grpc.convert import GrpcError, status_of
from txmq.server.grpc.ports import BrokerCore, PopPort, RouteSource
from txmq.server.grpc.telemetry import Sessions

__all__ = ["Endpoint", "answers", "client_id", "settled"]

log = logging.getLogger("txmq.grpc")

T = TypeVar("T")


class Endpoint(Protocol):
    """What the RPCs need of the endpoint that serves them
    (:class:`txmq.server.grpc.endpoint.GrpcEndpoint`)."""

    core: BrokerCore
    pop: PopPort
    sessions: Sessions
    routes: RouteSource

    def address(self) -> str: ...

    def endpoints(self, address: str = "", asked: Any = None) -> Any: ...

    async def group_policy(self, group: str) -> tuple[bool, int]: ...

    def retry_policy(self, max_attempts: int) -> Any: ...


def answers(
    response: Callable[..., Any],
) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """A unary RPC whose failures answer ``response(status=...)``."""

    def wrap(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(handler)
        async def call(self: Any, request: Any, context: Any) -> Any:
            try:
                return await handler(self, request, context)
            except (TxmqError, GrpcError) as exc:
                return response(status=status_of(exc))
            except Exception as exc:
                log.exception("gRPC %s failed", handler.__name__)
                return response(status=status_of(exc))

        return call

    return wrap


async def settled(value: T | Awaitable[T]) -> T:
    """A service's answer, awaited when it is a future (SYNC flush, SYNC_MASTER, a call
    to a broker)."""
    if isinstance(value, Awaitable):
        return await value
    return value


def client_id(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-mq-client-id":
            return str(value)
    return ""
