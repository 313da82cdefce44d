"""The controller: elects each broker set's master (RocketMQ 5's controller mode).

Brokers started with ``--controller`` heartbeat to it every ``controller_heartbeat_interval_s``
(0.5 s) with their log's end and newest epoch.  The controller answers each with its set's
state.  A master's answer carries a lease (``lease_s``, 2 s, counted by the broker from
when it *sent* the heartbeat): the master acknowledges writes only while it runs.

Election.  A set with no master, or whose master was silent for ``heartbeat_timeout_s``
(3 s, longer than the lease, so the old master has stopped acknowledging by then), gets
the alive replica whose log holds the current epoch and reaches furthest; the epoch goes up
by one.  Under SYNC_MASTER every acknowledged write is on some slave, and every slave's
log is a prefix of the master's: the furthest one holds every acknowledged write.  A
replica that has not yet taken the current epoch (a deposed master back before it cut its
tail) is never chosen.

The state (epoch, master, history) is saved in ``<controller store>/controller.json``
before anyone is told: a restarted controller goes on from it.  One controller is the
minimum; losing it pauses failovers (not traffic: masters renew nothing and so stop
acknowledging after their lease — run it where it is safe, see README "Replication").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec

from txmq.errors import BadRequest, TxmqError
from txmq.jsonfile import load_json, write_json_atomic
from txmq.rpc import Call, Router
from txmq.wire import (
    BrokerSetState,
    ControllerAnswer,
    ControllerHeartbeat,
    ElectMaster,
    GetReplicaInfo,
    ReplicaInfo,
    ReplicaState,
)

__all__ = ["Controller", "ControllerTimings"]

log = logging.getLogger("txmq.controller")


#: a replica reports its log's end every 0.5 s: after this long, every one has once more
REPORT_AFTER_S = 0.7


class NoCandidate(TxmqError):
    """No replica may be made master now."""

    retriable = True


@dataclass(frozen=True, slots=True)
class ControllerTimings:
    heartbeat_timeout_s: float = 3.0
    lease_s: float = 2.0
    scan_interval_s: float = 0.1


@dataclass(slots=True)
class _Replica:
    broker_id: int
    address: str
    ha_address: str
    offset: int
    epoch: int
    last_seen: float


class _SavedSet(msgspec.Struct):
    cluster: str
    epoch: int = 0
    master_id: int = -1
    history: list[tuple[int, int]] = []


class _Saved(msgspec.Struct):
    sets: dict[str, _SavedSet] = {}


@dataclass(slots=True)
class _Set:
    cluster: str
    name: str
    epoch: int = 0
    master_id: int = -1
    history: list[tuple[int, int]] = field(default_factory=list)
    in_sync: list[int] = field(default_factory=list)
    replicas: dict[int, _Replica] = field(default_factory=dict)
    #: when the master was last heard from (the controller's start for a saved master)
    master_seen: float = 0.0
    #: a planned switchover: (target id, deadline); the master gets no lease meanwhile
    switching: tuple[int, float] | None = None
    #: the master has confirmed it is master in this epoch (a heartbeat saying so)
    confirmed: bool = False
    #: when the master came back from a restart (it lost its role): elect soon
    lost_at: float = 0.0
    no_candidate_logged: bool = False


class Controller:
    def __init__(
        self,
        store: Path,
        timings: ControllerTimings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timings = timings or ControllerTimings()
        self._clock = clock
        if not self.timings.lease_s < self.timings.heartbeat_timeout_s:
            raise ValueError("the lease must be shorter than the heartbeat time-out")
        self.path = store / "controller.json"
        store.mkdir(parents=True, exist_ok=True)
        now = self._clock()
        self.sets: dict[str, _Set] = {
            name: _Set(s.cluster, name, s.epoch, s.master_id, list(s.history), master_seen=now)
            for name, s in load_json(self.path, _Saved).sets.items()
        }
        self.router = Router("the controller")
        self.route(self.router)

    def route(self, router: Router) -> None:
        router.route(ControllerHeartbeat, self.heartbeat)
        router.route(ElectMaster, self.elect_master)
        router.route(GetReplicaInfo, self.replica_info)

    # -- requests -------------------------------------------------------------------------

    def heartbeat(self, req: ControllerHeartbeat, call: Call) -> ControllerAnswer:
        now = self._clock()
        s = self.sets.get(req.broker_name)
        if s is None:
            s = self.sets[req.broker_name] = _Set(req.cluster, req.broker_name, master_seen=now)
        s.replicas[req.broker_id] = _Replica(
            req.broker_id, req.address, req.ha_address, req.offset, req.epoch, now
        )
        if req.broker_id == s.master_id and not s.lost_at:
            if req.master and req.epoch == s.epoch:
                s.master_seen = now
                s.confirmed = True
                s.in_sync = sorted(i for i in req.in_sync if i != s.master_id)
            elif not req.master and s.confirmed:
                # it was the master and restarted: its lease died with it; elect once the
                # others have reported their logs' ends from after its death
                s.lost_at = now
                log.warning("broker set %s: master %d restarted", s.name, s.master_id)
            elif not req.master:
                s.master_seen = now  # elected, not told yet: this answer tells it
        if s.master_id < 0:
            self._elect(s, now, reason="no master yet")
        return self._answer(s, req.broker_id)

    async def elect_master(self, req: ElectMaster, call: Call) -> ControllerAnswer:
        s = self.sets.get(req.broker_name)
        if s is None:
            raise BadRequest(f"the controller knows no broker set {req.broker_name!r}")
        target = req.broker_id
        if target < 0:
            others = [r for i, r in s.replicas.items() if i != s.master_id and self._alive(r)]
            if not others:
                raise NoCandidate(f"broker set {s.name} has no alive slave to switch to")
            target = max(others, key=lambda r: (r.broker_id in s.in_sync, r.offset)).broker_id
        if target == s.master_id:
            return self._answer(s, target)
        if target not in s.replicas or not self._alive(s.replicas[target]):
            raise NoCandidate(f"broker {target} of set {s.name} is not alive")
        deadline = self._clock() + req.timeout_ms / 1000
        s.switching = (target, deadline)
        log.info("switchover of %s to broker %d: the master's lease is not renewed", s.name, target)
        try:
            while self._clock() < deadline:
                master = s.replicas.get(s.master_id)
                cand = s.replicas[target]
                fenced_since = (master.last_seen if master else 0) + self.timings.lease_s
                if master is None or (
                    (cand.last_seen > fenced_since and cand.offset >= master.offset)
                    and master.last_seen > fenced_since
                ):
                    self._make_master(s, target, "switchover")
                    return self._answer(s, target)
                await anyio.sleep(0.05)
        finally:
            s.switching = None
        raise NoCandidate(f"broker {target} of set {s.name} did not catch up in time")

    def replica_info(self, req: GetReplicaInfo, call: Call) -> ReplicaInfo:
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
                        )
                        for r in sorted(s.replicas.values(), key=lambda r: r.broker_id)
                    ],
                    history=s.history,
                )
                for s in sorted(self.sets.values(), key=lambda s: s.name)
                if not req.broker_name or s.name == req.broker_name
            ]
        )

    # -- elections --------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch the masters until cancelled."""
        while True:
            await anyio.sleep(self.timings.scan_interval_s)
            self.scan(self._clock())

    def scan(self, now: float) -> None:
        for s in self.sets.values():
            if s.lost_at and now - s.lost_at > REPORT_AFTER_S:
                self._elect(s, now, reason=f"master {s.master_id} restarted", after=s.lost_at)
            elif s.master_id >= 0 and now - s.master_seen > self.timings.heartbeat_timeout_s:
                self._elect(
                    s,
                    now,
                    reason=f"master {s.master_id} silent",
                    after=s.master_seen + self.timings.lease_s,
                )

    def _alive(self, r: _Replica) -> bool:
        return self._clock() - r.last_seen <= self.timings.heartbeat_timeout_s

    def _elect(self, s: _Set, now: float, reason: str, after: float = 0.0) -> None:
        """Make the best replica heard from since ``after`` (when the old master stopped
        acknowledging: their logs' ends are final) the master."""
        alive = [
            r
            for i, r in s.replicas.items()
            if (i != s.master_id or s.lost_at)
            and now - r.last_seen <= self.timings.heartbeat_timeout_s
            and r.last_seen > after
        ]
        # only logs that reached the newest epoch any of them has: a replica still on an
        # older one may hold a deposed master's tail and lack what came after it
        newest = max((r.epoch for r in alive), default=0)
        candidates = [r for r in alive if r.epoch == newest]
        if not candidates:
            if not s.no_candidate_logged:
                log.warning(
                    "broker set %s: %s and no other replica is alive to take over; waiting",
                    s.name,
                    reason,
                )
                s.no_candidate_logged = True
            return
        best = max(candidates, key=lambda r: (r.offset, r.broker_id == 0, -r.broker_id))
        self._make_master(s, best.broker_id, reason)

    def _make_master(self, s: _Set, broker_id: int, reason: str) -> None:
        s.epoch += 1
        s.master_id = broker_id
        s.history.append((s.epoch, broker_id))
        s.master_seen = self._clock()
        s.in_sync = []
        s.confirmed = False
        s.lost_at = 0.0
        s.no_candidate_logged = False
        self._save()  # saved before anyone is told
        r = s.replicas[broker_id]
        log.warning(
            "broker set %s: broker %d (%s) is the master in epoch %d (%s; its log ends at %d)",
            s.name,
            broker_id,
            r.address,
            s.epoch,
            reason,
            r.offset,
        )

    def _save(self) -> None:
        write_json_atomic(
            self.path,
            _Saved(
                {
                    n: _SavedSet(s.cluster, s.epoch, s.master_id, s.history)
                    for n, s in self.sets.items()
                }
            ),
        )

    def _answer(self, s: _Set, broker_id: int) -> ControllerAnswer:
        if s.lost_at:
            return ControllerAnswer(epoch=s.epoch)  # no master until the election
        master = s.replicas.get(s.master_id)
        lease = 0
        if broker_id == s.master_id and s.switching is None:
            lease = int(self.timings.lease_s * 1000)
        return ControllerAnswer(
            epoch=s.epoch,
            master_id=s.master_id,
            master_address=master.address if master else "",
            master_ha_address=master.ha_address if master else "",
            lease_ms=lease,
            in_sync=s.in_sync,
        )
