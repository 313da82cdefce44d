"""The controller: elects each broker set's master (RocketMQ 5's controller mode).

Brokers started with ``--controller`` heartbeat to it every
``controller_heartbeat_interval_s`` (0.5 s) with their log's end, the newest epoch their log
has, and whether they act as master or follow one.  The answer tells each its set's master,
epoch and *sync state set* (the slaves whose confirmations count for SYNC_MASTER; the master
proposes it in its heartbeats, the controller saves it).

**Leases.**  A master acknowledges a write that no in-sync slave confirmed (ASYNC_MASTER, or
SYNC_MASTER's FLUSH_SLAVE_TIMEOUT / SLAVE_NOT_AVAILABLE answers) only while its lease runs:
``lease_s`` (1.5 s) from when it sent a heartbeat the controller answered, or from when it
sent the answer an in-sync slave's next request confirmed.  A master whose sync state set
holds no slave needs no lease: nobody else could be elected.  So a controller that is down
only pauses elections; the masters go on.

**Elections.**  A set's master is replaced when its connection to the controller closes
and it does not come back within ``reconnect_grace_s``, when it is silent for
``heartbeat_timeout_s`` (2 s), or when it restarted (it reports no role).  First every
replica is *fenced*: its answers say ``electing``, a master stops acknowledging and a slave
stops copying, and each reports so.  Then:

* the old master reported it stopped: its log is final — the replica whose log reaches
  furthest (on the newest epoch) wins, the old master included;
* the old master is unreachable: every slave of the sync state set must report it stopped,
  and the old master's lease must have run out (by the controller's answers and by what
  each slave says of when the master last answered it).  Every write the old master
  acknowledged as SEND_OK was confirmed by one of these slaves, and their logs are prefixes
  of its log, so the furthest one holds them all.  A set whose sync state set has no slave
  waits for its master to come back (losing one machine loses no acknowledged message).
  The wait for a slave that does not report has no end of its own: after
  ``WAIT_WARNING_S`` the controller says so in an ERROR line, and an operator may end it
  (``txmq admin switchover --force``: elect among the slaves that reported, accepting the
  loss of what only the silent one may hold), or ``unclean_election_after_s`` ends it
  after that long (RocketMQ's enableElectUncleanMaster; off by default);
* the master acknowledged only writes every in-sync slave had (``all_ack``, RocketMQ 5's
  allAckInSyncStateSet, as its heartbeats in this epoch said): any in-sync slave that
  reported will do — they all hold every SEND_OK write (and once one stopped copying the
  old master can acknowledge nothing as SEND_OK) —, once the lease ran out.

The winner's epoch is one more than the set's; the new sync state set is the slaves whose
logs end where the winner's does.  A planned switchover (``txmq admin switchover``) fences
the master only, lets the target copy the rest, and then hands over.

The state (epoch, master, sync state set, history) is saved in
``<controller store>/controller.json`` before anyone is told: a restarted controller goes on
from it.  README "Replication" says how to run it.

**On etcd** (``--etcd``, :mod:`txmq.namesrv.etcd`), any number of controllers run; the one
that holds the etcd election leads and the state lives in etcd, written only in a
transaction conditioned on that leader's own election key.  An answer waits until the
state it tells is saved; a write refused (this controller was deposed) tells no one, and
the controller follows.  A follower answers heartbeats with the leader's address
(``follower``, ``leader``) and other requests with :class:`ControllerNotLeader`.  A new
leader reads the sets from etcd and gives each master a fresh ``heartbeat_timeout_s``
before judging it, as a restarted controller does; a master's lease, granted by the old
leader, has run out by then (the old leader stopped granting when its own etcd lease could
have expired, before another could take over).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from txmq.protocol.rpc import Call, Router
from txmq.protocol.wire import (
    BrokerSetState,
    ControllerAnswer,
    ControllerHeartbeat,
    ElectMaster,
    GetReplicaInfo,
    ReplicaInfo,
    ReplicaState,
)
from txmq.protocol.wire.errors import BadRequest, ControllerNotLeader, TxmqError
from txmq.server.jsonfile import load_json, write_json_atomic

if TYPE_CHECKING:
    from txmq.namesrv.etcd import EtcdLeadership

__all__ = ["Controller", "ControllerTimings", "NoCandidate"]

log = logging.getLogger("txmq.controller")

#: the epoch of a replica's log that never had an election (broker/ha/epochs.py)
FIRST_EPOCH = 1
#: a replica reports every 0.5 s: after this long, every live one has once more
REPORT_AFTER_S = 0.7
#: how long a master that stops cleanly waits for its successor to catch up
HANDOVER_S = 5.0
#: marks a connection whose closing the controller is told about
_HOOKED = "controller.hooked"
#: how long a failover may wait for in-sync slaves that do not report before an ERROR says
#: what an operator can do
WAIT_WARNING_S = 10.0


class NoCandidate(TxmqError):
    """No replica may be made master now."""

    retriable = True


@dataclass(frozen=True, slots=True)
class ControllerTimings:
    heartbeat_timeout_s: float = 2.0
    lease_s: float = 1.5
    scan_interval_s: float = 0.1
    #: a master whose connection closed gets this long to heartbeat again
    reconnect_grace_s: float = 0.6
    #: under one ack: a failover waiting this long for in-sync slaves that do not report
    #: elects among those that did, as ``switchover --force`` does (0: never by itself;
    #: RocketMQ's enableElectUncleanMaster)
    unclean_election_after_s: float = 0.0

    def check(self) -> None:
        if not 0 < self.lease_s < self.heartbeat_timeout_s:
            raise ValueError("the lease must be positive and shorter than the heartbeat time-out")
        if not (self.scan_interval_s > 0 and self.reconnect_grace_s >= 0):
            raise ValueError("scan_interval_s must be positive, reconnect_grace_s not negative")
        if self.unclean_election_after_s < 0:
            raise ValueError("unclean_election_after_s must not be negative (0: never)")


@dataclass(slots=True)
class _Replica:
    broker_id: int
    address: str
    ha_address: str
    offset: int
    epoch: int
    last_seen: float
    master: bool = False
    following: bool = False
    conn: object | None = None
    #: in the election under way: when it first reported that it stopped (0: not yet), and
    #: until when the old master's lease from its confirmations may run
    fenced_at: float = 0.0
    lease_bound: float = 0.0

    @property
    def stopped(self) -> bool:
        """Neither acknowledging nor copying: its log's end is final."""
        return not self.master and not self.following


class _SavedSet(msgspec.Struct):
    cluster: str
    epoch: int = 0
    master_id: int = -1
    in_sync: list[int] = []
    history: list[tuple[int, int]] = []


class _Saved(msgspec.Struct):
    sets: dict[str, _SavedSet] = {}


@dataclass(slots=True)
class _Election:
    reason: str
    since: float
    old_master: int
    #: a switchover's target (-1: a failover, the best replica wins)
    target: int = -1
    deadline: float = 0.0
    waiting: str = ""
    #: an operator ended the wait for silent in-sync slaves (ElectMaster force)
    forced: bool = False
    warned: bool = False


@dataclass(slots=True)
class _Set:
    cluster: str
    name: str
    epoch: int = 0
    master_id: int = -1
    in_sync: list[int] = field(default_factory=list)
    history: list[tuple[int, int]] = field(default_factory=list)
    replicas: dict[int, _Replica] = field(default_factory=dict)
    #: when the master was last heard from (the controller's start for a saved master)
    master_seen: float = 0.0
    #: the master has said it acts as master in this epoch
    confirmed: bool = False
    #: when the master's connection closed (0: it did not)
    conn_lost_at: float = 0.0
    election: _Election | None = None
    #: this epoch's master acknowledges only writes every in-sync slave has (its heartbeats
    #: say so; False until it did, and after a restart of the controller)
    all_ack: bool = False
    #: read from saved state (a restarted controller, a new leader on etcd), its master not
    #: heard by this controller since
    inherited: bool = False
    #: the latest moment a lease granted to the master may run to (this controller's
    #: answers; for a set taken over, its predecessor's)
    granted_until: float = 0.0


class Controller:
    def __init__(
        self,
        store: Path | None,
        timings: ControllerTimings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        leadership: EtcdLeadership | None = None,
    ) -> None:
        """``store``: the folder of ``controller.json`` (None with ``leadership``: the
        state lives in etcd)."""
        self.timings = timings or ControllerTimings()
        self.timings.check()
        self._clock = clock
        self.leadership = leadership
        self.path = store / "controller.json" if store is not None else None
        self.sets: dict[str, _Set] = {}
        if leadership is None:
            if store is None:
                raise ValueError("a controller needs a store folder or etcd")
            store.mkdir(parents=True, exist_ok=True)
            self.sets = self._sets_from(load_json(store / "controller.json", _Saved).sets)
        #: on etcd: the state's version in memory, and the newest one saved in etcd
        self._version = self._saved = 0
        self._save_wanted = anyio.Event()
        self._save_done = anyio.Event()
        self.router = Router("the controller")
        self.route(self.router)
        #: told of each election: (broker set, the master elected — None while it runs —,
        #: its epoch); a name server in the same process updates its routes at once
        self.on_elect: list[Callable[[str, str | None, int], None]] = []
        #: told when an election ends with no new master (a switchover abandoned)
        self.on_abandon: list[Callable[[str], None]] = []

    def _sets_from(
        self, saved: dict[str, _SavedSet], leases_left_s: float | None = None
    ) -> dict[str, _Set]:
        """The saved sets, their masters not heard yet; a lease granted to one before may
        run ``leases_left_s`` more (None: ``lease_s``, as after a restart)."""
        now = self._clock()
        left = self.timings.lease_s if leases_left_s is None else leases_left_s
        return {
            name: _Set(
                s.cluster, name, s.epoch, s.master_id, list(s.in_sync), list(s.history),
                master_seen=now, inherited=True, granted_until=now + left,
            )
            for name, s in saved.items()
        }  # fmt: skip

    @property
    def where(self) -> str:
        """Where the state is kept, for the logs."""
        if self.leadership is not None:
            return "etcd " + ",".join(self.leadership.endpoints)
        assert self.path is not None
        return str(self.path.parent)

    @property
    def leading(self) -> bool:
        return self.leadership is None or self.leadership.leading

    def route(self, router: Router) -> None:
        if self.leadership is None:
            router.route(ControllerHeartbeat, self.heartbeat)
            router.route(GetReplicaInfo, self.replica_info)
        else:
            router.route(ControllerHeartbeat, self._heartbeat_led)
            router.route(GetReplicaInfo, self._replica_info_led)
        router.route(ElectMaster, self.elect_master)

    # -- on etcd: only the leader answers, once what it tells is saved ----------------------

    async def _heartbeat_led(self, req: ControllerHeartbeat, call: Call | None) -> ControllerAnswer:
        if not self.leading:
            return self._follower_answer()
        answer = self.heartbeat(req, call)
        if not await self._saved_through(self._version):
            return self._follower_answer()
        return answer

    def _replica_info_led(self, req: GetReplicaInfo, call: Call | None) -> ReplicaInfo:
        self._check_leading()
        return self.replica_info(req, call)

    def _follower_answer(self) -> ControllerAnswer:
        leader = self.leadership.leader_address if self.leadership is not None else ""
        return ControllerAnswer(epoch=0, follower=True, leader=leader)

    def _check_leading(self) -> None:
        if not self.leading:
            leader = self.leadership.leader_address if self.leadership is not None else ""
            said = f"the leader is at {leader}" if leader else "none leads now"
            raise ControllerNotLeader(f"this controller does not lead ({said})")

    async def _saved_through(self, version: int) -> bool:
        """Until the state of ``version`` is in etcd; False if this controller stopped
        leading first (nothing of it may be told)."""
        while self._saved < version:
            if not self.leading:
                return False
            done = self._save_done
            self._save_wanted.set()
            await done.wait()
        return self.leading

    async def _writer(self) -> None:
        """Save the state in etcd whenever it changed (one write for all changes since)."""
        from txmq.namesrv.etcd import Deposed

        assert self.leadership is not None
        while True:
            await self._save_wanted.wait()
            self._save_wanted = anyio.Event()
            version = self._version
            if version > self._saved and self.leading:
                entries = {
                    n: msgspec.json.encode(_SavedSet(s.cluster, s.epoch, s.master_id, s.in_sync,
                                                     s.history))
                    for n, s in self.sets.items()
                }  # fmt: skip
                try:
                    await self.leadership.save(entries)
                except Deposed as exc:
                    log.warning("controller: %s; following", exc)
                    self._follow("")
                else:
                    self._saved = max(self._saved, version)
            done, self._save_done = self._save_done, anyio.Event()
            done.set()

    def _lead(self, saved: dict[str, bytes]) -> None:
        sets = {name: msgspec.json.decode(raw, type=_SavedSet) for name, raw in saved.items()}
        # every lease the previous leader granted ended with its leadership (see _answer),
        # which ended before etcd let this controller take over
        self.sets = self._sets_from(sets, leases_left_s=0.0)
        self._version = self._saved = 0
        for s in self.sets.values():
            log.info(
                "broker set %s: epoch %d, master %d, in sync %s (from etcd)",
                s.name, s.epoch, s.master_id, s.in_sync or "none",
            )  # fmt: skip

    def _follow(self, leader: str) -> None:
        if self.sets:
            log.warning(
                "controller follows%s; its broker sets are the leader's now",
                f" {leader}" if leader else "",
            )
        self.sets = {}
        done, self._save_done = self._save_done, anyio.Event()
        done.set()  # answers waiting for a save: this controller tells nothing now

    # -- requests -------------------------------------------------------------------------

    def heartbeat(self, req: ControllerHeartbeat, call: Call | None) -> ControllerAnswer:
        now = self._clock()
        s = self.sets.get(req.broker_name)
        if s is None:
            s = self.sets[req.broker_name] = _Set(req.cluster, req.broker_name, master_seen=now)
        conn = call.conn if call is not None else None
        if conn is not None and not conn.attributes.get(_HOOKED):
            conn.attributes[_HOOKED] = True
            conn.on_close.append(self._connection_closed)
        r = s.replicas.get(req.broker_id)
        if r is None:
            r = s.replicas[req.broker_id] = _Replica(
                req.broker_id, req.address, req.ha_address, req.offset, req.epoch, now
            )
        r.address, r.ha_address = req.address, req.ha_address
        r.offset, r.epoch = req.offset, req.epoch
        r.last_seen, r.master, r.following, r.conn = now, req.master, req.following, conn
        if req.leaving:
            r.last_seen = float("-inf")  # not alive: never chosen, never waited for
            r.master = r.following = False
            log.info("broker set %s: broker %d stops", s.name, req.broker_id)
            if req.broker_id == s.master_id and s.election is None:
                self._start_election(s, now, f"master {s.master_id} stops")
            return self._answer(s, req.broker_id)
        newer = req.epoch > s.epoch and (req.master or s.epoch or req.epoch > FIRST_EPOCH)
        unclaimed = req.master and s.master_id < 0 and req.epoch == s.epoch > 0
        if newer or unclaimed:
            # a controller that lost its state (or never had this set): the brokers' epochs
            # go on from where they are, never back (a fresh replica's log counts as epoch
            # 1, the epoch of the first election)
            self._adopt(s, r, req, now)
        e = s.election
        if e is not None:
            if r.stopped and not r.fenced_at:
                r.fenced_at = now
                silent = req.master_silent_ms / 1000 if req.master_silent_ms >= 0 else 0.0
                r.lease_bound = now - silent + self.timings.lease_s
            return self._answer(s, req.broker_id)
        if self._silent_to_its_slaves(s, req, now):
            self._start_election(
                s, now, f"master {s.master_id} not heard by this controller since it took "
                f"over, and silent for {req.master_silent_ms / 1000:.1f} s to in-sync slave "
                f"{req.broker_id}",
            )  # fmt: skip
            return self._answer(s, req.broker_id)
        if req.broker_id == s.master_id:
            if req.master and req.epoch == s.epoch:
                s.master_seen, s.confirmed, s.conn_lost_at = now, True, 0.0
                s.inherited = False
                s.all_ack = req.all_ack
                self._take_in_sync(s, req.in_sync)
            elif req.handing_over and r.stopped and (target := self._successor(s)) is not None:
                # a clean stop: a switchover to the best slave, the master stopped already
                self._start_election(
                    s, now, f"master {s.master_id} stops: switchover to broker {target}",
                    target, now + HANDOVER_S,
                )  # fmt: skip
                r.fenced_at = now
            elif not req.master and s.confirmed:
                # it was the master and restarted (or stopped acting): elect
                self._start_election(s, now, f"master {s.master_id} lost its role (restarted?)")
            elif not req.master:
                s.master_seen = now  # elected, not told yet: this answer tells it
        if s.master_id < 0 and s.election is None:
            self._start_election(s, now, "the set has no master yet")
        return self._answer(s, req.broker_id)

    def _silent_to_its_slaves(self, s: _Set, req: ControllerHeartbeat, now: float) -> bool:
        """A set this controller took over (a new leader on etcd, a restart) gives its
        master ``heartbeat_timeout_s`` to be heard — unless an in-sync slave says the
        master has not answered it for that long: the master most likely died or hangs
        (the fault that often deposes a leader too), and the election starts at once (a
        master that is well talks to its slaves; ``inherited`` ends with its first
        heartbeat here).  It decides once the master's lease ran out: on etcd at once (a
        leader grants no lease past its own leadership, which ended before this one could
        begin), after a restart ``lease_s`` from it."""
        return (
            s.inherited
            and s.master_id >= 0
            and req.broker_id != s.master_id
            and req.broker_id in s.in_sync
            and req.master_silent_ms >= self.timings.heartbeat_timeout_s * 1000
        )

    async def elect_master(self, req: ElectMaster, call: Call | None) -> ControllerAnswer:
        """A planned switchover: fence the master only, let ``req.broker_id`` (or the best
        in-sync slave) copy the rest, then make it the master."""
        self._check_leading()
        s = self.sets.get(req.broker_name)
        if s is None:
            raise BadRequest(f"the controller knows no broker set {req.broker_name!r}")
        if req.force:
            return await self._force(s, req)
        if s.election is not None:
            raise NoCandidate(f"broker set {s.name}: an election runs ({s.election.reason})")
        target = req.broker_id if req.broker_id >= 0 else self._successor(s)
        if target is None:
            raise NoCandidate(f"broker set {s.name} has no alive slave to switch to")
        if target == s.master_id:
            return self._answer(s, target)
        if target not in s.replicas or not self._alive(s.replicas[target]):
            raise NoCandidate(f"broker {target} of set {s.name} is not alive")
        now = self._clock()
        self._start_election(
            s, now, f"switchover to broker {target}", target, now + req.timeout_ms / 1000
        )
        while s.election is not None and s.master_id != target:
            await anyio.sleep(0.05)
            self.scan(self._clock())
        if s.master_id != target:
            raise NoCandidate(f"broker {target} of set {s.name} did not catch up in time")
        if self.leadership is not None and not await self._saved_through(self._version):
            self._check_leading()
        return self._answer(s, target)

    async def _force(self, s: _Set, req: ElectMaster) -> ControllerAnswer:
        """End a failover's wait for in-sync slaves that do not report."""
        e = s.election
        if e is None or e.target >= 0:
            raise NoCandidate(
                f"broker set {s.name} has no failover waiting (--force ends one that waits "
                "for silent in-sync slaves)"
            )
        e.forced = True
        log.warning("broker set %s: an operator forces the election (%s)", s.name, e.reason)
        deadline = self._clock() + req.timeout_ms / 1000
        while s.election is e and self._clock() < deadline:
            await anyio.sleep(0.05)
            self.scan(self._clock())
        if s.election is e:
            raise NoCandidate(
                f"broker set {s.name}: still no candidate ({e.waiting or 'waiting'}): no "
                "in-sync slave reported that it stopped"
            )
        if self.leadership is not None and not await self._saved_through(self._version):
            self._check_leading()
        return self._answer(s, s.master_id)

    def _successor(self, s: _Set) -> int | None:
        """The slave a switchover goes to by default: alive, in sync, furthest."""
        others = [r for i, r in s.replicas.items() if i != s.master_id and self._alive(r)]
        if not others:
            return None
        return max(others, key=lambda r: (r.broker_id in s.in_sync, r.offset)).broker_id

    def replica_info(self, req: GetReplicaInfo, call: Call | None) -> ReplicaInfo:
        now = self._clock()
        return ReplicaInfo(
            sets=[
                BrokerSetState(
                    cluster=s.cluster,
                    broker_name=s.name,
                    epoch=s.epoch,
                    master_id=s.master_id,
                    in_sync=s.in_sync,
                    replicas=[
                        ReplicaState(
                            broker_id=r.broker_id,
                            address=r.address,
                            alive=self._alive(r),
                            offset=r.offset,
                            epoch=r.epoch,
                            silent_s=round(now - r.last_seen, 1),
                            master=r.master,
                            following=r.following,
                        )
                        for r in sorted(s.replicas.values(), key=lambda r: r.broker_id)
                    ],
                    history=s.history,
                    electing=s.election.reason if s.election is not None else "",
                )
                for s in sorted(self.sets.values(), key=lambda s: s.name)
                if not req.broker_name or s.name == req.broker_name
            ]
        )

    # -- watching the masters -------------------------------------------------------------

    async def run(self) -> None:
        """Watch the masters and run elections until cancelled (on etcd: campaign, and
        while leading watch and save)."""
        if self.leadership is None:
            return await self._scan_forever()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.leadership.run, self._lead, self._follow)
            tg.start_soon(self._writer)
            await self._scan_forever()

    async def _scan_forever(self) -> None:
        while True:
            await anyio.sleep(self.timings.scan_interval_s)
            if self.leading:
                self.scan(self._clock())
                if self._version > self._saved:
                    self._save_wanted.set()

    def scan(self, now: float) -> None:
        t = self.timings
        for s in self.sets.values():
            if s.election is not None:
                self._decide(s, now)
            elif s.master_id < 0:
                continue
            elif s.conn_lost_at and now - s.conn_lost_at > t.reconnect_grace_s:
                self._start_election(s, now, f"master {s.master_id}'s connection closed")
            elif now - s.master_seen > t.heartbeat_timeout_s:
                self._start_election(
                    s, now, f"master {s.master_id} silent for {now - s.master_seen:.1f} s"
                )

    def _connection_closed(self, conn: object) -> None:
        now = self._clock()
        for s in self.sets.values():
            master = s.replicas.get(s.master_id)
            if master is not None and master.conn is conn and s.election is None:
                s.conn_lost_at = now

    def _alive(self, r: _Replica) -> bool:
        return self._clock() - r.last_seen <= self.timings.heartbeat_timeout_s

    # -- elections --------------------------------------------------------------------------

    def _start_election(
        self, s: _Set, now: float, reason: str, target: int = -1, deadline: float = 0.0
    ) -> None:
        s.election = _Election(reason, now, s.master_id, target, deadline)
        s.conn_lost_at = 0.0
        s.inherited = False
        for r in s.replicas.values():
            r.fenced_at = 0.0
        log.warning("broker set %s: electing a master (%s)", s.name, reason)
        for hook in self.on_elect:
            hook(s.name, None, s.epoch + 1)

    def _decide(self, s: _Set, now: float) -> None:
        e = s.election
        assert e is not None
        alive = {i: r for i, r in s.replicas.items() if self._alive(r)}
        fenced = {i: r for i, r in alive.items() if r.fenced_at and r.stopped}
        old = s.replicas.get(e.old_master)
        pool: list[_Replica]
        if e.target >= 0:  # a switchover: the old master stops, the target catches up
            target = s.replicas.get(e.target)
            if now > e.deadline or target is None or not self._alive(target):
                log.warning("broker set %s: %s abandoned", s.name, e.reason)
                s.election = None  # the master is told to go on (same epoch)
                s.master_seen, s.confirmed = now, False
                for done in self.on_abandon:
                    done(s.name)
                return
            if old is None or e.old_master not in fenced or target.offset < old.offset:
                return self._wait(s, "the target to catch up with the stopped master")
            pool = [target]
        elif e.old_master < 0:  # a new set: whoever reported
            if now - e.since < REPORT_AFTER_S:
                return
            pool = list(alive.values())
        elif e.old_master in fenced:  # the old master stopped (or restarted): its log is final
            if now - e.since < REPORT_AFTER_S:
                return  # the slaves' final ends
            pool = list(fenced.values())
        else:  # the old master is unreachable
            need = [i for i in s.in_sync if i != e.old_master]
            if not need:
                return self._wait(s, f"no in-sync slave: master {e.old_master} must come back")
            missing = [i for i in need if i not in fenced]
            if missing:
                self._elect_unclean_if_due(s, now, missing)
                partial = (s.all_ack or e.forced) and len(missing) < len(need)
                if not partial or now - e.since < REPORT_AFTER_S:
                    self._warn_if_long(s, now, missing)
                    return self._wait(s, f"in-sync slave(s) {missing} to report that they stopped")
                need = [i for i in need if i in fenced]
            bounds = [fenced[i].lease_bound for i in need]
            bound = max(s.granted_until, *bounds)
            if now < bound:
                return
            pool = [fenced[i] for i in need]
        if not pool:
            return self._wait(s, "a replica to report")
        # only logs on the newest epoch any candidate has: one still on an older epoch may
        # hold a deposed master's tail and lack what came after it
        newest = max(r.epoch for r in pool)
        best = max(
            (r for r in pool if r.epoch == newest),
            key=lambda r: (r.offset, r.broker_id == e.old_master, r.broker_id == 0, -r.broker_id),
        )
        # the new sync state set: the slaves whose logs end where the winner's does (in a
        # failover only those that stopped: another may still copy from the old master)
        others = alive if e.target >= 0 else fenced
        peers = [i for i, r in others.items() if r is not best and r.offset == best.offset]
        self._make_master(s, best, sorted(peers), e.reason)

    def _adopt(self, s: _Set, r: _Replica, req: ControllerHeartbeat, now: float) -> None:
        """Take the epoch a replica reports; one acting as master in it stays the master
        (its proposal of in-sync slaves with it) — no election, nothing moves."""
        s.epoch = req.epoch
        if not req.master or (s.election is not None and s.election.old_master >= 0):
            log.warning(
                "broker set %s: epoch %d taken from broker %d", s.name, s.epoch, r.broker_id
            )
            self._save()
            return
        s.election = None
        s.master_id, s.master_seen, s.confirmed = r.broker_id, now, True
        s.inherited = False
        s.in_sync = sorted({i for i in req.in_sync if i != r.broker_id})
        s.history.append((s.epoch, r.broker_id))
        self._save()
        log.warning(
            "broker set %s: broker %d acts as the master of epoch %d: kept (this controller "
            "had no state for the set)",
            s.name,
            r.broker_id,
            s.epoch,
        )

    def _warn_if_long(self, s: _Set, now: float, missing: list[int]) -> None:
        e = s.election
        assert e is not None
        if e.warned or now - e.since < WAIT_WARNING_S:
            return
        e.warned = True
        log.error(
            "broker set %s: no master for %.0f s: in-sync slave(s) %s have not reported that "
            "they stopped; they may hold acknowledged messages the others lack. Bring them "
            "back (or their link to the controller), or elect among the others now, losing "
            "what only they hold: txmq admin switchover --broker-name %s --force",
            s.name, now - e.since, missing, s.name,
        )  # fmt: skip

    def _elect_unclean_if_due(self, s: _Set, now: float, missing: list[int]) -> None:
        e = s.election
        after = self.timings.unclean_election_after_s
        if e is None or e.forced or s.all_ack or not after or now - e.since < after:
            return
        e.forced = True
        log.error(
            "broker set %s: no master for %.0f s: electing among the in-sync slaves that "
            "reported, without %s (unclean_election_after_s = %g): acknowledged messages "
            "only they hold are lost",
            s.name, now - e.since, missing, after,
        )  # fmt: skip

    def _wait(self, s: _Set, what: str) -> None:
        e = s.election
        assert e is not None
        if e.waiting != what:
            e.waiting = what
            log.warning("broker set %s: election waits for %s", s.name, what)

    def _make_master(self, s: _Set, best: _Replica, in_sync: list[int], reason: str) -> None:
        s.epoch += 1
        s.master_id = best.broker_id
        s.in_sync = in_sync
        s.history.append((s.epoch, best.broker_id))
        s.master_seen = self._clock()
        s.granted_until = s.master_seen + self.timings.lease_s  # (told with its first answer)
        s.confirmed = False
        s.all_ack = False
        s.election = None
        self._save()  # saved before anyone is told
        for hook in self.on_elect:
            hook(s.name, best.address, s.epoch)
        log.warning(
            "broker set %s: broker %d (%s) is the master in epoch %d (%s; its log ends at %d; "
            "in sync: %s)",
            s.name,
            best.broker_id,
            best.address,
            s.epoch,
            reason,
            best.offset,
            in_sync or "none",
        )

    def _take_in_sync(self, s: _Set, proposed: list[int]) -> None:
        """The master's proposal of its sync state set (it keeps every write it
        acknowledged on some member: see ``broker/ha/master.py``)."""
        wanted = sorted({i for i in proposed if i != s.master_id})
        if wanted != s.in_sync:
            log.info("broker set %s: in-sync slaves %s -> %s", s.name, s.in_sync, wanted)
            s.in_sync = wanted
            self._save()

    def _save(self) -> None:
        if self.leadership is not None:
            self._version += 1  # saved by the writer before any answer tells of it
            self._save_wanted.set()
            return
        assert self.path is not None
        write_json_atomic(
            self.path,
            _Saved(
                {
                    n: _SavedSet(s.cluster, s.epoch, s.master_id, s.in_sync, s.history)
                    for n, s in self.sets.items()
                }
            ),
        )

    def _answer(self, s: _Set, broker_id: int) -> ControllerAnswer:
        e = s.election
        if e is not None and (e.target < 0 or broker_id == e.old_master):
            return ControllerAnswer(epoch=s.epoch, electing=True)
        master = s.replicas.get(s.master_id)
        lease = 0
        if broker_id == s.master_id and e is None:
            now = self._clock()
            lease_s = self.timings.lease_s
            if self.leadership is not None:
                # no lease past this leader's own: a successor can then trust that every
                # lease ran out by the time it took over, and elect at once
                lease_s = min(lease_s, self.leadership.valid_until - now)
            lease = max(int(lease_s * 1000), 0)
            s.granted_until = max(s.granted_until, now + lease / 1000)
        return ControllerAnswer(
            epoch=s.epoch,
            master_id=s.master_id,
            master_address=master.address if master else "",
            master_ha_address=master.ha_address if master else "",
            lease_ms=lease,
            in_sync=s.in_sync,
        )
