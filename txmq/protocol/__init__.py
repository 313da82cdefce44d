"""The protocol floor: what every txmq process shares and nothing of txmq sits under.

:mod:`.wire` (typed requests and answers per code and version, frames; and
:mod:`.wire.errors`, the one home of txmq's exceptions, each with its response code and
``retriable`` flag),
:mod:`.message` (the message model), :mod:`.codec` (stored records), :mod:`.connection`
(a multiplexed connection, its flow control in :mod:`.flow`), :mod:`.peer` (a client's
connection to one server), :mod:`.rpc` (typed request routing), :mod:`.grpc_convert`
(RocketMQ 5's gRPC messages, shared by the gRPC transport and the broker's endpoint) and
:mod:`.settings` (settings from TOML files and the environment)."""

from txmq.protocol.message import Message, MessageExt, MessageQueue, stable_hash

__all__ = ["Message", "MessageExt", "MessageQueue", "stable_hash"]
