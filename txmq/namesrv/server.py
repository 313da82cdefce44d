"""The name-server process: listener, connections, the expiry scan, clean shutdown — and
the controller, in a name server (``controller_store``) or alone (:class:`ControllerServer`,
``txmq controller start``).

Run it with ``txmq namesrv start`` or embed it: ``async with NamesrvServer(config)`` in an
anyio program, or :class:`EmbeddedNamesrv` (a background thread) from synchronous code.
Name servers never talk to each other; each learns the whole table from the brokers.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from txmq.namesrv.config import ControllerConfig, NamesrvConfig, controller_address
from txmq.namesrv.controller import Controller
from txmq.namesrv.etcd import EtcdLeadership, parse_endpoints
from txmq.namesrv.routes import RouteTable
from txmq.protocol.connection import Connection
from txmq.protocol.rpc import Call, Router
from txmq.protocol.settings import SettingsError
from txmq.protocol.wire import (
    ClusterInfo,
    Empty,
    GetClusterInfo,
    GetTopicRoute,
    RegisterBroker,
    Registered,
    TopicRoute,
    UnregisterBroker,
)
from txmq.security.acl.service import AclService
from txmq.server.serving import Acceptor, EmbeddedServer, Stoppable, warn_if_exposed

__all__ = [
    "ControllerServer",
    "EmbeddedController",
    "EmbeddedNamesrv",
    "NamesrvServer",
    "request_router",
]

log = logging.getLogger("txmq.namesrv")

#: marks a connection whose closing the table is told about
_HOOKED = "namesrv.hooked"


class NamesrvService:
    """The name server's answers, over its :class:`RouteTable`."""

    def __init__(self, table: RouteTable) -> None:
        self.table = table
        #: set when the server stops: its connections closing drop nothing (and say nothing)
        self.stopping = False

    def register(self, req: RegisterBroker, call: Call) -> Registered:
        conn = call.conn
        if not conn.attributes.get(_HOOKED):
            conn.attributes[_HOOKED] = True
            conn.on_close.append(self._closed)
        return self.table.register(req, conn)

    def _closed(self, conn: Connection) -> None:
        if not self.stopping:
            self.table.connection_closed(conn)

    def unregister(self, req: UnregisterBroker, call: Call) -> Empty:
        self.table.unregister(req)
        return Empty()

    def route(self, req: GetTopicRoute, call: Call) -> TopicRoute:
        # ``create`` asks a broker to create the topic; a name server cannot (clients
        # create topics on a broker and find them here after its registration)
        return self.table.route(req.topic)

    def cluster_info(self, req: GetClusterInfo, call: Call) -> ClusterInfo:
        return self.table.cluster_info()


def request_router(service: NamesrvService) -> Router:
    """Every request a name server answers (anything else: REQUEST_CODE_NOT_SUPPORTED)."""
    r = Router("a name server")
    r.route(RegisterBroker, service.register)
    r.route(UnregisterBroker, service.unregister)
    r.route(GetTopicRoute, service.route)
    r.route(GetClusterInfo, service.cluster_info)
    return r


class NamesrvServer(Stoppable):
    """A txmq name server. ``await server.serve()`` runs it until :meth:`request_stop`."""

    what = "name server"

    def __init__(
        self,
        config: NamesrvConfig,
        *,
        table: RouteTable | None = None,
        controller: Controller | None = None,
        routes: bool = True,
    ) -> None:
        """``controller``: serve the controller's requests too (by default one when
        ``config.controller_store`` is set); ``routes``: serve a name server's."""
        self.config = config
        self.table = table or RouteTable(expiry=config.broker_expiry_s)
        self.service = NamesrvService(self.table)
        self.routes = routes
        self.router = request_router(self.service) if routes else Router(f"a {self.what}")
        if controller is None and (config.controller_store or config.etcd):
            store = Path(config.controller_store) if config.controller_store else None
            controller = Controller(store, leadership=_leadership(config))
        self.controller = controller
        if controller is not None:
            controller.route(self.router)
            if routes:  # this name server's routes follow its controller's elections
                controller.on_elect.append(self.table.elected)
                controller.on_abandon.append(self.table.election_abandoned)
        #: access control (--acl FILE): None when off
        who = f"{self.what} {config.host}:{config.port}"
        self.guard = self.router.guard = config.guard(who)
        AclService(self.guard, f"this {self.what}").route(self.router)
        self.acceptor = Acceptor(
            self.router.handle,
            max_frame_size=config.max_frame_size,
            limits=config.connection_limits(),
            log_to="txmq.namesrv",
            tls=config.server_ssl_context(),
        )
        self.connections = self.acceptor.connections
        self.port = config.port

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[NamesrvServer] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        self._stop = anyio.Event()
        listener = await anyio.create_tcp_listener(
            local_host=self.config.host, local_port=self.config.port, reuse_port=False
        )
        self.port = listener.extra(SocketAttribute.local_port)
        tls = self.config.tls_cert is not None
        warn_if_exposed(self.what, self.config.host, tls=tls, acl=self.guard is not None)
        async with listener, anyio.create_task_group() as tg:
            self.acceptor.serve(listener, tg)
            if self.guard is not None:
                tg.start_soon(self.guard.watch)
            if self.routes:
                tg.start_soon(self._expiry_scan)
                log.info(
                    "name server listening on %s (brokers silent for %g s are dropped)",
                    self.address,
                    self.config.broker_expiry_s,
                )
            if self.controller is not None:
                leadership = self.controller.leadership
                if leadership is not None and not leadership.address:
                    leadership.address = controller_address(
                        self.config.host, self.port, self.config.advertised_address
                    )
                tg.start_soon(self.controller.run)
                log.info("controller on %s, state in %s", self.address, self.controller.where)
            task_status.started(self)
            await self._stop.wait()
            self.service.stopping = True
            tg.cancel_scope.cancel()
        log.info("%s stopped", self.what)

    async def _expiry_scan(self) -> None:
        while True:
            await anyio.sleep(self.config.scan_interval_s)
            self.table.expire()


class EmbeddedNamesrv(EmbeddedServer[NamesrvServer]):
    """A name server running in a background thread with its own event loop."""

    what = "name server"

    def __init__(self, config: NamesrvConfig | None = None) -> None:
        self.config = config or NamesrvConfig(port=0)
        super().__init__(lambda: NamesrvServer(self.config))


class ControllerServer(NamesrvServer):
    """A controller in a process of its own (``txmq controller start``)."""

    what = "controller"

    def __init__(self, config: ControllerConfig) -> None:
        shared = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(NamesrvConfig)
            if f.name in {g.name for g in dataclasses.fields(ControllerConfig)}
            and f.name != "store"
        }
        leadership = _leadership(config)
        super().__init__(
            NamesrvConfig(**shared),
            controller=Controller(
                None if leadership is not None else config.store,
                config.timings(),
                leadership=leadership,
            ),
            routes=False,
        )


class EmbeddedController(EmbeddedServer[ControllerServer]):
    """A controller running in a background thread with its own event loop."""

    what = "controller"

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        super().__init__(lambda: ControllerServer(self.config))


def _leadership(config: NamesrvConfig | ControllerConfig) -> EtcdLeadership | None:
    """A controller's candidacy on etcd, when ``config.etcd`` names endpoints."""
    if not config.etcd:
        return None
    try:
        import aetcd  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        raise SettingsError(
            "controllers on etcd need the aetcd package: pip install 'txmq[etcd]'"
        ) from None
    address = config.advertised_address  # else host:port, once the port is bound
    return EtcdLeadership(
        parse_endpoints(config.etcd),
        address,
        prefix=config.etcd_prefix,
        ttl_s=config.etcd_lease_s,
    )
