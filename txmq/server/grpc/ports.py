"""What the gRPC endpoint needs from what stands behind it, as interfaces.

The endpoint (``apache.rocketmq.v2.MessagingService``) stands on txmq's floor (messages,
the wire types, errors) and on :class:`BrokerCore`, which two programs fill: the broker
(``txmq/broker/grpc_core.py``) with its own services — the same typed calls txmq's protocol makes
— and the proxy (``txmq/proxy/``) with calls over txmq's protocol to the cluster's
brokers.  So the endpoint imports neither program, and both import the endpoint.

Names a client gives back carry the broker set that issued them where that is not the
endpoint's own (:attr:`BrokerCore.broker_name`): transaction ids
(:func:`txmq.server.grpc.telemetry.transaction_id`) and, through a proxy, receipt handles.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from txmq.protocol.message import MessageExt
from txmq.protocol.wire import Ended, EndTransaction, SendMessage, Sent
from txmq.security.tls import ServerTls

if TYPE_CHECKING:
    from txmq.protocol.rpc import Call
    from txmq.security.acl.guard import Guard

__all__ = [
    "ASKED",
    "BrokerCore",
    "PopPort",
    "Popped",
    "ProducerRegistry",
    "QueueSet",
    "RouteSource",
    "Stored",
]

#: a :class:`QueueSet`'s address meaning "where the client asked": the endpoints the client
#: names in its request (its access point: every proxy it was given), else this endpoint
#: (RocketMQ 5's proxy in cluster mode answers so)
ASKED = "*"


@dataclass(frozen=True, slots=True)
class QueueSet:
    """One broker set's queues of a topic, and where clients reach them over gRPC
    (``""``: this endpoint; :data:`ASKED`: where the client asked)."""

    broker_name: str
    address: str
    queue_nums: int
    readable: bool = True
    writable: bool = True


class RouteSource(Protocol):
    """A topic's queue sets, as routes and assignments answer them."""

    async def route(self, topic: str, create: bool) -> list[QueueSet]:
        """TopicNotFound if the topic has none (and ``create`` did not create it)."""
        ...


class Popped(Protocol):
    """A message handed out by a pop (``txmq.broker.consumption.pop.Popped``)."""

    @property
    def msg(self) -> MessageExt: ...
    @property
    def handle(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def invisible_until_ms(self) -> int: ...


class PopPort(Protocol):
    """RocketMQ 5's pop consumption (``txmq.broker.consumption.pop.PopService``, or a
    proxy's calls to the brokers).  Each call may answer at once or as a future."""

    async def pop(
        self,
        *,
        broker: str,
        group: str,
        topic: str,
        max_msgs: int,
        invisible_ms: int,
        poll_ms: int,
        expression: str,
        tag_codes: set[int] | None,
        fifo: bool,
        max_attempts: int,
    ) -> list[Any]:
        """Popped messages (``broker``: the broker set the client's assignment names; ""
        or one unknown: any; ``expression``: the tag filter, ``tag_codes`` its hash
        codes)."""
        ...

    def ack(self, *, group: str, topic: str, handle: str) -> Awaitable[None] | None: ...

    def change_invisible(
        self, *, group: str, topic: str, handle: str, invisible_ms: int
    ) -> Any | Awaitable[Any]: ...

    def dead_letter(
        self, *, group: str, topic: str, handle: str, reason: str = ""
    ) -> Awaitable[None] | None: ...


class ProducerRegistry(Protocol):
    """Producer groups (who gets a transaction's check-back)."""

    def register(self, group: str, client_id: str, conn: Any) -> None: ...
    def unregister(self, group: str, client_id: str) -> None: ...


#: a message stored: the broker set that stored it, and where
Stored = tuple[str, Sent]


@dataclass(frozen=True, slots=True)
class BrokerCore:
    """The broker (or the cluster, behind a proxy) as the endpoint sees it."""

    #: the broker set whose names the endpoint gives unqualified ("": a proxy, every
    #: transaction id and receipt handle names its broker set)
    broker_name: str
    #: where to listen (host, port: -1 for the default port) and what clients are told
    host: str
    grpc_port: int
    advertised_address: str
    max_message_size: int
    max_frame_size: int
    #: what a consumer waits between attempts (RocketMQ: delay levels 3 and on)
    retry_delays_ms: tuple[int, ...]
    #: a topic's queue sets (QueryRoute, QueryAssignment)
    routes: RouteSource
    #: store one message (the user who sent it under access control, else None): the
    #: core picks the queue (``queue_id`` is -1): by the message group
    #: (``properties[SHARDING_KEY]``, always the same queue), else round robin, retrying a
    #: retriable failure on another broker set where it has one
    send: Callable[[SendMessage, bytes, str | None], Awaitable[Stored]]
    #: the producer group of the half message at (broker set, commit-log offset), sent to
    #: ``topic`` as the client says; TransactionNotFound if there is none
    half_group: Callable[[str, int, str], str | Awaitable[str]]
    #: end a half on a broker set (TransactionService.end_transaction; the Call: who asks,
    #: under access control: the same check as txmq's protocol)
    end_transaction: Callable[[str, EndTransaction, Call | None], Ended | Awaitable[Ended]]
    pop: PopPort
    #: a consumer group's (FIFO?, retry max times)
    group_policy: Callable[[str], tuple[bool, int] | Awaitable[tuple[bool, int]]]
    producers: ProducerRegistry
    #: TLS on the endpoint (the broker's tls_cert, tls_key, tls_ca; None: plaintext)
    tls: ServerTls | None = None
    #: access control (the broker's guard; None: off): every RPC is signed and checked
    guard: Guard | None = None
