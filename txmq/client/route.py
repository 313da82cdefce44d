"""Client-side routes: where a topic's queues are, which broker to steer around, and one
connection per broker — the one routing core of every client, alone or in a cluster.

A client is given either a broker's address (the broker answers routes for itself: a
cluster of one broker set) or a list of name servers (``"h1:9876;h2:9876"``, the cluster's
route tables).  Either way a queue is a :class:`MessageQueue` — (topic, broker name, queue
id) — and requests go to the master of the queue's broker set.

Routes are cached for ``ttl`` seconds (RocketMQ refreshes every 30 s) and fetched again
after a failure.  When every name server is down, the routes already known are kept.

A send that waits on a broker set's master (:meth:`RouteTable.watch`) has its route
fetched again after :data:`STALL_AFTER_S`, and every :data:`STALL_POLL_S` while it waits:
once the route names another master, or none, the send stops waiting and is retried there.
A paused or cut-off master answers nothing until the send's own timeout (3 s), and a
failover elects a new one sooner than that.

Fault avoidance (RocketMQ's ``LatencyFaultTolerance``, with RocketMQ 5's table): after each
send the broker set's latency decides how long it is left out of queue selection —
50/100/550/1800/3000/5000/15000 ms give 0/0/2/5/6/10/30 s; a failed send counts as
:data:`FAILURE_LATENCY_MS` (30 s).  When every broker set is left out, the one available
soonest is used anyway.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from txmq.protocol.message import MessageQueue
from txmq.protocol.wire import (
    MASTER_ID,
    PERM_READ,
    PERM_WRITE,
    BrokerData,
    GetClusterInfo,
    GetTopicRoute,
    QueueData,
    Request,
    TopicRoute,
)
from txmq.protocol.wire.base import R
from txmq.protocol.wire.errors import BrokerUnavailable, TopicNotFound, TxmqError
from txmq.transports.port import Remote

__all__ = [
    "FAILURE_LATENCY_MS",
    "LatencyFaultTolerance",
    "MessageQueue",
    "Route",
    "RouteTable",
    "Waiting",
]

log = logging.getLogger("txmq.route")

#: RocketMQ 5's latencyMax (ms) and notAvailableDuration (s) for each of them (RocketMQ 4's
#: 30 s to 600 s left a broker set out of sends for minutes after one slow send — a new
#: SYNC_MASTER's first send waits for its rejoining slave — far beyond a failover's time)
LATENCY_MAX_MS = (50, 100, 550, 1800, 3000, 5000, 15000)
NOT_AVAILABLE_S = (0.0, 0.0, 2.0, 5.0, 6.0, 10.0, 30.0)
#: a failed send counts as this latency: left out for 30 s, then tried again
FAILURE_LATENCY_MS = 15000
#: how often a send waiting out a failover fetches the route again
WAIT_FOR_MASTER_S = 0.1
#: a send whose broker has not answered for this long has its route checked: has the set
#: another master now?  (every STALL_POLL_S, one fetch per topic for every such send)
STALL_AFTER_S = 0.5
STALL_POLL_S = 0.25


@dataclass(eq=False, slots=True)
class Waiting:
    """A request waiting for a broker set's master (see :meth:`RouteTable.watch`)."""

    topic: str
    broker_name: str
    address: str
    since: float
    #: the task that waits (cancelled when it is stopped)
    task: asyncio.Task[Any]
    #: the route named another master (or none) while it waited: it was stopped
    moved: bool = False

    def stopped(self) -> bool:
        """In an ``except CancelledError``: whether the cancellation was this one's stop
        alone (then it is taken back); False: the task itself is being cancelled."""
        return self.moved and self.task.uncancel() == 0


@dataclass(frozen=True)
class Route:
    """A topic's route, digested: its queues in a stable order (broker name, queue id)."""

    topic: str
    #: queues that may be sent to (brokers with write permission and a master)
    write_queues: tuple[MessageQueue, ...]
    #: queues that may be consumed
    read_queues: tuple[MessageQueue, ...]
    #: master address of each broker set
    masters: dict[str, str]
    #: every replica of each broker set, by the id it is registered under (0: the master)
    replicas: dict[str, dict[int, str]] = field(default_factory=dict)
    fetched_at: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, answer: TopicRoute, direct: str | None = None) -> Route:
        """``direct``: the address the client was given (a broker alone answers for
        itself, perhaps under a name its clients do not use to reach it)."""
        masters: dict[str, str] = {}
        replicas: dict[str, dict[int, str]] = {}
        for b in answer.brokers:
            addr = b.addresses.get(MASTER_ID)
            if direct is not None and b.addresses:
                masters[b.broker_name] = direct  # (a slave given directly: it says NOT_MASTER)
                replicas[b.broker_name] = {MASTER_ID: direct}
                continue
            if addr is not None:
                masters[b.broker_name] = addr
            if b.addresses:
                replicas[b.broker_name] = dict(b.addresses)
        write: list[MessageQueue] = []
        read: list[MessageQueue] = []
        topic = answer.topic
        for q in sorted(answer.queues, key=lambda q: q.broker_name):
            name = q.broker_name
            if q.perm & PERM_WRITE and name in masters:
                write += [MessageQueue(topic, name, i) for i in range(q.write_queue_nums)]
            if q.perm & PERM_READ and name in replicas:  # a slave serves reads too
                read += [MessageQueue(topic, name, i) for i in range(q.read_queue_nums)]
        return cls(answer.topic, tuple(write), tuple(read), masters, replicas)

    def expired(self, ttl: float) -> bool:
        return time.monotonic() - self.fetched_at >= ttl


class LatencyFaultTolerance:
    """How long each broker set is left out of queue selection."""

    def __init__(self, enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self._clock = clock
        self._until: dict[str, float] = {}

    def update(self, broker_name: str, latency_ms: float, *, failed: bool = False) -> None:
        if not self.enabled:
            return
        latency = max(latency_ms, FAILURE_LATENCY_MS) if failed else latency_ms
        level = bisect.bisect_right(LATENCY_MAX_MS, latency) - 1
        pause = NOT_AVAILABLE_S[level] if level >= 0 else 0.0
        if pause:
            until = self._clock() + pause
            if until > self._until.get(broker_name, 0.0):
                self._until[broker_name] = until
                # a failure says so in the send's own warning; a send slow enough to leave
                # the set out for 10 s or more (5 s and longer) is worth an operator's look
                severity = logging.INFO if failed else logging.DEBUG
                if not failed and pause >= 10:
                    severity = logging.WARNING
                log.log(
                    severity,
                    "leaving broker %s out of sends for %.0f s (%s)",
                    broker_name,
                    pause,
                    "a send failed" if failed else f"a send took {latency:.0f} ms",
                )
        elif not failed:
            self._until.pop(broker_name, None)

    def forget(self, broker_name: str) -> None:
        self._until.pop(broker_name, None)

    def available(self, broker_name: str) -> bool:
        until = self._until.get(broker_name)
        return until is None or until <= self._clock()

    def soonest(self, brokers: Sequence[str]) -> str:
        """Of ``brokers``, the one left out for the shortest time."""
        return min(brokers, key=lambda b: self._until.get(b, 0.0))


class RouteTable:
    """One client's routes and broker connections.

    ``connect(address)`` makes the :class:`Remote` for a broker or name server
    (the client gives them its handler, hooks and task group).
    """

    def __init__(
        self,
        *,
        broker: str | None,
        namesrv: Sequence[str],
        connect: Callable[[str], Remote],
        ttl: float = 30.0,
        request_timeout: float = 3.0,
    ) -> None:
        if (broker is None) == (not namesrv):
            raise ValueError("give a broker address or a name-server list (exactly one)")
        self.direct = broker
        self.namesrv = list(namesrv)
        random.shuffle(self.namesrv)  # spread clients over name servers, then stick
        self.ttl = ttl
        self.request_timeout = request_timeout
        self._connect = connect
        self._remotes: dict[str, Remote] = {}
        self._routes: dict[str, Route] = {}
        self._stale: set[str] = set()
        self._seen: dict[str, tuple[MessageQueue, ...]] = {}
        #: the master of each broker set, as the newest route fetched says (a dict lookup
        #: per request, however many topics the client knows), and all its replicas
        self._masters: dict[str, str] = {}
        self._replicas: dict[str, dict[int, str]] = {}
        #: the master each broker set had when a route last named one (kept while a set has
        #: none: a different one named later is a failover's new master)
        self._named: dict[str, str] = {}
        self.faults = LatencyFaultTolerance()
        self._waiting: set[Waiting] = set()
        #: see STALL_AFTER_S (None: a request waits for its own timeout)
        self.stall_after_s: float | None = STALL_AFTER_S

    # -- connections -----------------------------------------------------------------------

    def remote(self, address: str) -> Remote:
        r = self._remotes.get(address)
        if r is None:
            r = self._remotes[address] = self._connect(address)
        return r

    def remotes(self) -> list[Remote]:
        return list(self._remotes.values())

    # -- routes ----------------------------------------------------------------------------

    def cached(self, topic: str) -> Route | None:
        return self._routes.get(topic)

    def failed(self, mq: MessageQueue, *, unreachable: bool = False) -> None:
        """A request to ``mq``'s broker set failed: fetch the topic's route again before
        its next use (its master may have changed).  ``unreachable``: no connection could
        be made to its master (the process is gone): until a route says otherwise the set
        has no master here, so that sends wait for a new one rather than try it again."""
        route = self._routes.get(mq.topic)
        if route is None:
            return
        route = dataclasses.replace(route, fetched_at=-math.inf)
        name = mq.broker_name
        gone = route.masters.get(name)
        if unreachable and gone is not None:
            replicas = {i: a for i, a in route.replicas.get(name, {}).items() if a != gone}
            route = dataclasses.replace(
                route,
                write_queues=tuple(q for q in route.write_queues if q.broker_name != name),
                masters={n: a for n, a in route.masters.items() if n != name},
                replicas={**route.replicas, name: replicas},
            )
            if self._masters.get(name) == gone:
                del self._masters[name]
        self._routes[mq.topic] = route

    async def route(self, topic: str, *, create: bool = False, refresh: bool = False) -> Route:
        """The topic's route (fetched when not cached, older than ``ttl`` or ``refresh``)."""
        cached = self._routes.get(topic)
        if cached is not None and not refresh and not cached.expired(self.ttl):
            return cached
        try:
            answer = await self._fetch(topic, create)
        except TopicNotFound:
            self._routes.pop(topic, None)
            raise
        except TxmqError as exc:
            if cached is None:
                raise
            if topic not in self._stale:  # once per outage, not at every refresh
                self._stale.add(topic)
                log.warning(
                    "refreshing the route of %s failed (%s); keeping the one known", topic, exc
                )
            return cached
        if topic in self._stale:
            self._stale.discard(topic)
            log.info("the route of %s is fresh again", topic)
        route = Route.of(answer, self.direct)
        if not route.write_queues and not route.read_queues:
            raise TopicNotFound(f"topic {topic!r} has no queue on any live broker")
        self._routes[topic] = route
        for name, address in route.masters.items():
            if self._named.get(name, address) != address:
                self.faults.forget(name)  # a new master (a failover): nothing against it yet
            self._named[name] = address
        self._masters.update(route.masters)
        for name in route.replicas.keys() - route.masters.keys():
            self._masters.pop(name, None)  # a set without a master now (failing over)
        self._replicas.update(route.replicas)
        return route

    def watch(self, mq: MessageQueue, address: str) -> Waiting:
        """Watch the current task's request to ``address``, the master of ``mq``'s broker
        set, until :meth:`unwatch`: while it waits, :meth:`watch_stalls` cancels the task
        (and sets ``moved``) when a fresh route names another master; the caller catches
        that ``CancelledError`` and asks :meth:`Waiting.stopped`.  (A task cancellation, as
        asyncio.timeout does it: an anyio cancel scope per send cost 4-5 us.)"""
        task = asyncio.current_task()
        assert task is not None
        waiting = Waiting(mq.topic, mq.broker_name, address, time.monotonic(), task)
        self._waiting.add(waiting)
        return waiting

    def unwatch(self, waiting: Waiting) -> None:
        self._waiting.discard(waiting)

    async def watch_stalls(self) -> None:
        """Stop the watched requests whose broker set's master changed (runs until
        cancelled, in the client's task group)."""
        while True:
            await anyio.sleep(STALL_POLL_S)
            now, after = time.monotonic(), self.stall_after_s or 0.0
            stalled = [w for w in self._waiting if now - w.since >= after]
            for topic in {w.topic for w in stalled}:
                try:
                    route = await self.route(topic, refresh=True)
                except TxmqError:
                    continue  # no name server answers: the request's own timeout decides
                moved = [
                    w
                    for w in stalled
                    if w.topic == topic
                    and not w.moved
                    and route.masters.get(w.broker_name) != w.address
                ]
                for address in {w.address for w in moved}:
                    names = {w.broker_name for w in moved if w.address == address}
                    log.info(
                        "%d send(s) of %s waiting on %s are sent again: the route names %s "
                        "as the master of %s now",
                        sum(w.address == address for w in moved),
                        topic,
                        address,
                        " / ".join(sorted(route.masters.get(n, "no broker") for n in names)),
                        " / ".join(sorted(names)),
                    )
                for w in moved:
                    w.moved = True
                    w.task.cancel()

    async def writable(
        self, topic: str, wait_s: float, *, create: bool = False, refresh: bool = False
    ) -> Route:
        """The topic's route with a queue to send to (``refresh``: fetched anew first).
        While every broker set holding it has replicas but no master (a failover under
        way) the route is fetched again and again for up to ``wait_s``; then
        :class:`BrokerUnavailable` (retriable)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                route = await self.route(topic, create=create, refresh=refresh)
            except BrokerUnavailable:  # e.g. a new topic while its broker set has no master
                if time.monotonic() >= deadline:
                    raise
            else:
                if route.write_queues or not route.read_queues:
                    return route
                if time.monotonic() >= deadline:
                    raise BrokerUnavailable(
                        f"no broker set of {topic} has a master now "
                        f"({', '.join(route.replicas)}: a failover may be under way); send again"
                    )
            await anyio.sleep(WAIT_FOR_MASTER_S)
            refresh = True

    async def _fetch(self, topic: str, create: bool) -> TopicRoute:
        request = GetTopicRoute(topic=topic, create=create)
        if self.direct is not None:
            remote = self.remote(self.direct)
            return (await remote.call(request, timeout=self.request_timeout)).header
        try:
            return await self.ask_namesrv(request)
        except TopicNotFound:
            if not create:
                raise
        return await self._create(topic)

    async def ask_namesrv(self, request: Request[R]) -> R:
        """The answer of the first name server that answers (and stick with it)."""
        errors: list[str] = []
        for i, address in enumerate(list(self.namesrv)):
            try:
                answer = await self.remote(address).call(request, timeout=self.request_timeout)
            except TxmqError as exc:
                if not exc.retriable:  # about the request (no such topic), not the server
                    raise
                errors.append(f"{address}: {exc}")
                continue
            if i:
                self.namesrv.insert(0, self.namesrv.pop(i))
            return answer.header
        raise BrokerUnavailable("no name server answered: " + "; ".join(errors))

    async def _create(self, topic: str) -> TopicRoute:
        """A topic no broker has yet, sent to: each broker set of the cluster that creates
        topics on first use does (RocketMQ routes such sends by its default topic,
        TBW102); the route is what they answer (they register it with the name servers
        at once)."""
        cluster = await self.ask_namesrv(GetClusterInfo())
        queues: list[QueueData] = []
        brokers: list[BrokerData] = []
        refused: list[str] = []
        masterless: list[str] = []
        for b in cluster.brokers:
            master = b.addresses.get(MASTER_ID)
            if master is None:
                masterless.append(b.broker_name)
                continue
            try:
                answer = await self.remote(master).call(
                    GetTopicRoute(topic=topic, create=True), timeout=self.request_timeout
                )
            except TxmqError as exc:
                refused.append(f"{b.broker_name}: {exc}")
                continue
            queues += answer.header.queues
            brokers += [BrokerData(cluster=d.cluster, broker_name=d.broker_name,
                                   addresses={**d.addresses, MASTER_ID: master})
                        for d in answer.header.brokers]  # fmt: skip
        if not queues and masterless:
            raise BrokerUnavailable(
                f"topic {topic!r} is not known yet and broker set(s) {', '.join(masterless)} "
                "have no master now (a failover may be under way)"
            )
        if not queues:
            why = "; ".join(refused) or "the name servers know no broker"
            raise TopicNotFound(f"topic {topic!r} does not exist and no broker created it ({why})")
        return TopicRoute(topic=topic, queues=queues, brokers=brokers)

    def seen_queues(self, route: Route) -> tuple[MessageQueue, ...]:
        """Every write queue of the topic this client has seen in its routes (the current
        ones and those of broker sets since lost), in route order."""
        seen = self._seen.get(route.topic, ())
        if not set(route.write_queues) <= set(seen):
            seen = tuple(sorted(set(seen) | set(route.write_queues)))
            self._seen[route.topic] = seen
        return seen

    def master(self, route: Route, broker_name: str) -> str:
        address = route.masters.get(broker_name)
        if address is None:
            raise BrokerUnavailable(
                f"broker {broker_name!r} has no master in the route of {route.topic}"
            )
        return address

    def address_of(self, broker_name: str | None) -> str:
        """The master address of a broker set known from any route; ``None``: the broker
        a client was given directly."""
        if broker_name is None:
            if self.direct is None:
                raise ValueError("which broker? (a client of name servers must name one)")
            return self.direct
        address = self._masters.get(broker_name)
        if address is not None:
            return address
        if self.direct is not None:
            return self.direct
        if broker_name in self._replicas:
            raise BrokerUnavailable(
                f"broker set {broker_name!r} has no master now (a failover may be under way)"
            )
        raise BrokerUnavailable(f"broker {broker_name!r} is in no route this client knows")

    def read_address(self, broker_name: str | None, *, slave: bool = False) -> str:
        """Where to read from broker set ``broker_name``: its master, or (``slave``: the
        master's advice, or no master now) one of its slaves — the lowest id, so that a
        group's members meet on one."""
        if broker_name is None or self.direct is not None:
            return self.address_of(broker_name)
        master = self._masters.get(broker_name)
        if master is not None and not slave:
            return master
        slaves = sorted(
            (i, a) for i, a in self._replicas.get(broker_name, {}).items() if i != MASTER_ID
        )
        if slaves:
            return slaves[0][1]
        return self.address_of(broker_name)

    def known_addresses(self) -> set[str]:
        """Every broker address of the routes this client knows now."""
        out = set(self._masters.values())
        for replicas in self._replicas.values():
            out.update(replicas.values())
        return out

    def replica_addresses(self, route: Route) -> list[str]:
        """Every replica of every broker set of ``route`` (a consumer heartbeats them all,
        so that a slave it reads from while the master is away knows the group)."""
        return sorted({a for replicas in route.replicas.values() for a in replicas.values()})

    # -- choosing a queue to send to ------------------------------------------------------

    def pick(self, route: Route, index: int, avoid: str | None = None) -> MessageQueue:
        """A write queue, round robin from ``index``: the first whose broker set is not
        left out (nor ``avoid``, the one that just failed), else the least bad one."""
        queues = route.write_queues
        if not queues and route.read_queues:
            raise BrokerUnavailable(
                f"no broker set of {route.topic} has a master now (a failover may be under way)"
            )
        if not queues:
            raise TopicNotFound(f"topic {route.topic!r} has no writable queue")
        n = len(queues)
        for i in range(n):
            mq = queues[(index + i) % n]
            if mq.broker_name != avoid and self.faults.available(mq.broker_name):
                return mq
        others = [mq.broker_name for mq in queues if mq.broker_name != avoid] or [avoid or ""]
        best = self.faults.soonest(others)
        candidates = [mq for mq in queues if mq.broker_name == best] or list(queues)
        return candidates[index % len(candidates)]
