"""RocketMQ 5's gRPC protocol (``apache.rocketmq.v2.MessagingService``) over the broker's
own services, so that the official RocketMQ clients work against txmq.  Needs the
``txmq[grpc]`` extra (grpcio and the official client's generated modules)."""

from txmq.broker.grpc.endpoint import DEFAULT_GRPC_PORT, GrpcEndpoint, GrpcUnavailable

__all__ = ["DEFAULT_GRPC_PORT", "GrpcEndpoint", "GrpcUnavailable"]
