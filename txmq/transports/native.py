"""txmq's own protocol as a transport: a TCP connection per broker (TLS and signed requests
when the client's security says so), multiplexing requests both ways.

A new connection first tells the broker who the client is (its heartbeat), so that a broker
that restarted knows the client before anything else it sends; requests the broker sends
(check-backs, rebalance notices, offset resets) are decoded into typed requests and served
by the client (:attr:`ClientSide.serve`)."""

from __future__ import annotations

from txmq.protocol.connection import Connection, HandlerResult
from txmq.protocol.peer import RemotingClient
from txmq.protocol.wire.base import decode, request_class
from txmq.protocol.wire.frame import Frame
from txmq.transports.port import ClientSide, Remote

__all__ = ["TRANSPORT", "NativeTransport"]


class NativeTransport:
    """txmq's own protocol (``transport="txmq"``, the default)."""

    name = "txmq"
    full_protocol = True
    routes_itself = False
    default_address = None

    def check(self) -> None:
        return None

    def remote(self, address: str, side: ClientSide) -> Remote:
        def handle(conn: Connection, frame: Frame) -> HandlerResult:
            # (UnsupportedRequest for a code no request class has, or the client does not
            # serve: answered as such)
            kind = request_class(frame.code, frame.version)
            return side.serve(decode(kind, frame.header), frame.body, conn)

        async def announce(conn: Connection) -> None:
            heartbeat = side.heartbeat()
            if heartbeat is not None:
                conn.send_oneway(heartbeat)

        return RemotingClient(
            address,
            handle,
            connect_timeout=side.connect_timeout,
            max_frame_size=side.max_frame_size,
            security=side.security,
            on_connect=[announce],
        )


TRANSPORT = NativeTransport()
