"""RocketMQ 5's gRPC protocol (``apache.rocketmq.v2.MessagingService``) over a core that a
program fills (:class:`BrokerCore`): a broker with its own services
(``txmq/broker/grpc_core.py``), a proxy with calls to the cluster's brokers
(``txmq/proxy/``), so that the official RocketMQ clients work against txmq.  Needs the
``txmq[grpc]`` extra (grpcio and the official client's generated modules)."""

from txmq.server.grpc.endpoint import DEFAULT_GRPC_PORT, GrpcEndpoint, GrpcUnavailable
from txmq.server.grpc.ports import (
    ASKED,
    BrokerCore,
    Popped,
    PopPort,
    ProducerRegistry,
    QueueSet,
    RouteSource,
    Stored,
)
from txmq.server.grpc.routes import Routes
from txmq.server.grpc.telemetry import parse_transaction_id, transaction_id

__all__ = [
    "ASKED",
    "DEFAULT_GRPC_PORT",
    "BrokerCore",
    "GrpcEndpoint",
    "GrpcUnavailable",
    "PopPort",
    "Popped",
    "ProducerRegistry",
    "QueueSet",
    "RouteSource",
    "Routes",
    "Stored",
    "parse_transaction_id",
    "transaction_id",
]
