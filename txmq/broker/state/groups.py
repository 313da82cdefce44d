"""Consumer and producer groups as the broker sees them (RocketMQ's ``ConsumerManager``).

Clients announce themselves with HEARTBEAT (at start and every 30 s).  A member leaves its
group when it unregisters, when its connection closes, or when no heartbeat came for
``consumer_channel_expiry_s``.  Whenever the client ids of a consumer group change, every
member gets a oneway NOTIFY_CONSUMER_IDS_CHANGED so that it re-balances at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from txmq.protocol.connection import Connection
from txmq.protocol.message import retry_topic
from txmq.protocol.rpc import Call
from txmq.protocol.wire import (
    ConsumerConnection,
    ConsumerConnections,
    ConsumerList,
    Empty,
    GetConsumerConnectionList,
    GetConsumerListByGroup,
    Heartbeat,
    NotifyConsumerIdsChanged,
    Request,
    UnregisterClient,
)
from txmq.protocol.wire.errors import BadRequest, TxmqError

if TYPE_CHECKING:
    from txmq.broker.state.topics import TopicManager

__all__ = [
    "CheckChannel",
    "ConsumerGroupInfo",
    "ConsumerManager",
    "ConsumerMember",
    "GroupService",
    "ProducerManager",
    "channel_user",
    "run_expiry_scan",
]

log = logging.getLogger("txmq.broker")

_HOOKED = "_txmq_group_close_hook"


@dataclass(slots=True)
class ConsumerMember:
    client_id: str
    conn: Connection
    last_heartbeat: float
    message_model: str = "CLUSTERING"
    consume_type: str = "CONCURRENTLY"
    subscriptions: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class ConsumerGroupInfo:
    group: str
    members: dict[str, ConsumerMember] = field(default_factory=dict)


class ConsumerManager:
    """group -> client id -> member; all calls come from the broker's event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._groups: dict[str, ConsumerGroupInfo] = {}

    def register(
        self,
        group: str,
        client_id: str,
        conn: Connection,
        *,
        message_model: str = "CLUSTERING",
        consume_type: str = "CONCURRENTLY",
        subscriptions: dict[str, str] | None = None,
    ) -> bool:
        """Add or refresh a member; True (and members notified) if it is new to the group."""
        info = self._groups.setdefault(group, ConsumerGroupInfo(group))
        member = info.members.get(client_id)
        now = self._clock()
        if member is None:
            info.members[client_id] = ConsumerMember(
                client_id, conn, now, message_model, consume_type, dict(subscriptions or {})
            )
            log.info("consumer %s joined group %s", client_id, group)
            self.notify(group)
            return True
        member.conn = conn
        member.last_heartbeat = now
        member.message_model = message_model
        member.consume_type = consume_type
        member.subscriptions = dict(subscriptions or {})
        return False

    def unregister(self, group: str, client_id: str, *, why: str = "unregistered") -> bool:
        info = self._groups.get(group)
        if info is None or info.members.pop(client_id, None) is None:
            return False
        log.info("consumer %s left group %s (%s)", client_id, group, why)
        if not info.members:
            del self._groups[group]
        self.notify(group)
        return True

    def connection_closed(self, conn: Connection) -> None:
        for group, info in list(self._groups.items()):
            gone = [cid for cid, m in info.members.items() if m.conn is conn]
            for cid in gone:
                self.unregister(group, cid, why="connection closed")

    def scan_expired(self, expiry_s: float) -> int:
        """Drop members whose last heartbeat is older than ``expiry_s``; return how many."""
        now = self._clock()
        dropped = 0
        for group, info in list(self._groups.items()):
            stale = [cid for cid, m in info.members.items() if now - m.last_heartbeat > expiry_s]
            for cid in stale:
                dropped += self.unregister(group, cid, why=f"no heartbeat for {expiry_s:g}s")
        return dropped

    def topic_changed(self, topic: str) -> None:
        """A topic appeared or changed its queue count: its subscribed groups rebalance."""
        for group, info in list(self._groups.items()):
            if any(topic in m.subscriptions for m in info.members.values()):
                self.notify(group)

    def notify(self, group: str) -> None:
        """Tell every member of ``group`` that its client ids changed (oneway, best effort)."""
        self.tell(group, NotifyConsumerIdsChanged(group=group))

    def tell(self, group: str, request: Request[Any]) -> int:
        """Send ``request`` oneway to every connected member of ``group`` (best effort);
        how many it was sent to."""
        info = self._groups.get(group)
        if info is None:
            return 0
        told = 0
        for member in list(info.members.values()):
            if member.conn.closed:
                continue
            try:
                member.conn.send_oneway(request)
            except TxmqError as exc:
                log.debug(
                    "sending %s to %s of group %s failed: %s",
                    type(request).__name__,
                    member.client_id,
                    group,
                    exc,
                )
            else:
                told += 1
        return told

    def client_ids(self, group: str) -> list[str]:
        info = self._groups.get(group)
        return sorted(info.members) if info is not None else []

    def connections(self, group: str = "") -> list[ConsumerConnection]:
        """The live members of ``group`` (empty: of every group), by group and client id."""
        now = self._clock()
        names = [group] if group else sorted(self._groups)
        return [
            ConsumerConnection(
                group=name,
                client_id=m.client_id,
                address=str(getattr(m.conn, "name", "") or "?"),
                message_model=m.message_model,
                consume_type=m.consume_type,
                subscriptions=dict(sorted(m.subscriptions.items())),
                heartbeat_age_s=round(max(now - m.last_heartbeat, 0.0), 3),
            )
            for name in names
            if (info := self._groups.get(name)) is not None
            for m in sorted(info.members.values(), key=lambda m: m.client_id)
        ]

    def group(self, group: str) -> ConsumerGroupInfo | None:
        return self._groups.get(group)

    def groups(self) -> list[str]:
        return sorted(self._groups)


class CheckChannel(Protocol):
    """How the broker reaches a producer for a check-back: a txmq connection, or a RocketMQ
    5 client's Telemetry stream (:class:`txmq.server.grpc.telemetry.Session`)."""

    @property
    def name(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def send_oneway(self, request: Any, body: bytes = b"") -> None: ...


def channel_user(channel: CheckChannel) -> str | None:
    """The user a channel's requests are signed by (None: not known, no access control)."""
    attributes = getattr(channel, "attributes", None)
    return attributes.get("acl_user") if attributes is not None else None


class ProducerManager:
    """producer group -> client id -> (channel, last heartbeat), for transaction checks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._groups: dict[str, dict[str, tuple[CheckChannel, float]]] = {}

    def register(self, group: str, client_id: str, conn: CheckChannel) -> None:
        self._groups.setdefault(group, {})[client_id] = (conn, self._clock())

    def unregister(self, group: str, client_id: str) -> None:
        members = self._groups.get(group)
        if members is not None and members.pop(client_id, None) is not None and not members:
            del self._groups[group]

    def connection_closed(self, conn: CheckChannel) -> None:
        for group, members in list(self._groups.items()):
            for cid in [c for c, (cn, _) in members.items() if cn is conn]:
                self.unregister(group, cid)

    def scan_expired(self, expiry_s: float) -> int:
        now = self._clock()
        dropped = 0
        for group, members in list(self._groups.items()):
            for cid in [c for c, (_, t) in members.items() if now - t > expiry_s]:
                self.unregister(group, cid)
                dropped += 1
        return dropped

    def connections(self, group: str) -> list[CheckChannel]:
        """Open connections of the group's producers, most recent heartbeat first."""
        members = sorted(self._groups.get(group, {}).values(), key=lambda m: -m[1])
        return [conn for conn, _ in members if not conn.closed]

    def client_ids(self, group: str) -> list[str]:
        return sorted(self._groups.get(group, {}))


class GroupService:
    """HEARTBEAT, UNREGISTER_CLIENT, GET_CONSUMER_LIST_BY_GROUP and
    GET_CONSUMER_CONNECTION_LIST."""

    def __init__(
        self, consumers: ConsumerManager, producers: ProducerManager, topics: TopicManager
    ) -> None:
        self.consumers = consumers
        self.producers = producers
        self.topics = topics

    def _on_close(self, conn: Connection) -> None:
        self.consumers.connection_closed(conn)
        self.producers.connection_closed(conn)

    def heartbeat(self, req: Heartbeat, call: Call) -> Empty:
        conn = call.conn
        conn.attributes["client_id"] = req.client_id
        if not req.consumers and not req.producers:
            return Empty()
        if not req.client_id:
            raise BadRequest("Heartbeat: header field 'client_id' must not be empty")
        for entry in req.consumers:
            if entry.message_model == "CLUSTERING":
                name = retry_topic(entry.group)
                cfg = self.topics.get(name)
                if cfg is None or not cfg.system:
                    self.topics.create_or_update(name, 1, system=True)
        if not conn.attributes.get(_HOOKED):
            conn.attributes[_HOOKED] = True
            conn.on_close.append(self._on_close)
        for entry in req.consumers:
            self.consumers.register(
                entry.group,
                req.client_id,
                conn,
                message_model=entry.message_model,
                consume_type=entry.consume_type,
                subscriptions=entry.subscriptions,
            )
        for group in req.producers:
            self.producers.register(group, req.client_id, conn)
        conn.attributes["consumer_groups"] = [e.group for e in req.consumers]
        conn.attributes["producer_groups"] = list(req.producers)
        return Empty()

    def unregister(self, req: UnregisterClient, call: Call) -> Empty:
        for group in req.consumer_groups:
            self.consumers.unregister(group, req.client_id)
        for group in req.producer_groups:
            self.producers.unregister(group, req.client_id)
        return Empty()

    def consumer_list(self, req: GetConsumerListByGroup, call: Call) -> ConsumerList:
        return ConsumerList(client_ids=self.consumers.client_ids(req.group))

    def connection_list(self, req: GetConsumerConnectionList, call: Call) -> ConsumerConnections:
        return ConsumerConnections(connections=self.consumers.connections(req.group))


async def run_expiry_scan(
    consumers: ConsumerManager, producers: ProducerManager, expiry_s: float
) -> None:
    """Every 10 s (a quarter of a shorter expiry) drop members that sent no heartbeat."""
    interval = min(10.0, max(expiry_s / 4, 0.05))
    while True:
        await anyio.sleep(interval)
        consumers.scan_expired(expiry_s)
        producers.scan_expired(expiry_s)
