"""The controller's elections on a clock the test moves: the first replica of a new set
becomes master; a silent master is replaced only after its lease ran out, by the alive
replica that reaches furthest on the newest epoch; a deposed master back with an old tail
is never chosen; a restarted master loses its role; the state survives a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from txmq.namesrv.controller import Controller, ControllerTimings
from txmq.wire import ControllerAnswer, ControllerHeartbeat

TIMINGS = ControllerTimings(heartbeat_timeout_s=3.0, lease_s=2.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def beat(
    c: Controller, broker_id: int, offset: int, epoch: int, *, master: bool = False
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
    )
    call: Any = None
    return c.heartbeat(req, call)


def test_first_replica_becomes_master_and_only_it_gets_a_lease(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    a0 = beat(c, 0, 0, 1)
    assert (a0.master_id, a0.epoch, a0.lease_ms) == (0, 1, 2000)
    a1 = beat(c, 1, 0, 1)
    assert (a1.master_id, a1.lease_ms, a1.master_ha_address) == (0, 0, "127.0.0.1:10912")


def test_a_silent_master_is_replaced_by_the_furthest_replica_after_its_lease(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    beat(c, 0, 0, 1)
    beat(c, 0, 500, 1, master=True)
    for _ in range(5):  # the master dies at the 5th step; the slaves keep reporting
        clock.now += 0.5
        beat(c, 1, 400, 1)
        beat(c, 2, 450, 1)
        c.scan(clock.now)
    assert c.sets["a"].master_id == 0  # 2.5 s of silence: not yet (the lease may run)
    clock.now += 0.6
    beat(c, 1, 400, 1)
    beat(c, 2, 450, 1)
    c.scan(clock.now)
    s = c.sets["a"]
    assert (s.master_id, s.epoch, s.history) == (2, 2, [(1, 0), (2, 2)])
    told = beat(c, 2, 450, 1)
    assert told.master_id == 2 and told.epoch == 2 and told.lease_ms == 2000
    # the old master comes back with a tail nobody has; it is told to follow broker 2
    back = beat(c, 0, 900, 1)
    assert back.master_id == 2 and back.lease_ms == 0


def test_a_replica_still_on_an_older_epoch_is_never_chosen(tmp_path: Path, clock: Clock) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    beat(c, 1, 0, 1)  # broker 1 first: the master of epoch 1
    beat(c, 1, 100, 1, master=True)
    clock.now += 3.5  # broker 1 silent
    beat(c, 2, 100, 1)
    c.scan(clock.now)
    assert c.sets["a"].master_id == 2 and c.sets["a"].epoch == 2
    beat(c, 2, 300, 2, master=True)
    beat(c, 1, 250, 1)  # back with its own tail (offset 250 of epoch 1), not cut yet
    beat(c, 0, 290, 2)  # a slave of broker 2
    clock.now += 3.5  # broker 2 silent now
    beat(c, 1, 250, 1)
    beat(c, 0, 290, 2)
    c.scan(clock.now)
    assert c.sets["a"].master_id == 0  # epoch 2's furthest, not broker 1's longer epoch 1


def test_a_restarted_master_loses_its_role_and_the_election_waits_for_fresh_reports(
    tmp_path: Path, clock: Clock
) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    beat(c, 0, 0, 1)
    beat(c, 0, 500, 1, master=True)
    beat(c, 1, 500, 1)
    clock.now += 0.5
    again = beat(c, 0, 500, 1)  # back as a slave (a restart), before any time-out
    assert again.master_id == -1  # no master until the election
    c.scan(clock.now)
    assert c.sets["a"].epoch == 1  # not yet: broker 1's report is older than the restart
    clock.now += 0.8
    beat(c, 1, 500, 1)
    c.scan(clock.now)
    s = c.sets["a"]
    assert s.epoch == 2 and s.master_id in (0, 1)


def test_the_state_survives_a_controller_restart(tmp_path: Path, clock: Clock) -> None:
    c = Controller(tmp_path, TIMINGS, clock=clock)
    beat(c, 0, 0, 1)
    beat(c, 0, 10, 1, master=True)
    again = Controller(tmp_path, TIMINGS, clock=clock)
    s = again.sets["a"]
    assert (s.master_id, s.epoch, s.history) == (0, 1, [(1, 0)])
    assert beat(again, 0, 10, 1, master=True).lease_ms == 2000
