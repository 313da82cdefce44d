"""An in-process broker as a transport (``transport="loopback"``): typed requests handed
straight to the broker's router on the broker's event loop — no sockets, no frames.

A broker is served here under an address (:func:`serve`, what :mod:`txmq.testing` does);
a client of that address, or of any address while a *default* broker is served, reaches it.
Whatever the broker sends a client (check-backs, rebalance notices, offset resets) is
handed to the client on the client's own event loop, as txmq's protocol would deliver it.

Answers keep the protocol's meaning: an error the broker raises reaches the client as the
exception its response code maps to, a handler's crash as a server error, and a request
that gets no answer within its time-out as :class:`RequestTimeout`.  For tests, the next
requests of a kind can be made to fail or to lose their answer (:meth:`Served.fail_next`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from txmq.protocol.connection import Connection
from txmq.protocol.rpc import Call, Router
from txmq.protocol.wire.base import Request, Response, WithBody
from txmq.protocol.wire.errors import (
    BrokerUnavailable,
    RequestTimeout,
    ResponseCode,
    TxmqError,
    UnsupportedRequest,
    clip,
    error_for_code,
)
from txmq.transports.port import ClientSide, Remote

__all__ = ["TRANSPORT", "LoopbackTransport", "Served", "serve", "served", "withdraw"]

log = logging.getLogger("txmq.loopback")

_PEERS = itertools.count(1)


@dataclass
class _Fault:
    kinds: tuple[type[Request[Any]], ...]
    times: int
    #: raised instead of delivering the request (None: delivered, its answer lost)
    error: TxmqError | None


@dataclass
class Served:
    """A broker served in this process: its router, and the event loop it runs on."""

    address: str
    router: Router
    loop: asyncio.AbstractEventLoop
    _faults: list[_Fault] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fail_next(
        self,
        *kinds: type[Request[Any]],
        times: int = 1,
        error: TxmqError | None = None,
    ) -> None:
        """The next ``times`` requests of these kinds (any kind, if none is named): raise
        ``error`` without reaching the broker, or (``error`` None) reach it and lose the
        answer, so that the client's time-out runs out — the broker did what was asked."""
        if times < 1:
            raise ValueError("times must be at least 1")
        with self._lock:
            self._faults.append(_Fault(tuple(kinds), times, error))

    def _fault(self, request: Request[Any]) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if not fault.kinds or isinstance(request, fault.kinds):
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    async def request(
        self, peer: _Peer, request: Request[Any], body: bytes, *, oneway: bool = False
    ) -> WithBody[Any]:
        """``request`` through the broker's router, on the broker's loop: its answer, or the
        error the client of a real connection would get (``oneway``: the handler is told
        nobody waits for the answer, as for a oneway frame).  Between threads the request and
        its answer cross by a callback each (no task, no concurrent future: half the
        time of ``run_coroutine_threadsafe`` here)."""
        here = asyncio.get_running_loop()
        answered: asyncio.Future[WithBody[Any]] = here.create_future()
        if here is self.loop:
            _handle(self, peer, request, body, oneway, lambda outcome: _settle(answered, outcome))
        else:

            def back(outcome: WithBody[Any] | BaseException) -> None:
                try:
                    here.call_soon_threadsafe(_settle, answered, outcome)
                except RuntimeError:  # the client's loop is closed: nobody waits
                    pass

            try:
                self.loop.call_soon_threadsafe(_handle, self, peer, request, body, oneway, back)
            except RuntimeError:  # its loop has ended: the broker stopped
                gone = BrokerUnavailable(f"the broker served at {self.address} has stopped")
                gone.sent = False
                raise gone from None
        return await answered


_SERVED: dict[str, Served] = {}
_DEFAULT: list[Served] = []
_REGISTRY = threading.Lock()


def serve(
    address: str, router: Router, loop: asyncio.AbstractEventLoop, *, default: bool = False
) -> Served:
    """Serve a broker's ``router`` (running on ``loop``) at ``address``; ``default``: also
    at every address no broker is served at."""
    if router.guard is not None:
        raise ValueError(
            "a broker with access control cannot be served in process: loopback requests "
            "carry no signature (serve it without acl_file)"
        )
    entry = Served(address, router, loop)
    with _REGISTRY:
        if address in _SERVED:
            raise ValueError(f"a broker is already served at {address!r}")
        _SERVED[address] = entry
        if default:
            _DEFAULT.append(entry)
    return entry


def withdraw(address: str) -> None:
    """Serve the broker at ``address`` no more (its clients' requests fail as a stopped
    broker's do)."""
    with _REGISTRY:
        entry = _SERVED.pop(address, None)
        if entry is not None and entry in _DEFAULT:
            _DEFAULT.remove(entry)


def served(address: str) -> Served:
    """The broker served at ``address`` (or the default one); BrokerUnavailable if none."""
    with _REGISTRY:
        entry = _SERVED.get(address) or (_DEFAULT[-1] if _DEFAULT else None)
    if entry is None:
        unreachable = BrokerUnavailable(
            f"no broker is served in this process at {address} (transport='loopback': start "
            "one with txmq.testing, or choose another transport)"
        )
        unreachable.sent = False
        raise unreachable
    return entry


class _NoStream(anyio.abc.ByteStream):
    """What a loopback peer stands on: never read or written."""

    async def receive(self, max_bytes: int = 65536) -> bytes:
        raise anyio.EndOfStream

    async def send(self, item: bytes) -> None:
        raise anyio.BrokenResourceError

    async def send_eof(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


class _Peer(Connection):
    """The broker's side of one client's loopback "connection": what the broker keeps of a
    client (its heartbeats' groups, its check-backs) and sends it requests through."""

    def __init__(self, served: Served, remote: _LoopbackRemote) -> None:
        super().__init__(_NoStream(), name=f"loopback:{next(_PEERS)}")
        self.served = served
        self.remote = remote
        self.client_loop = asyncio.get_running_loop()

    def send_oneway(self, request: Request[Any], body: bytes = b"") -> None:
        """A request of the broker's to the client (called on the broker's loop)."""
        if self.closed:
            raise BrokerUnavailable(f"connection {self.name} is closed")
        try:
            self.client_loop.call_soon_threadsafe(self._deliver, request, bytes(body))
        except RuntimeError:  # the client's loop is closed: the client is gone
            self.close()

    def _deliver(self, request: Request[Any], body: bytes) -> None:
        try:
            self.remote.side.serve(request, body, self.remote)
        except UnsupportedRequest as exc:
            log.warning("%s", exc)
        except Exception:
            log.exception("serving %s from broker %s failed", type(request).__name__, self.name)

    async def call(
        self, request: Request[Any], body: bytes = b"", *, timeout: float = 3.0
    ) -> WithBody[Any]:
        raise UnsupportedRequest("a broker sends its clients oneway requests only")

    def close(self) -> None:
        """The client is gone: the broker forgets what it kept of it."""
        if self.closed:
            return
        try:
            self.served.loop.call_soon_threadsafe(self.mark_closed)
        except RuntimeError:  # the broker's loop is closed: nothing is kept any more
            self.closed = True


def _answer(result: Response | WithBody[Any] | None) -> WithBody[Any]:
    if isinstance(result, WithBody):
        header, body = result
        return WithBody(header, body if isinstance(body, bytes) else bytes(body))
    return WithBody(result, b"")


def _settle(answered: asyncio.Future[WithBody[Any]], outcome: Any) -> None:
    if answered.done():  # (the client stopped waiting: its time-out ran out)
        return
    if isinstance(outcome, BaseException):
        answered.set_exception(outcome)
    else:
        answered.set_result(outcome)


def _failure(request: Request[Any], exc: BaseException) -> BaseException:
    """What the client of a real connection gets for a handler's ``exc``."""
    if isinstance(exc, TxmqError):
        return error_for_code(exc.code, str(exc))
    text = clip(f"{type(exc).__name__}: {exc}")
    stack = "".join(traceback.format_tb(exc.__traceback__))
    log.error("handling %s failed: %s\n%s", type(request).__name__, text, stack)
    return error_for_code(ResponseCode.SYSTEM_ERROR, text)


def _handle(
    served: Served,
    peer: _Peer,
    request: Request[Any],
    body: bytes,
    oneway: bool,
    done: Callable[[WithBody[Any] | BaseException], None],
) -> None:
    """On the broker's loop: ``request`` through its router; ``done`` gets the answer or
    the error (at once, or when a held request is answered)."""
    try:
        result: Any = served.router.serve(request, Call(peer, body, None, oneway))
    except Exception as exc:
        done(_failure(request, exc))
        return
    if not (isinstance(result, asyncio.Future) or inspect.isawaitable(result)):
        done(_answer(result))
        return
    pending = asyncio.ensure_future(result)

    def answered(f: asyncio.Future[Any]) -> None:
        if f.cancelled():
            done(BrokerUnavailable(f"{type(request).__name__} was dropped by the broker"))
        elif (exc := f.exception()) is not None:
            done(_failure(request, exc))
        else:
            done(_answer(f.result()))

    pending.add_done_callback(answered)


class _LoopbackRemote:
    """One broker address as a loopback client's remote."""

    def __init__(self, address: str, side: ClientSide) -> None:
        self.address = address
        self.side = side
        self._peer: _Peer | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    def attach(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg

    def detach(self) -> None:
        peer, self._peer = self._peer, None
        if peer is not None:
            peer.close()
        self._tg = None

    async def connection(self) -> _Peer:
        peer = self._peer
        if (
            peer is not None
            and not peer.closed
            and _SERVED.get(peer.served.address) is (peer.served)
        ):
            return peer
        if self._tg is None:
            raise BrokerUnavailable("client is not started")
        if peer is not None:
            peer.close()
        peer = self._peer = _Peer(served(self.address), self)
        heartbeat = self.side.heartbeat()
        if heartbeat is not None:  # who the client is, first (as over a new connection)
            await self._oneway(peer, heartbeat, b"")
        return peer

    async def call(
        self, request: Request[Any], body: bytes = b"", *, timeout: float = 3.0
    ) -> WithBody[Any]:
        peer = await self.connection()
        fault = peer.served._fault(request)
        if fault is not None and fault.error is not None:
            # a new one each time, as an answer off the wire would be (never sent)
            failed = error_for_code(fault.error.code, str(fault.error))
            if isinstance(failed, BrokerUnavailable):
                failed.sent = False
            raise failed
        try:
            with anyio.fail_after(timeout if timeout > 0 else None):
                answer = await peer.served.request(peer, request, body)
                if fault is not None:  # done, and its answer lost
                    await anyio.sleep_forever()
        except TimeoutError:
            raise RequestTimeout(
                f"no answer to request {request.CODE} within {timeout:.1f}s from {peer.name}"
            ) from None
        return answer

    async def send_oneway(self, request: Request[Any], body: bytes = b"") -> None:
        await self._oneway(await self.connection(), request, body)

    async def _oneway(self, peer: _Peer, request: Request[Any], body: bytes) -> None:
        try:
            await peer.served.request(peer, request, body, oneway=True)
        except TxmqError as exc:  # (nobody waits for the answer of a oneway request)
            log.debug("oneway %s failed: %s", type(request).__name__, exc)


class LoopbackTransport:
    """Brokers served in this process (``transport="loopback"``): see the module."""

    name = "loopback"
    full_protocol = True
    routes_itself = False
    default_address = None

    def check(self) -> None:
        return None

    def remote(self, address: str, side: ClientSide) -> Remote:
        return _LoopbackRemote(address, side)


TRANSPORT = LoopbackTransport()
