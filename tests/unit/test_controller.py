"""The controller's elections on a clock the test moves.

A new set's furthest replica becomes master; only the master gets a lease; the master's
proposal of its in-sync slaves is what counts.  A master that goes silent (or whose
connection closes) is replaced only after every in-sync slave stopped copying from it and
its lease ran out, by the in-sync slave that reaches furthest; a set without an in-sync
slave waits for its master; a replica on an older epoch is never chosen; a restarted
master is considered with the rest; a switchover waits for its target to catch up; the
state survives a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from txmq.namesrv.controller import Controller, ControllerTimings, NoCandidate
from txmq.protocol.wire import ControllerAnswer, ControllerHeartbeat, ElectMaster, GetReplicaInfo

TIMINGS = ControllerTimings(heartbeat_timeout_s=3.0, lease_s=2.0, reconnect_grace_s=0.6)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeConn:
    attributes: dict[str, object] = field(default_factory=dict)
    on_close: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for hook in self.on_close:
            hook(self)


@dataclass
class FakeCall:
    conn: FakeConn


@pytest.fixture
def clock() -> Clock:
    return Clock()


def beat(
    c: Controller,
    broker_id: int,
    offset: int,
    epoch: int,
    *,
    master: bool = False,
    following: bool = False,
    silent_ms: int = -1,
    in_sync: list[int] | None = None,
    conn: FakeConn | None = None,
    all_ack: bool = False,
) -> ControllerAnswer:
    req = ControllerHeartbeat(
        cluster="C",
        broker_name="a",
        broker_id=broker_id,
        address=f"127.0.0.1:{10911 + 10 * broker_id}",
        ha_address=f"127.0.0.1:{10912 + 10 * broker_id}",
        offset=offset,
        epoch=epoch,
        master=master,
        following=following,
        master_silent_ms=silent_ms,
        in_sync=in_sync or [],
        all_ack=all_ack,
    )
    call: Any = FakeCall(conn) if conn is not None else None
    return c.heartbeat(req, call)


def elect_first(c: Controller, clock: Clock, offsets: dict[int, int]) -> None:
    """A new set: every replica reports, and after a heartbeat's time the election."""
    for i, off in offsets.items():
        assert beat(c, i, off, 1).electing
    clock.now += 0.8
    for i, off in offsets.items():
        beat(c, i, off, 1)
    c.scan(clock.now)


def steady(c: Controller, clock: Clock, master: int, offset: int, slaves: dict[int, int]) -> None:
    """One heartbeat round of a healthy set: the master proposes the slaves as in sync."""
    beat(c, master, offset, c.sets["a"].epoch, master=True, in_sync=sorted(slaves))
    for i, off in slaves.items():
        beat(c, i, off, c.sets["a"].epoch, following=True, silent_ms=100)


def test_a_new_sets_furthest_replica_becomes_master_and_only_it_gets_a_lease(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 100, 1: 300, 2: 300})
    s = c.sets["a"]
    assert (s.master_id, s.epoch) == (1, 1)  # furthest; of equals, the lower id
    a1 = beat(c, 1, 300, 1)
    assert (a1.master_id, a1.lease_ms, a1.electing) == (1, 2000, False)
    a0 = beat(c, 0, 100, 1)
    assert (a0.master_id, a0.lease_ms, a0.master_ha_address) == (1, 0, "127.0.0.1:10922")
    assert s.in_sync == [2]  # its log ends where the master's does


def test_the_masters_proposal_is_the_sync_state_set(tmp_path: Path, clock: Clock) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 0, 1: 0})
    steady(c, clock, 0, 50, {1: 50, 2: 40})
    assert beat(c, 1, 50, 1, following=True).in_sync == [1, 2]
    # a slave's proposal counts for nothing
    beat(c, 2, 40, 1, in_sync=[])
    assert c.sets["a"].in_sync == [1, 2]
    beat(c, 0, 60, 1, master=True, in_sync=[2])
    assert c.sets["a"].in_sync == [2]


def test_a_silent_master_is_replaced_once_the_in_sync_slaves_stopped_and_its_lease_ran_out(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 0, 1: 0, 2: 0})
    steady(c, clock, 0, 500, {1: 450, 2: 480})
    for _ in range(7):  # the master falls silent; the slaves keep copying (nothing new)
        clock.now += 0.5
        beat(c, 1, 450, 1, following=True, silent_ms=int((clock.now - 1000.8) * 1000))
        beat(c, 2, 480, 1, following=True, silent_ms=int((clock.now - 1000.8) * 1000))
        c.scan(clock.now)
    s = c.sets["a"]
    assert s.election is not None and s.master_id == 0  # silent over 3 s: fencing
    told = beat(c, 1, 450, 1, following=True, silent_ms=3500)
    assert told.electing and told.master_id == -1
    # the slaves stop copying and say when the master last answered them
    beat(c, 1, 460, 1, silent_ms=3500)
    c.scan(clock.now)
    assert s.master_id == 0  # slave 2 has not stopped yet
    beat(c, 2, 480, 1, silent_ms=3500)
    c.scan(clock.now)
    # the lease the old master got from its last heartbeat (received at 1000.8) ran out
    # at 1002.8; from slave confirmations it ran out by now as well
    s = c.sets["a"]
    assert (s.master_id, s.epoch, s.history) == (2, 2, [(1, 0), (2, 2)])
    assert s.in_sync == []  # slave 1 ends elsewhere: it must catch up first
    told = beat(c, 2, 480, 1)
    assert told.master_id == 2 and told.epoch == 2 and told.lease_ms == 2000
    back = beat(c, 0, 900, 1, master=True)  # the old master, back with a tail nobody has
    assert back.master_id == 2 and back.lease_ms == 0


def test_the_decision_waits_for_the_lease_a_slaves_confirmation_gave(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 0, 1: 0})
    steady(c, clock, 0, 100, {1: 100})
    clock.now += 3.1  # silent: an election; the slave still copied a moment ago
    c.scan(clock.now)
    assert c.sets["a"].election is not None
    beat(c, 1, 100, 1, silent_ms=200)  # the master answered it 0.2 s ago
    c.scan(clock.now)
    clock.now += 1.7
    c.scan(clock.now)
    assert c.sets["a"].master_id == 0  # 1.8 s after that answer: the lease may still run
    clock.now += 0.3
    beat(c, 1, 100, 1, silent_ms=2200)
    c.scan(clock.now)
    assert (c.sets["a"].master_id, c.sets["a"].epoch) == (1, 2)


def _silent_master_one_slave_reports(c: Controller, clock: Clock, *, all_ack: bool) -> None:
    """Master 0 with in-sync slaves 1 and 2 (all_ack as its heartbeats say) falls silent;
    slave 1 reports that it stopped, slave 2 never does (cut from the controller)."""
    elect_first(c, clock, {0: 0, 1: 0, 2: 0})
    beat(c, 0, 500, 1, master=True, in_sync=[1, 2], all_ack=all_ack)
    beat(c, 1, 500, 1, following=True, silent_ms=100)
    beat(c, 2, 500, 1, following=True, silent_ms=100)
    for _ in range(10):  # silent over 3 s: fencing; slave 1 stops and says so
        clock.now += 0.5
        beat(c, 1, 500, 1, silent_ms=int((clock.now - 1000.8) * 1000))
        c.scan(clock.now)


def test_under_all_ack_any_in_sync_slave_that_reported_is_elected(
    tmp_path: Path, clock: Clock
) -> None:
    """Issue 32, item 2: every SEND_OK write is on every in-sync slave, so one that stopped
    and reported will do once the old master's lease ran out; slave 2's silence is not
    waited for."""
    c = Controller(tmp_path, TIMINGS, clock=clock)
    _silent_master_one_slave_reports(c, clock, all_ack=True)
    s = c.sets["a"]
    assert (s.master_id, s.epoch) == (1, 2), s.election
    assert s.history[-1] == (2, 1) and not s.all_ack  # the new epoch's master says anew


def test_under_one_ack_a_silent_in_sync_slave_is_waited_for_until_an_operator_forces(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The slave that did not report may hold writes acknowledged on its confirmation
    alone: the election waits; after WAIT_WARNING_S one ERROR says what to do, and
    ``switchover --force`` (ElectMaster force) elects among those that reported."""
    c = Controller(tmp_path, TIMINGS, clock=clock)
    _silent_master_one_slave_reports(c, clock, all_ack=False)
    assert c.sets["a"].master_id == 0 and c.sets["a"].election is not None
    for _ in range(25):
        clock.now += 0.5
        beat(c, 1, 500, 1, silent_ms=int((clock.now - 1000.8) * 1000))
        c.scan(clock.now)
    assert c.sets["a"].master_id == 0  # still waiting
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "in-sync slave(s) [2] have not reported" in errors[0]
    assert "txmq admin switchover --broker-name a --force" in errors[0]

    async def force() -> ControllerAnswer:
        return await c.elect_master(ElectMaster(broker_name="a", force=True), None)

    answer = anyio.run(force)
    assert (answer.master_id, answer.epoch) == (1, 2)
    with pytest.raises(NoCandidate, match="no failover waiting"):
        anyio.run(force)


def test_under_one_ack_unclean_election_after_s_ends_the_wait_by_itself(
    tmp_path: Path, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    timings = ControllerTimings(
        heartbeat_timeout_s=3.0, lease_s=2.0, reconnect_grace_s=0.6, unclean_election_after_s=6
    )
    c = Controller(tmp_path, timings, clock=clock)
    _silent_master_one_slave_reports(c, clock, all_ack=False)
    e = c.sets["a"].election
    assert e is not None
    for moment in (3.0, 5.0, 5.9):
        clock.now = e.since + moment
        beat(c, 1, 500, 1, silent_ms=int((clock.now - 1000.8) * 1000))
        c.scan(clock.now)
        assert c.sets["a"].master_id == 0  # still waiting for slave 2
    clock.now = e.since + 6.01
    beat(c, 1, 500, 1, silent_ms=int((clock.now - 1000.8) * 1000))
    c.scan(clock.now)
    assert (c.sets["a"].master_id, c.sets["a"].epoch) == (1, 2)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "without [2] (unclean_election_after_s = 6)" in errors[0]
    with pytest.raises(ValueError, match="unclean_election_after_s"):
        ControllerTimings(unclean_election_after_s=-1).check()


def test_without_an_in_sync_slave_the_set_waits_for_its_master(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 0})
    beat(c, 0, 700, 1, master=True)
    beat(c, 1, 100, 1, following=True)  # a slave that never caught up
    clock.now += 3.5
    beat(c, 1, 100, 1)
    c.scan(clock.now)
    clock.now += 5
    beat(c, 1, 100, 1)
    c.scan(clock.now)
    assert c.sets["a"].master_id == 0 and c.sets["a"].epoch == 1  # waits: 1 lacks 600 bytes
    beat(c, 0, 700, 1)  # back (restarted): it has everything
    clock.now += 0.8
    beat(c, 1, 100, 1)
    c.scan(clock.now)
    assert (c.sets["a"].master_id, c.sets["a"].epoch) == (0, 2)


def test_a_closed_connection_starts_the_election_after_a_grace(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    conn = FakeConn()
    elect_first(c, clock, {0: 0, 1: 0})
    beat(c, 0, 100, 1, master=True, in_sync=[1], conn=conn)
    beat(c, 1, 100, 1, following=True, silent_ms=10)
    conn.close()  # SIGKILLed: its socket closed
    clock.now += 0.5
    c.scan(clock.now)
    assert c.sets["a"].election is None  # within the grace
    clock.now += 0.2
    c.scan(clock.now)
    assert c.sets["a"].election is not None
    beat(c, 1, 100, 1, silent_ms=700)
    clock.now += 1.4
    c.scan(clock.now)
    assert (c.sets["a"].master_id, c.sets["a"].epoch) == (1, 2)


def test_a_master_back_on_a_new_connection_within_the_grace_keeps_its_role(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    conn = FakeConn()
    elect_first(c, clock, {0: 0, 1: 0})
    beat(c, 0, 100, 1, master=True, in_sync=[1], conn=conn)
    conn.close()
    clock.now += 0.3
    beat(c, 0, 100, 1, master=True, in_sync=[1], conn=FakeConn())
    clock.now += 1
    c.scan(clock.now)
    assert c.sets["a"].election is None and c.sets["a"].epoch == 1


def test_a_replica_still_on_an_older_epoch_is_never_chosen(tmp_path: Path, clock: Clock) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 0, 1: 0, 2: 0})
    # epoch 2: broker 2 is master; broker 0 (epoch 1's) is back with its old tail, not
    # cut yet, and broker 1 copies from 2
    c.sets["a"].epoch, c.sets["a"].master_id = 2, 2
    beat(c, 2, 300, 2, master=True, in_sync=[1])
    beat(c, 1, 290, 2, following=True, silent_ms=50)
    beat(c, 0, 350, 1)
    clock.now += 1
    beat(c, 0, 350, 1)
    beat(c, 2, 300, 2)  # broker 2 restarted: it lost its role
    clock.now += 0.8
    for i, off, epoch in ((0, 350, 1), (1, 290, 2), (2, 300, 2)):
        beat(c, i, off, epoch)
    c.scan(clock.now)
    s = c.sets["a"]
    assert s.master_id == 2 and s.epoch == 3  # epoch 2's furthest, not 0's longer epoch 1


def test_a_switchover_waits_for_the_target_to_catch_up(tmp_path: Path, clock: Clock) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 0, 1: 0})
    steady(c, clock, 0, 100, {1: 90})

    async def switch() -> ControllerAnswer:
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeats)
            answer = await c.elect_master(ElectMaster(broker_name="a", broker_id=1), None)
            tg.cancel_scope.cancel()
        return answer

    async def heartbeats() -> None:
        await anyio.sleep(0.1)
        told = beat(c, 0, 120, 1, master=True, in_sync=[1])
        assert told.electing  # the master stops acknowledging
        assert not beat(c, 1, 100, 1, following=True).electing  # the target goes on copying
        beat(c, 0, 120, 1)  # stopped at 120
        await anyio.sleep(0.2)
        assert c.sets["a"].master_id == 0  # the target lacks 20 bytes
        beat(c, 1, 120, 1, following=True)

    answer = anyio.run(switch)
    assert (answer.master_id, answer.epoch) == (1, 2)
    assert c.sets["a"].in_sync == [0]  # the old master has exactly the same log
    with pytest.raises(NoCandidate):
        anyio.run(c.elect_master, ElectMaster(broker_name="a", broker_id=7), None)


def test_the_state_survives_a_controller_restart(tmp_path: Path, clock: Clock) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 0, 1: 0})
    beat(c, 0, 10, 1, master=True, in_sync=[1])
    again = Controller(tmp_path, TIMINGS, clock=clock)
    s = again.sets["a"]
    assert (s.master_id, s.epoch, s.history, s.in_sync) == (0, 1, [(1, 0)], [1])
    assert beat(again, 0, 10, 1, master=True, in_sync=[1]).lease_ms == 2000
    info = again.replica_info(GetReplicaInfo(), None)
    assert [(b.broker_name, b.master_id, b.in_sync) for b in info.sets] == [("a", 0, [1])]


def test_a_set_taken_over_is_failed_over_early_when_its_in_sync_slaves_say_the_master_is_gone(
    tmp_path: Path, clock: Clock
) -> None:
    """A controller that takes a set over (a new leader, a restart) gives its master
    heartbeat_timeout_s to be heard — unless an in-sync slave reports the master silent
    for that long: then the election starts at once, and decides once the lease the old
    instance may have granted ran out (a restart from the file: the takeover plus
    lease_s)."""
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 0, 1: 0, 2: 0})
    steady(c, clock, 0, 500, {1: 500, 2: 500})
    clock.now += 2.0  # this controller dies with the master; another takes over
    taken = clock.now
    again = Controller(tmp_path, TIMINGS, clock=clock)
    s = again.sets["a"]
    assert s.in_sync == [1, 2] and s.master_id == 0
    assert not beat(again, 2, 500, 1, following=True, silent_ms=300).electing  # hears it
    assert not beat(again, 3, 500, 1, following=True, silent_ms=9000).electing  # not in sync
    assert beat(again, 1, 500, 1, following=True, silent_ms=3100).electing  # at once
    assert s.election is not None and "since it took over" in s.election.reason
    beat(again, 1, 500, 1, silent_ms=3100)  # both stop copying
    beat(again, 2, 500, 1, silent_ms=3100)
    clock.now = taken + TIMINGS.lease_s - 0.1
    again.scan(clock.now)  # (the election waits for the lease, not the heartbeat time-out)
    assert s.master_id == 0 and s.election is not None  # the old leader's lease may run
    clock.now = taken + TIMINGS.lease_s + 0.01
    again.scan(clock.now)
    assert (s.master_id, s.epoch) == (1, 2), s.history  # before heartbeat_timeout_s (3 s)


def test_a_master_heard_after_a_takeover_is_not_failed_over_on_a_slaves_word(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    elect_first(c, clock, {0: 0, 1: 0})
    steady(c, clock, 0, 500, {1: 500})
    again = Controller(tmp_path, TIMINGS, clock=clock)
    clock.now += 0.3
    beat(again, 0, 500, 1, master=True, in_sync=[1])  # the master found the new leader
    clock.now += 1.5
    # its link to the slave is broken, not to the controller: no election on that alone
    assert not beat(again, 1, 500, 1, following=True, silent_ms=5000).electing
    assert again.sets["a"].election is None


def test_a_controller_without_state_keeps_the_acting_master_and_its_epoch(
    tmp_path: Path, clock: Clock
) -> None:
    """Its state file lost, a new controller meets a set in epoch 7: the broker acting as
    master stays so (no election, nothing moves) and epochs go on from 7, never back."""
    c = Controller(tmp_path, TIMINGS, clock=clock)
    beat(c, 1, 500, 7, following=True, silent_ms=10)  # a slave reports first
    told = beat(c, 2, 520, 7, master=True, in_sync=[1])
    s = c.sets["a"]
    assert (s.epoch, s.master_id, s.in_sync, s.election) == (7, 2, [1], None)
    assert told.master_id == 2 and told.lease_ms == 2000 and not told.electing
    assert beat(c, 1, 520, 7, following=True).master_id == 2
    clock.now += 3.5  # and a failover later bumps the epoch from there
    beat(c, 1, 520, 7, silent_ms=3400)
    c.scan(clock.now)
    beat(c, 1, 520, 7, silent_ms=3500)
    c.scan(clock.now)
    assert (s.master_id, s.epoch) == (1, 8)
