"""How a client reaches brokers: txmq's own protocol, RocketMQ 5's gRPC protocol
(:mod:`.grpc`, the ``txmq[grpc]`` extra)."""
