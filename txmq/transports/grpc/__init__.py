"""RocketMQ 5's gRPC protocol as a transport of the client core (``transport="grpc"``): the
channel to an endpoint (:mod:`.channel`), the broker "connection" that translates the
core's requests into RPCs (:mod:`.remote`) and the push consumer's receive mode
(:mod:`.receiving`).  Needs the ``txmq[grpc]`` extra; this module imports none of it until a
remote is made."""

from __future__ import annotations

from txmq.transports.port import ClientSide, Remote, require

__all__ = ["TRANSPORT", "GrpcTransport"]


class GrpcTransport:
    """RocketMQ 5's gRPC protocol: one endpoint (a RocketMQ proxy, or a txmq broker's
    ``--grpc-port``) that routes itself; producers and push consumers only."""

    name = "grpc"
    full_protocol = False
    routes_itself = True
    #: RocketMQ 5's proxy port
    default_address = "127.0.0.1:8081"

    def check(self) -> None:
        require(self.name, "grpc", "rocketmq.grpc_protocol")

    def remote(self, address: str, side: ClientSide) -> Remote:
        from txmq.transports.grpc.remote import GrpcRemote

        return GrpcRemote(
            address, side, connect_timeout=side.connect_timeout, security=side.security
        )


TRANSPORT = GrpcTransport()
