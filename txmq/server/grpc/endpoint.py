"""A gRPC endpoint: a ``grpc.aio`` server on the program's own event loop, serving
``apache.rocketmq.v2.MessagingService`` (:mod:`txmq.server.grpc.service`) over a
:class:`~txmq.server.grpc.ports.BrokerCore` — a broker's (its ``--grpc-port``) or a
proxy's (``txmq proxy start``)."""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

from rocketmq.grpc_protocol import definition_pb2 as pb

from txmq.server.grpc.answering import settled
from txmq.server.grpc.convert import duration
from txmq.server.grpc.ports import ASKED, BrokerCore
from txmq.server.grpc.telemetry import Sessions
from txmq.server.serving import ListenerUnavailable

__all__ = ["DEFAULT_GRPC_PORT", "GrpcEndpoint", "GrpcUnavailable"]

log = logging.getLogger("txmq.grpc")

DEFAULT_GRPC_PORT = 8081


class GrpcUnavailable(ListenerUnavailable):
    """The endpoint cannot serve: its port is taken or cannot be bound."""


class GrpcEndpoint:
    def __init__(
        self, core: BrokerCore, *, what: str = "gRPC endpoint", optional: bool = True
    ) -> None:
        """``what``: the server in messages ("gRPC endpoint", "proxy"); ``optional``: it
        may be turned off (``--grpc-port 0``), as a broker's may."""
        self.core = core
        self.what = what
        self.optional = optional
        self.pop = core.pop
        self.routes = core.routes
        self.sessions = Sessions(core.producers, core.broker_name)
        self.port = 0
        self._server: Any = None

    # -- what the RPCs need ---------------------------------------------------------------

    def address(self) -> str:
        return self.core.advertised_address or f"{self.core.host}:{self.port}"

    def endpoints(self, address: str = "", asked: Any = None) -> Any:
        """``Endpoints`` of an address (default: this endpoint's; :data:`ASKED`: ``asked``,
        the endpoints the client named, if it named any)."""
        if address == ASKED:
            if asked is not None and len(asked.addresses):
                return asked
            address = ""
        host, _, port = (address or self.address()).rpartition(":")
        host = host.strip("[]")
        try:
            scheme = pb.IPv6 if ipaddress.ip_address(host).version == 6 else pb.IPv4
        except ValueError:
            scheme = pb.DOMAIN_NAME
        return pb.Endpoints(scheme=scheme, addresses=[pb.Address(host=host, port=int(port))])

    async def group_policy(self, group: str) -> tuple[bool, int]:
        """(FIFO?, max delivery attempts: the first and the retries) of a consumer group."""
        fifo, retries = await settled(self.core.group_policy(group))
        return fifo, retries + 1

    def retry_policy(self, max_attempts: int) -> Any:
        """What consumers are told to wait between attempts: the broker's delay levels
        from level 3 on (RocketMQ's 10s 30s 1m 2m ... 2h)."""
        return pb.RetryPolicy(
            max_attempts=max_attempts,
            customized_backoff=pb.CustomizedBackoff(
                next=[duration(ms) for ms in self.core.retry_delays_ms]
            ),
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        import grpc.aio
        from rocketmq.grpc_protocol import service_pb2_grpc

        from txmq.server.grpc.service import MessagingService

        core = self.core
        chosen = core.grpc_port if core.grpc_port >= 0 else DEFAULT_GRPC_PORT  # 0: any free
        limit = core.max_frame_size
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ]
        )
        service_pb2_grpc.add_MessagingServiceServicer_to_server(MessagingService(self), server)
        where = f"{core.host}:{chosen}"
        try:
            if core.tls is not None:  # the server's certificate (and client CA)
                port = server.add_secure_port(where, core.tls.grpc_credentials())
            else:
                port = server.add_insecure_port(where)
        except RuntimeError:
            port = 0
        if not port:
            await server.stop(None)
            off = ", or turn it off with --grpc-port 0" if self.optional else ""
            raise GrpcUnavailable(
                f"the gRPC port {core.host}:{chosen} is in use or cannot be bound; choose "
                f"another with --grpc-port N{off}"
            )
        await server.start()
        self.port = port
        self._server = server
        log.info(
            "%s (RocketMQ 5 protocol) listening on %s%s",
            self.what,
            self.address(),
            " (TLS)" if core.tls is not None else "",
        )

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        for session in self.sessions.all():
            self.sessions.close(session)
        await server.stop(1.0)
