"""A controller on etcd (issue 32, item 1), with a leadership the test drives: only the
leader answers; an answer waits until the state it tells is saved; a refused write (the
controller was deposed) tells no one and turns the controller into a follower, whose
answers name the leader; a new leader takes the saved sets; a leader grants no lease past
its own leadership, so that its successor elects without waiting for one."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
import pytest

from tests.unit.test_controller import TIMINGS, Clock
from txmq.namesrv.controller import Controller, _SavedSet
from txmq.namesrv.etcd import Deposed
from txmq.protocol.peer import named_leader
from txmq.protocol.wire import ControllerAnswer, ControllerHeartbeat, GetReplicaInfo
from txmq.protocol.wire.errors import ControllerNotLeader


class Leadership:
    """What the controller needs of :class:`~txmq.namesrv.etcd.EtcdLeadership`."""

    endpoints = ("127.0.0.1:2379",)

    def __init__(self) -> None:
        self.leading = False
        self.valid_until = float("inf")
        self.leader_address = "127.0.0.1:9999"
        self.saved: list[dict[str, bytes]] = []
        self.gate = anyio.Event()  # a save waits for it
        self.refuse = False

    async def save(self, entries: dict[str, bytes]) -> None:
        await self.gate.wait()
        if self.refuse:
            self.leading = False
            raise Deposed("another controller leads")
        self.saved.append(dict(entries))

    async def run(self, on_lead: Any, on_follow: Any) -> None:
        await anyio.sleep_forever()


def heartbeat(broker_id: int, offset: int, epoch: int, **kw: Any) -> ControllerHeartbeat:
    return ControllerHeartbeat(
        cluster="C", broker_name="a", broker_id=broker_id,
        address=f"127.0.0.1:{10911 + 10 * broker_id}",
        ha_address=f"127.0.0.1:{10912 + 10 * broker_id}",
        offset=offset, epoch=epoch, **kw,
    )  # fmt: skip


def test_a_follower_names_the_leader_and_refuses_admin_requests() -> None:
    lead = Leadership()
    c = Controller(None, TIMINGS, clock=Clock(), leadership=lead)  # type: ignore[arg-type]

    async def run() -> ControllerAnswer:
        return await c._heartbeat_led(heartbeat(0, 0, 1), None)

    answer = anyio.run(run)
    assert answer.follower and answer.leader == "127.0.0.1:9999"
    with pytest.raises(ControllerNotLeader, match=r"the leader is at 127\.0\.0\.1:9999") as err:
        c._replica_info_led(GetReplicaInfo(), None)
    assert named_leader(err.value) == "127.0.0.1:9999"  # clients parse it


def test_an_answer_waits_for_its_save_and_a_refused_save_tells_no_one() -> None:
    clock = Clock()
    lead = Leadership()
    c = Controller(None, TIMINGS, clock=clock, leadership=lead)  # type: ignore[arg-type]
    saved = {"a": msgspec.json.encode(_SavedSet("C", epoch=3, master_id=1, in_sync=[2]))}
    lead.leading = True
    c._lead(saved)
    assert c.sets["a"].epoch == 3 and c.sets["a"].master_id == 1
    got: list[ControllerAnswer] = []
    arrived = [anyio.Event(), anyio.Event()]

    async def answer(req: ControllerHeartbeat) -> None:
        got.append(await c._heartbeat_led(req, None))
        arrived[len(got) - 1].set()

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(c._writer)
            # the master proposes a new sync state set: saved before the answer leaves
            tg.start_soon(answer, heartbeat(1, 100, 3, master=True, in_sync=[2, 0]))
            await anyio.wait_all_tasks_blocked()
            assert got == [] and c.sets["a"].in_sync == [0, 2]  # decided, not told yet
            lead.gate.set()
            with anyio.fail_after(5):
                await arrived[0].wait()
            assert got[0].in_sync == [0, 2] and not got[0].follower
            [entries] = lead.saved
            assert msgspec.json.decode(entries["a"], type=_SavedSet).in_sync == [0, 2]
            # deposed: the next change is refused, the answer names the leader instead
            lead.refuse = True
            tg.start_soon(answer, heartbeat(1, 200, 3, master=True, in_sync=[2]))
            with anyio.fail_after(5):
                await arrived[1].wait()
            assert got[1].follower and got[1].leader == "127.0.0.1:9999"
            assert c.sets == {}  # the state is the leader's now
            tg.cancel_scope.cancel()

    anyio.run(run)


def test_no_lease_outlives_the_leadership_and_a_successor_waits_for_none() -> None:
    """A leader's answer grants the master at most what is left of its own leadership.
    Its successor (every lease ended before it could lead) fails a dead master over as
    soon as an in-sync slave says the master is gone — not ``lease_s`` (TIMINGS: 2 s)
    after it took over."""
    clock = Clock()
    old = Leadership()
    c = Controller(None, TIMINGS, clock=clock, leadership=old)  # type: ignore[arg-type]
    saved = {"a": msgspec.json.encode(_SavedSet("C", epoch=3, master_id=1, in_sync=[2]))}
    old.leading, old.valid_until = True, clock.now + 0.8
    c._lead(saved)
    answer = c.heartbeat(heartbeat(1, 100, 3, master=True, in_sync=[2]), None)
    assert 790 <= answer.lease_ms <= 800  # not TIMINGS.lease_s: the leadership ends sooner
    old.valid_until = clock.now + 5
    assert c.heartbeat(heartbeat(1, 100, 3, master=True, in_sync=[2]), None).lease_ms == 2000

    clock.now += 3  # the leader died with the master; another took over
    new = Leadership()
    d = Controller(None, TIMINGS, clock=clock, leadership=new)  # type: ignore[arg-type]
    new.leading = True
    d._lead(saved)
    assert d.heartbeat(heartbeat(2, 100, 3, following=True, master_silent_ms=3100), None).electing
    d.heartbeat(heartbeat(2, 100, 3, master_silent_ms=3100), None)  # it stopped
    clock.now += 0.05
    d.scan(clock.now)
    s = d.sets["a"]
    assert (s.master_id, s.epoch) == (2, 4), s.election
