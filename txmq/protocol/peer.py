"""A client's connection to one server over txmq's protocol — a broker, a name server, a
controller — made on demand and made again after it closes; and the addresses such servers
are given by (``host:port``, RocketMQ's ``"h1:9876;h2:9876"`` lists).

Clients, brokers (to their name servers, controllers and masters) and operators' tools
alike reach servers so.  TLS and request signing come from whatever :class:`Secures` the
connection is given (:class:`txmq.security.ClientSecurity`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Protocol

import anyio
import anyio.abc

from txmq.protocol.connection import Connection, FrameSigner, Handler
from txmq.protocol.wire.base import R, Request, WithBody
from txmq.protocol.wire.errors import BrokerUnavailable, ControllerNotLeader, UnsupportedRequest
from txmq.protocol.wire.frame import DEFAULT_MAX_FRAME_SIZE

__all__ = [
    "NoController",
    "RemotingClient",
    "Secures",
    "ask_controller",
    "named_leader",
    "parse_address",
    "parse_namesrv",
]


class Secures(Protocol):
    """How a client makes its connections secure (:class:`txmq.security.ClientSecurity`):
    TLS over each new stream, and a signer for each connection's requests."""

    async def secure(
        self, stream: anyio.abc.ByteStream, host: str, address: str, timeout: float
    ) -> anyio.abc.ByteStream:
        """``stream`` made secure (or as it is); BrokerUnavailable (not sent) if that fails."""
        ...

    def signer(self) -> FrameSigner | None: ...


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"broker address {address!r} is not of the form HOST:PORT")
    return host.strip("[]"), int(port)


def parse_namesrv(text: str, *, setting: str = "namesrv") -> tuple[str, ...]:
    """The addresses of a name-server list, ``"h1:9876;h2:9876"`` (RocketMQ's form; commas
    and spaces also separate); empty for an empty list.  ValueError names a bad entry."""
    out: list[str] = []
    for part in text.replace(",", ";").replace(" ", ";").split(";"):
        if not part:
            continue
        try:
            parse_address(part)
        except ValueError:
            raise ValueError(
                f"{setting}: {part!r} is not HOST:PORT (a list is 'h1:9876;h2:9876')"
            ) from None
        if part not in out:
            out.append(part)
    return tuple(out)


class RemotingClient:
    """Keeps one connection to a broker, reconnecting on demand.

    Use it as an async context manager (it owns the task group running the connection).
    """

    def __init__(
        self,
        address: str,
        handler: Handler | None = None,
        *,
        connect_timeout: float = 3.0,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        security: Secures | None = None,
        on_connect: Sequence[Callable[[Connection], Awaitable[None]]] = (),
    ) -> None:
        """``security``: TLS and request signing (None: plaintext, unsigned);
        ``on_connect``: run on every new connection before it is used."""
        self.address = address
        self.host, self.port = parse_address(address)
        self.handler = handler
        self.connect_timeout = connect_timeout
        self.max_frame_size = max_frame_size
        self.security = security
        self._conn: Connection | None = None
        self._lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: AsyncExitStack | None = None
        self.on_connect = tuple(on_connect)

    async def __aenter__(self) -> RemotingClient:
        stack = AsyncExitStack()
        self._tg = await stack.enter_async_context(anyio.create_task_group())
        self._stack = stack
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._stack is not None and self._tg is not None
        if self._conn is not None:
            self._conn.close()
        self._tg.cancel_scope.cancel()
        await self._stack.aclose()
        self._stack = None
        self._tg = None

    def attach(self, tg: anyio.abc.TaskGroup) -> None:
        """Run connections in ``tg`` instead of a task group of its own (a client that
        talks to several brokers keeps them all in its own task group)."""
        self._tg = tg

    def detach(self) -> None:
        """Close the connection (after what is queued is written) and forget ``tg``."""
        if self._conn is not None:
            self._conn.close()
        self._tg = None

    async def connection(self) -> Connection:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        async with self._lock:
            conn = self._conn
            if conn is not None and not conn.closed:
                return conn
            if self._tg is None:
                raise BrokerUnavailable("client is not started")
            try:
                with anyio.fail_after(self.connect_timeout):
                    stream: anyio.abc.ByteStream = await anyio.connect_tcp(self.host, self.port)
            except (OSError, TimeoutError) as exc:
                unreachable = BrokerUnavailable(f"cannot connect to broker {self.address}: {exc}")
                unreachable.sent = False
                raise unreachable from exc
            if self.security is not None:  # BrokerUnavailable (not sent) saying why when it fails
                stream = await self.security.secure(
                    stream, self.host, self.address, self.connect_timeout
                )
            conn = Connection(
                stream,
                self.handler,
                max_frame_size=self.max_frame_size,
                name=self.address,
                signer=self.security.signer() if self.security is not None else None,
            )
            self._conn = conn
            self._tg.start_soon(conn.run)
            for hook in self.on_connect:
                await hook(conn)
            return conn

    async def call(
        self, request: Request[R], body: bytes = b"", *, timeout: float = 3.0
    ) -> WithBody[R]:
        conn = await self.connection()
        return await conn.call(request, body, timeout=timeout)

    async def send_oneway(self, request: Request[Any], body: bytes = b"") -> None:
        conn = await self.connection()
        conn.send_oneway(request, body)


#: how long to wait for a connection to a controller (an address that is down fails at once)
CONNECT_TIMEOUT_S = 2.0


#: how a controller that does not lead names the leader (namesrv/controller.py)
_LEADER_IS = re.compile(r"the leader is at (\S+?)\)?$")


def named_leader(exc: ControllerNotLeader) -> str | None:
    """The leader's address a controller that does not lead named in its refusal, if any."""
    found = _LEADER_IS.search(str(exc))
    return found.group(1) if found is not None else None


class NoController(BrokerUnavailable):
    """None of the addresses given hosts a controller that answers."""


async def ask_controller(
    addresses: Sequence[str],
    request: Request[R],
    timeout: float = 5.0,
    *,
    security: Secures | None = None,
) -> tuple[str, R]:
    """``request``'s answer from the first of ``addresses`` that hosts a controller, and
    that address (``security``: TLS and signing; None: plaintext, unsigned).  Controllers
    on etcd: one that does not lead names the leader, which is asked next."""
    said: list[str] = []
    order = list(dict.fromkeys(addresses))
    tried: set[str] = set()
    while order:
        address = order.pop(0)
        if address in tried:
            continue
        tried.add(address)
        try:
            async with RemotingClient(
                address, connect_timeout=CONNECT_TIMEOUT_S, security=security
            ) as client:
                return address, (await client.call(request, timeout=timeout)).header
        except UnsupportedRequest:
            said.append(f"{address} hosts no controller")
        except ControllerNotLeader as exc:
            said.append(f"{address}: {exc}")
            leader = named_leader(exc)
            if leader is not None:
                order.insert(0, leader)
        except BrokerUnavailable as exc:
            said.append(str(exc))
    raise NoController(
        "no controller is reachable (" + ("; ".join(said) or "no address to ask") + ")"
    )
