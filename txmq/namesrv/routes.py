"""The route table a name server keeps in memory: which brokers are registered, in which
cluster and broker set, at which address, holding which topics, and when each was last
heard from.

Everything is rebuilt from the brokers' registrations (every 30 s each): a name server
that restarts, or another one beside it, learns the same table within one registration
interval.  The table is used from one event loop (no locks); tests give it a clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from txmq.protocol.message import validate_topic_name
from txmq.protocol.peer import parse_address
from txmq.protocol.wire import (
    MASTER_ID,
    BrokerData,
    ClusterInfo,
    QueueData,
    RegisterBroker,
    Registered,
    TopicConfigData,
    TopicRoute,
    UnregisterBroker,
)
from txmq.protocol.wire.errors import BadRequest, InvalidTopic, TopicNotFound

__all__ = ["BrokerKey", "LiveBroker", "RouteTable"]

log = logging.getLogger("txmq.namesrv")

#: a broker: (broker name, broker id) — its broker set and its place in it (0: the master)
BrokerKey = tuple[str, int]

_BAD_NAME_CHARS = "/\\;:% \t\n"


@dataclass(slots=True)
class LiveBroker:
    """One registered broker, as its latest registration described it."""

    cluster: str
    broker_name: str
    broker_id: int
    address: str
    ha_address: str
    data_version: int
    topics: dict[str, TopicConfigData]
    #: when it last registered (the table's clock, monotonic)
    last_seen: float
    #: the connection its latest registration came on (None: not known, as in unit tests)
    conn: object | None = field(default=None, repr=False)
    #: the broker set's epoch it registered with
    epoch: int = 0
    #: its RocketMQ 5 gRPC endpoint ("": none)
    grpc_address: str = ""

    def describe(self) -> str:
        return (
            f"broker {self.broker_name} (id {self.broker_id}, cluster {self.cluster}) "
            f"at {self.address}"
        )


class RouteTable:
    """Registered brokers and the routes they make.  ``expiry``: how long a broker may stay
    silent before :meth:`expire` drops it."""

    def __init__(self, *, expiry: float = 120.0, clock: Callable[[], float] = time.monotonic):
        self.expiry = expiry
        self._clock = clock
        self._brokers: dict[BrokerKey, LiveBroker] = {}
        #: topic -> the brokers holding it
        self._by_topic: dict[str, set[BrokerKey]] = {}
        #: what a controller in this process says of a broker set before its brokers
        #: register it: (the master it elected, None while it elects; the epoch)
        self._elected: dict[str, tuple[str | None, int]] = {}

    # -- what brokers tell ------------------------------------------------------------------

    def register(self, req: RegisterBroker, conn: object | None = None) -> Registered:
        """A broker's registration: new, a heartbeat (same ``data_version``: only its time
        and connection are taken), or a new topic table (any other version)."""
        _check_registration(req)
        key = (req.broker_name, req.broker_id)
        now = self._clock()
        for other_key, other in list(self._brokers.items()):
            if other_key != key and other.address == req.address:
                # one address serves one broker: it now says it is another one (a restart
                # under another name, a slave that became the master)
                log.info(
                    "%s now registers as broker %s (id %d); dropping the old entry",
                    other.describe(),
                    req.broker_name,
                    req.broker_id,
                )
                self._remove(other_key)
        old = self._brokers.get(key)
        if old is not None and old.address != req.address:
            if req.epoch <= old.epoch and now - old.last_seen <= self.expiry:
                # two live brokers under one name and id would take turns in the routes
                # (and mix their consumers' offsets): the one registered first keeps it
                raise BadRequest(
                    f"broker {req.broker_name} (id {req.broker_id}) is already registered "
                    f"at {old.address} by a live broker: give this one ({req.address}) its "
                    "own --broker-name or --broker-id, or stop the other"
                )
            log.warning(
                "broker %s (id %d, cluster %s) registered from %s (epoch %d), but it is "
                "registered at %s (epoch %d, silent for %.0f s): taking the newer registration",
                req.broker_name,
                req.broker_id,
                req.cluster,
                req.address,
                req.epoch,
                old.address,
                old.epoch,
                now - old.last_seen,
            )
            old = None
        if old is not None and old.data_version == req.data_version and old.cluster == req.cluster:
            old.last_seen = now
            old.ha_address = req.ha_address
            old.grpc_address = req.grpc_address
            old.epoch = req.epoch
            if conn is not None:
                old.conn = conn
        else:
            entry = LiveBroker(
                cluster=req.cluster,
                broker_name=req.broker_name,
                broker_id=req.broker_id,
                address=req.address,
                ha_address=req.ha_address,
                data_version=req.data_version,
                topics={t.name: t for t in req.topics},
                last_seen=now,
                conn=conn,
                epoch=req.epoch,
                grpc_address=req.grpc_address,
            )
            self._put(key, entry)
            if old is None:
                log.info("%s registered, %d topic(s)", entry.describe(), len(entry.topics))
            else:
                log.debug("%s now has %d topic(s)", entry.describe(), len(entry.topics))
        master = self._brokers.get((req.broker_name, MASTER_ID))
        if req.broker_id != MASTER_ID and master is not None:
            return Registered(master_address=master.address, ha_address=master.ha_address)
        return Registered()

    def unregister(self, req: UnregisterBroker) -> bool:
        """A broker's clean stop.  Ignored (False) if that broker is registered at another
        address now (a newer registration)."""
        key = (req.broker_name, req.broker_id)
        entry = self._brokers.get(key)
        if entry is None or entry.address != req.address:
            return False
        self._remove(key)
        log.info("%s unregistered", entry.describe())
        return True

    def connection_closed(self, conn: object) -> list[LiveBroker]:
        """Drop the brokers whose latest registration came on ``conn`` (RocketMQ's
        BrokerHousekeepingService: a broker's channel closing drops it at once; a broker
        registered again on another connection stays)."""
        gone = [b for b in self._brokers.values() if b.conn is conn]
        for entry in gone:
            self._remove((entry.broker_name, entry.broker_id))
            log.warning("%s: its connection closed; dropped from the routes", entry.describe())
        return gone

    def expire(self) -> list[LiveBroker]:
        """Drop every broker silent for longer than :attr:`expiry`; one line each."""
        now = self._clock()
        gone = [b for b in self._brokers.values() if now - b.last_seen > self.expiry]
        for entry in gone:
            self._remove((entry.broker_name, entry.broker_id))
            log.warning(
                "%s: not heard from for %.0f s (more than %g s); dropped from the routes",
                entry.describe(),
                now - entry.last_seen,
                self.expiry,
            )
        return gone

    def elected(self, broker_name: str, address: str | None, epoch: int) -> None:
        """A controller in this process elects a master for ``broker_name`` in ``epoch``
        (``address``: the winner, None while it elects): routes name no master for the set
        until a broker registers as its master in ``epoch`` or later — clients stop sending
        to a fenced master and wait for the new one, which registers as soon as it is told
        (a winner named before it knows would answer NOT_MASTER)."""
        self._elected[broker_name] = (address, epoch)

    def election_abandoned(self, broker_name: str) -> None:
        """The election ended with no new master (the old one goes on)."""
        self._elected.pop(broker_name, None)

    # -- what clients ask -------------------------------------------------------------------

    def route(self, topic: str) -> TopicRoute:
        """``topic``'s queues on every broker set that holds it, and those sets' brokers."""
        why = validate_topic_name(topic)
        if why:
            raise InvalidTopic(why)
        queues: list[QueueData] = []
        brokers: list[BrokerData] = []
        for name in sorted({name for name, _ in self._by_topic.get(topic, ())}):
            source = self._source(name)
            cfg = source.topics.get(topic) if source is not None else None
            if source is None or cfg is None:
                continue  # the set's master does not hold it (only a slave still does)
            queues.append(
                QueueData(
                    broker_name=name,
                    read_queue_nums=cfg.read_queue_nums,
                    write_queue_nums=cfg.write_queue_nums,
                    perm=cfg.perm,
                )
            )
            brokers.append(self._broker_data(name, source))
        if not queues:
            raise TopicNotFound(f"no broker registered topic {topic!r} with this name server")
        return TopicRoute(topic=topic, queues=queues, brokers=brokers)

    def cluster_info(self) -> ClusterInfo:
        names = sorted({name for name, _ in self._brokers})
        brokers = []
        clusters: dict[str, list[str]] = {}
        for name in names:
            source = self._source(name)
            assert source is not None
            brokers.append(self._broker_data(name, source))
            clusters.setdefault(source.cluster, []).append(name)
        return ClusterInfo(brokers=brokers, clusters=clusters)

    def brokers(self) -> list[LiveBroker]:
        return [self._brokers[k] for k in sorted(self._brokers)]

    def topics(self) -> list[str]:
        return sorted(self._by_topic)

    # -- the table --------------------------------------------------------------------------

    def _source(self, name: str) -> LiveBroker | None:
        """The broker whose topics speak for set ``name``: its master, else its lowest id."""
        members = [b for (n, _), b in self._brokers.items() if n == name]
        return min(members, key=lambda b: b.broker_id, default=None)

    def _broker_data(self, name: str, source: LiveBroker) -> BrokerData:
        members = {i: b for (n, i), b in sorted(self._brokers.items()) if n == name}
        said = self._elected.get(name)
        if said is not None:
            _, epoch = said
            master = members.get(MASTER_ID)
            if master is not None and master.epoch >= epoch:
                del self._elected[name]  # the set's master registered: the table knows
            else:
                members.pop(MASTER_ID, None)  # fenced, or deposed
        return BrokerData(
            cluster=source.cluster,
            broker_name=name,
            addresses={i: b.address for i, b in sorted(members.items())},
            grpc_addresses={
                i: b.grpc_address for i, b in sorted(members.items()) if b.grpc_address
            },
        )

    def _put(self, key: BrokerKey, entry: LiveBroker) -> None:
        if key in self._brokers:
            self._remove(key)
        self._brokers[key] = entry
        for topic in entry.topics:
            self._by_topic.setdefault(topic, set()).add(key)

    def _remove(self, key: BrokerKey) -> None:
        entry = self._brokers.pop(key)
        for topic in entry.topics:
            holders = self._by_topic.get(topic)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._by_topic[topic]


def _check_registration(req: RegisterBroker) -> None:
    """What the typed header cannot say: names, addresses and topics that make sense."""
    for what, value in (("cluster", req.cluster), ("broker_name", req.broker_name)):
        if any(c in value for c in _BAD_NAME_CHARS):
            raise BadRequest(
                f"RegisterBroker: header field {what!r}: {value!r} has a space, '/', ';', "
                "':' or '%'"
            )
    for what, address in (
        ("address", req.address),
        ("ha_address", req.ha_address),
        ("grpc_address", req.grpc_address),
    ):
        if what != "address" and not address:
            continue
        try:
            parse_address(address)
        except ValueError:
            raise BadRequest(
                f"RegisterBroker: header field {what!r}: {address!r} is not HOST:PORT"
            ) from None
    for i, topic in enumerate(req.topics):
        why = validate_topic_name(topic.name)
        if why:
            raise BadRequest(f"RegisterBroker: header field 'topics[{i}].name': {why}")
