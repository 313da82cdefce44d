"""The base of every txmq client: lifecycle, broker connections and routes.

A client is given one broker's address or a list of name servers (never both); either way
its requests are routed by the same core (:mod:`txmq.client.route`).

It reaches brokers through a transport (:mod:`txmq.transports.port`), named by
``transport`` (default: ``$TXMQ_TRANSPORT``, else ``"txmq"``, txmq's own protocol):
``"grpc"`` (RocketMQ 5's gRPC protocol: the address is then a RocketMQ 5 endpoint, a
RocketMQ proxy or a txmq broker's ``--grpc-port``; only producers and the push consumer speak
it: :attr:`BrokerClient.needs_full_protocol`), ``"loopback"`` (an in-process broker, for
tests: :mod:`txmq.testing`), or any transport object.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, Self, runtime_checkable

import anyio

from txmq.client.route import Route, RouteTable
from txmq.protocol.message import MessageQueue
from txmq.protocol.peer import parse_address, parse_namesrv
from txmq.protocol.wire import (
    DEFAULT_MAX_FRAME_SIZE,
    MASTER_ID,
    GetClusterInfo,
    Heartbeat,
    Request,
    WithBody,
)
from txmq.protocol.wire.base import R, Response
from txmq.protocol.wire.errors import BrokerUnavailable, TxmqError, UnsupportedRequest
from txmq.security.client import ClientSecurity, client_security
from txmq.transports import port
from txmq.transports.port import Calls, ClientSide, Remote, Transport

__all__ = [
    "DEFAULT_ADDRESS",
    "BrokerClient",
    "Replica",
    "default_address",
    "default_transport",
    "endpoints",
]

#: which replica of a broker set a request goes to (see :meth:`BrokerClient.call`)
Replica = Literal["master", "any", "slave"]

DEFAULT_ADDRESS = "127.0.0.1:10911"
_INSTANCES = itertools.count(1)

log = logging.getLogger("txmq.client")


def default_transport() -> str:
    """``$TXMQ_TRANSPORT`` (the name of an installed transport), else ``txmq``."""
    value = os.environ.get("TXMQ_TRANSPORT", "").strip().lower() or "txmq"
    if value not in port.names():
        raise ValueError(f"$TXMQ_TRANSPORT is {value!r}: it must be one of {port.known()}")
    return value


@runtime_checkable
class _Closes(Protocol):
    async def aclose(self) -> None: ...


def default_address() -> str:
    """``$TXMQ_BROKER_ADDRESS`` or 127.0.0.1:10911."""
    return os.environ.get("TXMQ_BROKER_ADDRESS", DEFAULT_ADDRESS)


def endpoints(
    address: str | None, namesrv: str | Sequence[str] | None
) -> tuple[str | None, tuple[str, ...]]:
    """(broker address, name servers): exactly one of them.  Without either,
    ``$TXMQ_NAMESRV_ADDR`` names name servers, else ``$TXMQ_BROKER_ADDRESS`` (or
    127.0.0.1:10911) a broker.  ValueError for both, or for a malformed address."""
    if address and namesrv:
        raise ValueError(
            "give a broker address or a name-server list, not both (a broker address "
            "talks to that broker alone; name servers route over the whole cluster)"
        )
    if namesrv:
        text = namesrv if isinstance(namesrv, str) else ";".join(namesrv)
        servers = parse_namesrv(text)
        if not servers:
            raise ValueError("the name-server list is empty")
        return None, servers
    if not address:
        env_ns = os.environ.get("TXMQ_NAMESRV_ADDR", "")
        if env_ns:
            if os.environ.get("TXMQ_BROKER_ADDRESS"):
                raise ValueError(
                    "both $TXMQ_NAMESRV_ADDR and $TXMQ_BROKER_ADDRESS are set: unset one"
                )
            return None, parse_namesrv(env_ns, setting="$TXMQ_NAMESRV_ADDR")
        address = default_address()
    parse_address(address)
    return address, ()


class BrokerClient:
    """Connection to one broker, started with ``start()``/``stop()`` or ``async with``.

    Runs on asyncio (which SQLAlchemy's async engines need too).
    """

    #: through name servers, heartbeat the master of every broker set they know (asked
    #: again at each heartbeat), not only the brokers this client has talked to: a
    #: transactional producer, so that any broker set's check-backs reach it
    heartbeat_every_master = False
    #: whether this client needs every txmq request (pulls, admin requests): such clients
    #: keep txmq's protocol whatever $TXMQ_TRANSPORT says when it names a transport that
    #: lacks them (RocketMQ 5's gRPC protocol serves producers and push consumers only)
    needs_full_protocol = True

    def __init__(
        self,
        address: str | None = None,
        *,
        namesrv: str | Sequence[str] | None = None,
        request_timeout: float = 3.0,
        connect_timeout: float = 3.0,
        route_ttl: float = 30.0,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        transport: str | Transport | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        tls: bool | None = None,
        tls_ca: str | Path | None = None,
        security: ClientSecurity | None = None,
    ) -> None:
        """``access_key``/``secret_key``, ``tls``/``tls_ca`` (or all of it as one
        ``security``): how to reach secured brokers and name servers; what is not given
        comes from ``$TXMQ_ACCESS_KEY``, ``$TXMQ_TLS``, ``$TXMQ_TLS_CA``, ... and the
        ``[client]`` table of ``$TXMQ_CONFIG`` (:func:`txmq.security.client_security`)."""
        #: how this client reaches brokers, and its name (``"txmq"``, ``"grpc"``, ...)
        self.carrier = self._choose_transport(transport)
        self.transport = self.carrier.name
        self.security = client_security(
            security, access_key=access_key, secret_key=secret_key, tls=tls, tls_ca=tls_ca
        )
        if self.carrier.routes_itself:
            if namesrv or (not address and os.environ.get("TXMQ_NAMESRV_ADDR")):
                raise ValueError(
                    f"transport={self.transport!r} takes one endpoint's address (for 'grpc': a "
                    "RocketMQ proxy, or a txmq broker's --grpc-port), not name servers: the "
                    "endpoint routes itself"
                )
            address = (
                address or os.environ.get("TXMQ_BROKER_ADDRESS") or self.carrier.default_address
            )
        direct, servers = endpoints(address, namesrv)
        #: the broker this client talks to alone (None: it routes through name servers)
        self.direct = direct
        self.namesrv = servers
        self.address = direct or ";".join(servers)
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.max_frame_size = max_frame_size
        self.route_ttl = route_ttl
        self._side = ClientSide(
            client_id=lambda: self.client_id,
            heartbeat=self._heartbeat_request,
            topics=self._declared_topics,
            serve=self.serve,
            connect_timeout=connect_timeout,
            max_frame_size=max_frame_size,
            security=self.security,
        )
        self.routes = RouteTable(
            broker=direct,
            namesrv=servers,
            connect=self._remote,
            ttl=route_ttl,
            request_timeout=request_timeout,
        )
        self._tg: anyio.abc.TaskGroup | None = None
        self.heartbeat_interval = 30.0
        #: brokers whose last heartbeat failed (said once, not at every interval)
        self._unreachable: set[str] = set()
        self._stop_event: anyio.Event | None = None
        self._lifetime: asyncio.Task[None] | None = None
        #: who this client is to a broker (producers and consumers name it themselves)
        self.client_id = f"{socket.gethostname()}@{os.getpid()}#{next(_INSTANCES)}"
        self._closing: list[_Closes] = []
        #: what ended the client's background work, if that did not come from stop()
        self._failure: BaseException | None = None

    def _choose_transport(self, transport: str | Transport | None) -> Transport:
        if transport is None:
            chosen = port.transport(default_transport())
            if self.needs_full_protocol and not chosen.full_protocol:
                return port.transport("txmq")  # ($TXMQ_TRANSPORT is for those who can)
            return chosen
        if isinstance(transport, str):
            chosen = port.transport(transport)  # (ValueError naming the transports there are)
        elif isinstance(transport, Transport):
            chosen = transport
            chosen.check()
        else:
            raise ValueError(f"transport must be a name or a transport, not {transport!r}")
        if self.needs_full_protocol and not chosen.full_protocol:
            raise ValueError(
                f"{type(self).__name__} speaks txmq's own protocol only: {chosen.name!r} has "
                "no such requests (RocketMQ 5's gRPC protocol serves Producer, "
                "TransactionProducer and PushConsumer)"
            )
        return chosen

    @property
    def started(self) -> bool:
        return self._lifetime is not None

    async def start(self) -> None:
        """Connect and start background work. Any task may later call :meth:`stop`."""
        if self._lifetime is not None:
            return
        started = anyio.Event()
        stop = self._stop_event = anyio.Event()
        self._failure = None

        async def lifetime() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    for remote in self.routes.remotes():
                        remote.attach(tg)
                    started.set()
                    await stop.wait()
                    for remote in self.routes.remotes():
                        remote.detach()
                    for closing in self._closing:
                        await closing.aclose()
                    tg.cancel_scope.cancel()
            except Exception as exc:
                # a background task failed: every request now says the client is stopped,
                # so say once, loudly, why it stopped
                self._failure = exc
                log.exception(
                    "%s %s stopped: a background task failed", type(self).__name__, self.client_id
                )
                raise
            finally:
                self._tg = None
                started.set()

        # The client's task group lives in a task of its own, so that start() and stop()
        # may be called from different tasks (a web framework's startup and shutdown hooks).
        self._lifetime = asyncio.get_running_loop().create_task(lifetime())
        await started.wait()
        if self._lifetime.done():
            task, self._lifetime = self._lifetime, None
            task.result()
        try:
            await self._on_start()
        except BaseException:
            await self.stop()
            raise

    async def _on_start(self) -> None:
        """Connect eagerly so that a wrong address fails at start, not at first use."""
        await self.connect()

    async def connect(self) -> None:
        """Reach the broker (or the first name server that answers)."""
        if self.direct is not None:
            await self.routes.remote(self.direct).connection()
            return
        errors = []
        for address in self.namesrv:
            try:
                await self.routes.remote(address).connection()
                return
            except BrokerUnavailable as exc:
                errors.append(str(exc))
        raise BrokerUnavailable("no name server is reachable: " + "; ".join(errors))

    def _remote(self, address: str) -> Remote:
        remote = self.carrier.remote(address, self._side)
        if isinstance(remote, _Closes):  # (a remote that holds more than its connections)
            self._closing.append(remote)
        if self._tg is not None:
            remote.attach(self._tg)
        return remote

    def _declared_topics(self) -> Sequence[str]:
        """Topics this client says it publishes (over gRPC, before it sends to them)."""
        return ()

    def serve(self, request: Request[Any], body: bytes, origin: Calls) -> Response | None:
        """A request a broker sent this client (a check-back, a rebalance notice), its body,
        and what answers it (``origin``); the answer (None: none).  Clients that serve
        requests override it; this one serves none."""
        raise UnsupportedRequest(
            f"{type(request).__name__} is not served by {type(self).__name__} {self.client_id}"
        )

    @property
    def remoting(self) -> Remote:
        """The connection to the broker this client was given (clients of name servers
        have one per broker: :meth:`remote`)."""
        if self.direct is None:
            raise BrokerUnavailable(
                "this client routes through name servers: name the broker (remote())"
            )
        return self.routes.remote(self.direct)

    def remote(self, broker_name: str | None = None) -> Remote:
        """The connection to a broker set's master (None: the broker given directly)."""
        return self.routes.remote(self.routes.address_of(broker_name))

    async def _on_stop(self) -> None:
        return None

    async def stop(self) -> None:
        task, self._lifetime = self._lifetime, None
        if task is None:
            return
        try:
            await self._on_stop()
        finally:
            if self._stop_event is not None:
                self._stop_event.set()
            try:
                await task
            except Exception:
                if self._failure is None:
                    raise
                # (its background work failed earlier: logged then; stopping succeeds)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- heartbeats (clients that register with the broker: consumers, transactional producers)

    def _heartbeat_request(self) -> Heartbeat | None:
        """What this client tells the broker about itself; None: it sends no heartbeats."""
        return None

    async def _heartbeat(self) -> None:
        """Heartbeat the broker (through name servers: every broker this client talks to,
        and with :attr:`heartbeat_every_master` every broker set's master; a broker checks
        a transaction back with a producer that heartbeats it)."""
        heartbeat = self._heartbeat_request()
        if heartbeat is None:
            return
        if self.direct is not None:
            await self.call(heartbeat)
            return
        # the brokers of the routes known now (not one that has gone: a master replaced,
        # a broker restarted elsewhere), and those this client still talks to
        known_now = self.routes.known_addresses()
        remotes = [r for r in self.broker_remotes() if r.address in known_now]
        if self.heartbeat_every_master:
            known = {r.address for r in remotes}
            remotes += [self.routes.remote(a) for a in await self._masters() if a not in known]
        async with anyio.create_task_group() as tg:  # a broker that is down holds up no other
            for remote in remotes:
                tg.start_soon(self._heartbeat_one, remote, heartbeat)

    async def _heartbeat_one(self, remote: Remote, heartbeat: Heartbeat) -> None:
        try:
            await remote.call(heartbeat, timeout=self.request_timeout)
        except TxmqError as exc:
            if remote.address not in self._unreachable:  # once per outage
                self._unreachable.add(remote.address)
                log.warning("heartbeat to broker %s failed: %s", remote.address, exc)
            return
        if remote.address in self._unreachable:
            self._unreachable.discard(remote.address)
            log.info("heartbeat to broker %s works again", remote.address)

    async def _masters(self) -> list[str]:
        """The master address of every broker set the name servers know (none if no name
        server answers: then the brokers already known are heartbeated alone)."""
        try:
            info = await self.routes.ask_namesrv(GetClusterInfo())
        except TxmqError as exc:
            log.warning("asking the name servers for the cluster's brokers failed: %s", exc)
            return []
        return sorted({a for b in info.brokers if (a := b.addresses.get(MASTER_ID)) is not None})

    def broker_remotes(self) -> list[Remote]:
        """The connections to brokers (not to name servers) this client has made."""
        return [r for r in self.routes.remotes() if r.address not in self.namesrv]

    async def _unregister(self, request: Request[Any]) -> None:
        """Tell every broker this client leaves (best effort: it is stopping)."""
        for remote in self.broker_remotes():
            try:
                await remote.call(request, timeout=self.request_timeout)
            except TxmqError:
                pass

    async def _heartbeat_loop(self) -> None:
        """Heartbeat every ``heartbeat_interval`` seconds (started by subclasses that need it)."""
        while True:
            await anyio.sleep(self.heartbeat_interval)
            try:
                await self._heartbeat()
            except TxmqError as exc:
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # a bug here must not end the client (the next one may work)
                log.exception("heartbeat failed unexpectedly")

    def _task_group(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            if self._failure is not None:
                raise BrokerUnavailable(
                    f"client stopped: its background work failed ({self._failure!r}; logged "
                    "with its stack); stop() it, then start() it again"
                )
            raise BrokerUnavailable("client is not started: call start() or use 'async with'")
        return self._tg

    async def call(
        self,
        request: Request[R],
        body: bytes = b"",
        *,
        timeout: float | None = None,
        broker: str | None = None,
        replica: Replica = "master",
    ) -> R:
        """Send a typed request to a broker set's master (``broker``: its name; None: the
        broker given directly); its typed answer (error answers raise).  ``replica`` for
        reads: "any" (the master, or a slave while the set has none), "slave" (a slave if
        the set has one)."""
        answer = await self.call_with_body(
            request, body, timeout=timeout, broker=broker, replica=replica
        )
        return answer.header

    async def call_with_body(
        self,
        request: Request[R],
        body: bytes = b"",
        *,
        timeout: float | None = None,
        broker: str | None = None,
        replica: Replica = "master",
    ) -> WithBody[R]:
        """Send a typed request; its typed answer and the answer's body (records)."""
        self._task_group()
        if replica == "master":
            remote = self.remote(broker)
        else:
            remote = self.routes.remote(self.routes.read_address(broker, slave=replica == "slave"))
        return await remote.call(
            request, body, timeout=self.request_timeout if timeout is None else timeout
        )

    async def route(self, topic: str, *, create: bool = False, refresh: bool = False) -> Route:
        """The topic's route (cached for ``route_ttl`` seconds)."""
        self._task_group()
        return await self.routes.route(topic, create=create, refresh=refresh)

    async def queue_nums(self, topic: str, *, create: bool = False, refresh: bool = False) -> int:
        """How many queues ``topic`` may be sent to, over all broker sets."""
        return len((await self.route(topic, create=create, refresh=refresh)).write_queues)

    async def queues(self, topic: str) -> list[int]:
        """The queue ids of a topic on the broker given directly."""
        route = await self.route(topic)
        return [mq.queue_id for mq in route.read_queues]

    async def message_queues(self, topic: str, *, refresh: bool = False) -> list[MessageQueue]:
        """Every queue of ``topic`` that may be consumed, over all broker sets."""
        return list((await self.route(topic, refresh=refresh)).read_queues)
