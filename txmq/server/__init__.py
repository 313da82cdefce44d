"""What txmq's servers share — the broker, the name server, the controller and the gRPC
proxy — and clients never use: listening and serving connections under limits
(:mod:`.serving`), state kept in JSON files that survive a damaged write (:mod:`.jsonfile`),
and RocketMQ 5's gRPC endpoint over a core the broker or the proxy fills (:mod:`.grpc`, the
``txmq[grpc]`` extra: imported by those who serve it)."""

from txmq.server.serving import ConnectionSettings, EmbeddedServer

__all__ = ["ConnectionSettings", "EmbeddedServer"]
