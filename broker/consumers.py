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
from typing import TYPE_CHECKING, Any

import anyio

from txmq.errors import BadRequest, ResponseCode, TxmqError
from txmq.message import retry_topic
from txmq.protocol import Frame, RequestCode
from txmq.remoting import Connection, HandlerResult, Response

if TYPE_CHECKING:
    from txmq.broker.server import Broker
    from txmq.broker.topics import TopicManager

__all__ = [
    "CONSUME_TYPES",
    "MESSAGE_MODELS",
    "ClientGroupHandlers",
    "ConsumerGroupInfo",
    "ConsumerManager",
    "ConsumerMember",
    "ProducerManager",
    "run_expiry_scan",
]

log = logging.getLogger("txmq.broker")

MESSAGE_MODELS = frozenset({"CLUSTERING", "BROADCASTING"})
CONSUME_TYPES = frozenset({"CONCURRENTLY", "ORDERLY"})
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
        info = self._groups.get(group)
        if info is None:
            return
        for member in list(info.members.values()):
            if member.conn.closed:
                continue
            try:
                member.conn.oneway(RequestCode.NOTIFY_CONSUMER_IDS_CHANGED, {"group": group})
            except TxmqError as exc:
                log.debug("notifying %s of group %s failed: %s", member.client_id, group, exc)

    def client_ids(self, group: str) -> list[str]:
        info = self._groups.get(group)
        return sorted(info.members) if info is not None else []

    def group(self, group: str) -> ConsumerGroupInfo | None:
        return self._groups.get(group)

    def groups(self) -> list[str]:
        return sorted(self._groups)


class ProducerManager:
    """producer group -> client id -> (connection, last heartbeat), for transaction checks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._groups: dict[str, dict[str, tuple[Connection, float]]] = {}

    def register(self, group: str, client_id: str, conn: Connection) -> None:
        self._groups.setdefault(group, {})[client_id] = (conn, self._clock())

    def unregister(self, group: str, client_id: str) -> None:
        members = self._groups.get(group)
        if members is not None and members.pop(client_id, None) is not None and not members:
            del self._groups[group]

    def connection_closed(self, conn: Connection) -> None:
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

    def connections(self, group: str) -> list[Connection]:
        """Open connections of the group's producers, most recent heartbeat first."""
        members = sorted(self._groups.get(group, {}).values(), key=lambda m: -m[1])
        return [conn for conn, _ in members if not conn.closed]

    def client_ids(self, group: str) -> list[str]:
        return sorted(self._groups.get(group, {}))


def _str(header: dict[str, Any], name: str) -> str:
    value = header.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"request header field {name!r} must be a non-empty string")
    return value


def _str_list(header: dict[str, Any], name: str) -> list[str]:
    value = header.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BadRequest(f"request header field {name!r} must be a list of names")
    return value


def _consumer_entry(raw: object) -> tuple[str, str, str, dict[str, str]]:
    if not isinstance(raw, dict):
        raise BadRequest("each heartbeat consumer must be a map")
    group = _str(raw, "group")
    model = raw.get("message_model", "CLUSTERING")
    if model not in MESSAGE_MODELS:
        raise BadRequest(f"message_model must be one of {sorted(MESSAGE_MODELS)}, not {model!r}")
    ctype = raw.get("consume_type", "CONCURRENTLY")
    if ctype not in CONSUME_TYPES:
        raise BadRequest(f"consume_type must be one of {sorted(CONSUME_TYPES)}, not {ctype!r}")
    subs = raw.get("subscriptions") or {}
    if not isinstance(subs, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in subs.items()
    ):
        raise BadRequest("subscriptions must map topic names to expressions")
    return group, model, ctype, subs


class ClientGroupHandlers:
    """HEARTBEAT, UNREGISTER_CLIENT, GET_CONSUMER_LIST_BY_GROUP and the expiry scan."""

    def __init__(self, broker: Broker) -> None:
        self.consumers: ConsumerManager = broker.consumers
        self.producers: ProducerManager = broker.producers
        self.topics: TopicManager = broker.topics

    def handlers(self) -> dict[int, Callable[[Connection, Frame], HandlerResult]]:
        return {
            RequestCode.HEARTBEAT: self.heartbeat,
            RequestCode.UNREGISTER_CLIENT: self.unregister,
            RequestCode.GET_CONSUMER_LIST_BY_GROUP: self.consumer_list,
        }

    def _on_close(self, conn: Connection) -> None:
        self.consumers.connection_closed(conn)
        self.producers.connection_closed(conn)

    def heartbeat(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        conn.attributes["client_id"] = h.get("client_id")
        conn.attributes["groups"] = h.get("groups", {})
        consumers = h.get("consumers") or []
        producers = _str_list(h, "producers")
        if not isinstance(consumers, list):
            raise BadRequest("request header field 'consumers' must be a list")
        entries = [_consumer_entry(c) for c in consumers]
        if not entries and not producers:
            return (ResponseCode.SUCCESS, None, b"")
        client_id = _str(h, "client_id")
        for group, model, _, _ in entries:
            if model == "CLUSTERING":
                name = retry_topic(group)
                cfg = self.topics.get(name)
                if cfg is None or not cfg.system:
                    self.topics.create_or_update(name, 1, system=True)
        if not conn.attributes.get(_HOOKED):
            conn.attributes[_HOOKED] = True
            conn.on_close.append(self._on_close)
        for group, model, ctype, subs in entries:
            self.consumers.register(
                group,
                client_id,
                conn,
                message_model=model,
                consume_type=ctype,
                subscriptions=subs,
            )
        for group in producers:
            self.producers.register(group, client_id, conn)
        conn.attributes["consumer_groups"] = [e[0] for e in entries]
        conn.attributes["producer_groups"] = list(producers)
        return (ResponseCode.SUCCESS, None, b"")

    def unregister(self, conn: Connection, frame: Frame) -> Response:
        h = frame.header
        client_id = _str(h, "client_id")
        for group in _str_list(h, "consumer_groups"):
            self.consumers.unregister(group, client_id)
        for group in _str_list(h, "producer_groups"):
            self.producers.unregister(group, client_id)
        return (ResponseCode.SUCCESS, None, b"")

    def consumer_list(self, conn: Connection, frame: Frame) -> Response:
        group = _str(frame.header, "group")
        return (ResponseCode.SUCCESS, {"client_ids": self.consumers.client_ids(group)}, b"")


async def run_expiry_scan(
    consumers: ConsumerManager, producers: ProducerManager, expiry_s: float
) -> None:
    """Every 10 s (a quarter of a shorter expiry) drop members that sent no heartbeat."""
    interval = min(10.0, max(expiry_s / 4, 0.05))
    while True:
        await anyio.sleep(interval)
        consumers.scan_expired(expiry_s)
        producers.scan_expired(expiry_s)
