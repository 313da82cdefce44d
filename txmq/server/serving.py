"""What every txmq server shares (the broker, the name server): accepting connections
under the connection limits, and running in a background thread for synchronous code."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import ssl
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Generic, Protocol, Self, TypeVar, cast

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
from anyio.abc import SocketAttribute, SocketListener

from txmq.protocol.connection import Connection, Handler
from txmq.protocol.flow import ConnectionLimits, FrameBudget, stop_eager_reading
from txmq.protocol.settings import SettingsError
from txmq.protocol.wire.frame import DEFAULT_MAX_FRAME_SIZE
from txmq.security.acl.binding import AuthStrategy
from txmq.security.acl.guard import Guard
from txmq.security.tls import ServerTls, accept_tls

__all__ = [
    "Acceptor",
    "ConnectionSettings",
    "EmbeddedServer",
    "ListenerUnavailable",
    "Server",
    "Stoppable",
    "warn_if_exposed",
]


class ListenerUnavailable(Exception):
    """A listener a server was asked for cannot start (its port is taken, or what it needs
    is not installed); the message says what to do."""


log = logging.getLogger("txmq.serving")

#: how long a TLS handshake may take when connections have no frame timeout
HANDSHAKE_TIMEOUT_S = 30.0
#: accept() errors that mean "no room for another connection now", not "the listener broke"
_NO_ROOM = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True)
class ConnectionSettings:
    """A server's settings for its connections (a base of its settings dataclass)."""

    #: the largest frame (a request or an answer, header and body) a connection may send;
    #: a larger one is refused with an error answer
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    #: a connection that neither sends nor receives for this long is closed (RocketMQ's
    #: `serverChannelMaxIdleTimeSeconds`); clients reconnect when they need to
    idle_timeout_s: float = 120.0
    #: a connection that started a frame and did not complete it for this long is closed
    frame_timeout_s: float = 30.0
    #: stop reading a connection while this many bytes of answers wait for it to read them
    connection_write_buffer: int = 4 * 1024 * 1024
    #: stop reading a connection while this many of its requests are not answered
    connection_max_inflight: int = 10_000
    #: memory all connections together may hold in frames not yet complete (at least
    #: max_frame_size); a big frame waits, unread, until it fits
    incoming_frame_memory: int = 64 * 1024 * 1024
    #: TLS on the server's ports: its certificate (a PEM file; with tls_key, or neither)
    #: (RocketMQ's `tls.server.certPath`)
    tls_cert: Path | None = None
    #: the private key of tls_cert (a PEM file) (RocketMQ's `tls.server.keyPath`)
    tls_key: Path | None = None
    #: with TLS on, require client certificates signed by this authority (a PEM file)
    #: (RocketMQ's `tls.server.trustCertPath`)
    tls_ca: Path | None = None
    #: access control: the users and rules file (TOML, :mod:`txmq.security.acl.policy`), read again
    #: when it changes; every request must then be signed by a user allowed to make it
    #: (None: no access control, anyone who reaches the port may do anything)
    acl_file: Path | None = None
    #: how far a signed request's time may be from this server's clock
    acl_time_window_s: float = 60.0
    #: "stateful": a TLS connection is authenticated once, by its first signed request or
    #: (with tls_ca) a client certificate whose common name is a user's, and its later
    #: requests go unsigned; "stateless": every request is signed and checked (plaintext
    #: connections always are) (RocketMQ 5's `authenticationStrategy`)
    acl_auth_strategy: AuthStrategy = AuthStrategy.STATEFUL

    def __post_init__(self) -> None:
        if self.max_frame_size < 64 * 1024:
            raise SettingsError("max_frame_size must be at least 64 KiB")
        if not self.idle_timeout_s > 0:
            raise SettingsError("idle_timeout_s must be positive")
        if not self.frame_timeout_s > 0:
            raise SettingsError("frame_timeout_s must be positive")
        if self.connection_write_buffer < 64 * 1024:
            raise SettingsError("connection_write_buffer must be at least 64 KiB")
        if self.incoming_frame_memory < self.max_frame_size:
            raise SettingsError("incoming_frame_memory must be at least max_frame_size")
        if self.connection_max_inflight < 1:
            raise SettingsError("connection_max_inflight must be at least 1")
        self._check_tls()
        if not 1 <= self.acl_time_window_s <= 3600:
            raise SettingsError("acl_time_window_s must be between 1 and 3600 seconds")
        if not isinstance(self.acl_auth_strategy, AuthStrategy):  # ...="stateless" in code
            try:
                strategy = AuthStrategy(str(self.acl_auth_strategy).lower())
            except ValueError:
                raise SettingsError(
                    f"acl_auth_strategy must be 'stateful' or 'stateless', not "
                    f"{self.acl_auth_strategy!r}"
                ) from None
            object.__setattr__(self, "acl_auth_strategy", strategy)

    def _check_tls(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, name)
            if isinstance(value, str):  # Config(tls_cert="server.pem") in code
                object.__setattr__(self, name, Path(value) if value else None)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsError("tls_cert and tls_key go together: set both (or neither)")
        if self.tls_ca is not None and self.tls_cert is None:
            raise SettingsError(
                "tls_ca (require client certificates) needs TLS on: set tls_cert and tls_key"
            )
        self.server_ssl_context()  # unreadable or mismatched files fail at start

    def server_tls(self) -> ServerTls | None:
        """The server's TLS files (None: plaintext)."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return ServerTls(self.tls_cert, self.tls_key, self.tls_ca)

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The server side's TLS context (None: plaintext)."""
        return self._server_ssl_context

    @cached_property
    def _server_ssl_context(self) -> ssl.SSLContext | None:
        tls = self.server_tls()
        return tls.context() if tls is not None else None

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(
            idle_timeout=self.idle_timeout_s,
            frame_timeout=self.frame_timeout_s,
            write_buffer=self.connection_write_buffer,
            max_inflight=self.connection_max_inflight,
            frame_memory=self.incoming_frame_memory,
        )

    def guard(self, who: str) -> Guard | None:
        """The access control of these settings (``acl_file``; None: off).
        SettingsError for a file that cannot be read or is not a valid ACL."""
        if self.acl_file is None:
            return None
        return Guard(
            self.acl_file,
            window_s=self.acl_time_window_s,
            who=who,
            strategy=self.acl_auth_strategy,
        )


class Acceptor:
    """Accepts connections and runs each as a :class:`Connection` with the limits (and
    the frame memory shared by all of them)."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_frame_size: int,
        limits: ConnectionLimits,
        log_to: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: every connection is TLS (its handshake run in the connection's own
        task, within ``limits.frame_timeout``; a plaintext client is answered with one
        error frame naming TLS and closed)."""
        self.handler = handler
        self.tls = tls
        self.max_frame_size = max_frame_size
        self.limits = limits
        self.frame_budget = FrameBudget(limits.frame_memory)
        self.connections: set[Connection] = set()
        self._log = logging.getLogger(log_to)

    def serve(self, listener: anyio.abc.Listener[Any], tg: anyio.abc.TaskGroup) -> None:
        """Accept on every socket of ``listener`` (one per address family) in ``tg``."""
        listeners = getattr(listener, "listeners", [listener])
        for one in listeners:
            tg.start_soon(self._accept_loop, cast(SocketListener, one), tg)

    async def _accept_loop(self, listener: SocketListener, tg: anyio.abc.TaskGroup) -> None:
        """Out of file descriptors (or memory), refuse new connections for a moment and keep
        serving the open ones (one line when it starts, one when it ends)."""
        refusing = False
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _NO_ROOM:
                    raise
                if not refusing:
                    refusing = True
                    self._log.warning(
                        "cannot accept connections: %s (%d open); new ones wait until some "
                        "close (raise the open-file limit: ulimit -n)",
                        exc.strerror or exc,
                        len(self.connections),
                    )
                await anyio.sleep(0.1)
                continue
            if refusing:
                refusing = False
                self._log.warning("accepting connections again (%d open)", len(self.connections))
            tg.start_soon(self._serve_stream, stream)

    async def _serve_stream(self, stream: anyio.abc.SocketStream) -> None:
        try:
            peer = stream.extra(SocketAttribute.remote_address)
            name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        except Exception:
            name = "?"
        carrier: anyio.abc.ByteStream = stream
        if self.tls is not None:
            stop_eager_reading(stream)
            secured = await accept_tls(
                stream,
                self.tls,
                peer=name,
                timeout=self.limits.frame_timeout or HANDSHAKE_TIMEOUT_S,
                logger=self._log,
            )
            if secured is None:
                return
            carrier = secured
        conn = Connection(
            carrier,
            self.handler,
            max_frame_size=self.max_frame_size,
            name=name,
            limits=self.limits,
            budget=self.frame_budget,
        )
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)


def _is_loopback(host: str) -> bool:
    bare = host.strip("[]").lower()
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def warn_if_exposed(what: str, host: str, *, tls: bool, acl: bool) -> None:
    """One warning line when ``what`` (a server) listens beyond this machine (``host`` is
    not a loopback address) without access control, or in plaintext."""
    if _is_loopback(host) or (tls and acl):
        return
    missing = []
    if not acl:
        missing.append(
            "without access control: anyone who reaches the port may send, consume and "
            "administer (--acl FILE turns it on)"
        )
    if not tls:
        missing.append("without TLS: its traffic is plaintext (--tls-cert/--tls-key)")
    log.warning("%s listens on %s %s", what, host or "every address", "; and ".join(missing))


class Stoppable:
    """``async with server:`` runs ``serve()`` in a task group until the block ends;
    :meth:`request_stop` ends ``serve()`` from anywhere on its loop."""

    _stop: anyio.Event | None = None
    _stack: AsyncExitStack | None = None

    async def serve(self, *, task_status: anyio.abc.TaskStatus[Any] = ...) -> None:
        raise NotImplementedError

    def request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def __aenter__(self) -> Self:
        stack = AsyncExitStack()
        tg = await stack.enter_async_context(anyio.create_task_group())
        await tg.start(self.serve)
        self._stack = stack
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.request_stop()
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None


class Server(Protocol):
    @property
    def address(self) -> str: ...

    async def serve(self, *, task_status: anyio.abc.TaskStatus[Any] = ...) -> None: ...

    def request_stop(self) -> None: ...


S = TypeVar("S", bound=Server)


class EmbeddedServer(Generic[S]):
    """A server running in a background thread with its own event loop."""

    what = "server"

    def __init__(self, make: Callable[[], S]) -> None:
        self._make = make
        self.server: S | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._portal_stop: Callable[[], None] | None = None
        #: the event loop the server runs on, while it runs
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def address(self) -> str:
        assert self.server is not None, f"{self.what} not started"
        return self.server.address

    def start(self, timeout: float = 60.0) -> Self:
        self._ready.clear()
        self._error = None
        name = f"txmq-{self.what.replace(' ', '-')}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"embedded {self.what} did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        async def main() -> None:
            server = self._make()
            self.loop = asyncio.get_running_loop()
            token = anyio.lowlevel.current_token()
            self._portal_stop = lambda: anyio.from_thread.run_sync(server.request_stop, token=token)
            async with anyio.create_task_group() as tg:
                await tg.start(server.serve)
                self.server = server
                self._ready.set()

        try:
            anyio.run(main)
        except BaseException as exc:
            self._error = exc
            if not self._ready.is_set():
                self._ready.set()
            else:
                log.exception("embedded %s failed", self.what)

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        if self._portal_stop is not None and self._thread.is_alive():
            try:
                self._portal_stop()
            except RuntimeError:
                pass
        self._thread.join(timeout)
        self._thread = None
        self.loop = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
