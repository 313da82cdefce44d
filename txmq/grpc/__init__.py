"""txmq's clients over RocketMQ 5's gRPC protocol (``transport="grpc"``).

The client core (routes, producer, transactions, push consumer) is the same as over txmq's
own protocol.  This package is a transport plugged in under it: the core names it in
:data:`txmq.client.TRANSPORT_MODULES` and loads it only when a client asks for
``transport="grpc"`` (it needs the ``txmq[grpc]`` extra), so the import graph stays
layered — this package stands on txmq's floor, the floor knows it by name alone.
:func:`txmq.grpc.remote.make_remote` makes the :class:`~txmq.grpc.remote.GrpcRemote` that
stands where a connection to a txmq broker would; :mod:`txmq.grpc.receiving` is the push
consumer's receive mode (RocketMQ 5 has no pull).
"""

__all__: list[str] = []
