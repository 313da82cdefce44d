"""Controllers on etcd, on real processes (issue 32, item 1): a three-member etcd cluster,
three ``txmq controller start --etcd`` processes, a name server, and a SYNC broker set of
three under load.  The leading controller SIGKILLed in steady state and in the middle of an
election, an etcd member SIGKILLed, a controller cut off from etcd: each time the set keeps
its master or gets a new one, and afterwards every acknowledged message is there exactly
once, the replicas' logs are byte-identical, and each epoch had one master."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.conftest import NamesrvProcess, ask, wait_for
from tests.etcd_cluster import EtcdCluster, etcd_cluster
from tests.integration.test_failover import check_everything_acknowledged_is_there_once
from tests.replicaset import ReplicaSet, Sender, replica_sets
from tests.tcp_proxy import TcpProxy
from txmq.protocol.wire import GetReplicaInfo
from txmq.protocol.wire.errors import ControllerNotLeader, TxmqError

__all__ = ["etcd_cluster", "replica_sets"]  # the fixtures

TOPIC = "jepsen"


def _controllers(
    namesrv_process: Callable[..., NamesrvProcess], etcd: list[str], n: int = 3
) -> list[NamesrvProcess]:
    out = []
    for i in range(n):
        c = namesrv_process(f"ctl{i}", kind="controller")
        c.args = ["--etcd", ",".join(etcd[i % len(etcd) :] + etcd[: i % len(etcd)])]
        out.append(c.start())
    return out


def _leader(ctls: list[NamesrvProcess]) -> int | None:
    """The index of the controller that leads now (None: none does)."""
    for i, c in enumerate(ctls):
        if not c.alive():
            continue
        try:
            ask(c.address, GetReplicaInfo(), timeout=2.0)
        except ControllerNotLeader:
            continue
        except TxmqError:
            continue
        return i
    return None


def _new_leader(ctls: list[NamesrvProcess], not_: int) -> int:
    found: int = wait_for(lambda: (i := _leader(ctls)) is not None and i != not_ and i + 1, 30)
    return found - 1


def _fail_over(rs: ReplicaSet) -> int:
    """SIGKILL the set's master, wait for another, start the old one again; the new one."""
    old = rs.wait_healthy()
    rs.kill(old)
    wait_for(lambda: rs.master() not in (-1, old), timeout=60)
    rs.restart(old)
    return rs.wait_healthy()


@pytest.mark.timeout(420)
def test_three_controllers_on_etcd_fail_over_through_controller_and_etcd_faults(
    etcd_cluster: Callable[..., EtcdCluster],
    namesrv_process: Callable[..., NamesrvProcess],
    replica_sets: Callable[..., ReplicaSet],
) -> None:
    etcd = etcd_cluster(3)
    ctls = _controllers(namesrv_process, etcd.endpoints)
    rs = replica_sets("sync", controllers=[c.address for c in ctls])
    first = rs.wait_healthy()
    sender = Sender(rs.namesrv.address, TOPIC).start()
    try:
        wait_for(lambda: sender.acked_count() >= 100, timeout=60)

        # 1. the leading controller SIGKILLed in steady state: the set keeps its master
        lead: int = wait_for(lambda: (i := _leader(ctls)) is not None and i + 1, 30) - 1
        ctls[lead].kill()
        lead = _new_leader(ctls, lead)
        state = rs.state()
        assert state is not None and state.master_id == first, state
        moment = time.monotonic()
        wait_for(lambda: sender.acked_since(moment), timeout=30)
        assert rs.master() == first

        # 2. the master SIGKILLed: the new leader elects another
        second = _fail_over(rs)
        assert second != first

        # 3. the leading controller SIGKILLed in the middle of an election
        ctls = [c if c.alive() else c.start() for c in ctls]
        master = rs.wait_healthy()
        rs.kill(master)
        wait_for(lambda: (s := rs.state()) is not None and bool(s.electing), timeout=30)
        dead = _leader(ctls)
        assert dead is not None
        ctls[dead].kill()
        wait_for(lambda: rs.master() not in (-1, master), timeout=60)
        rs.restart(master)
        rs.wait_healthy()
        ctls[dead].start()

        # 4. an etcd member SIGKILLed (etcd's leader): elections go on
        etcd.kill(etcd.leader())
        _fail_over(rs)
        moment = time.monotonic()
        wait_for(lambda: sender.acked_since(moment), timeout=30)
    finally:
        sender.stop()
    count = check_everything_acknowledged_is_there_once(rs, sender)
    state = rs.state()
    assert state is not None
    epochs = [e for e, _ in state.history]
    assert epochs == sorted(set(epochs)), state.history  # one master per epoch, in order
    print(f"{count} messages; history {state.history}; {len(sender.failed)} sends failed")


@pytest.mark.timeout(240)
def test_a_controller_cut_from_etcd_stops_leading_and_another_takes_over(
    etcd_cluster: Callable[..., EtcdCluster],
    namesrv_process: Callable[..., NamesrvProcess],
    replica_sets: Callable[..., ReplicaSet],
) -> None:
    """Every controller reaches etcd through a proxy of its own; the leader's proxy is
    blackholed (packets dropped, nothing closed): it must stop acting as the leader
    within its etcd lease, another takes over, and a master killed afterwards is replaced
    by the new leader."""
    etcd = etcd_cluster(3)
    proxies: list[list[TcpProxy]] = []
    ctls = []
    for i in range(3):
        mine = [TcpProxy(e).start() for e in etcd.endpoints]
        proxies.append(mine)
        c = namesrv_process(f"ctl{i}", kind="controller")
        c.args = ["--etcd", ",".join(p.address for p in mine)]
        ctls.append(c.start())
    try:
        rs = replica_sets("sync", controllers=[c.address for c in ctls])
        first = rs.wait_healthy()
        lead: int = wait_for(lambda: (i := _leader(ctls)) is not None and i + 1, 30) - 1
        cut_at = time.monotonic()
        for p in proxies[lead]:
            p.blackhole()
        # the cut leader says it does not lead once its lease could have run out
        wait_for(lambda: _leader(ctls) != lead, timeout=30)
        assert time.monotonic() - cut_at < 10
        new = _new_leader(ctls, lead)
        assert new != lead
        assert rs.master() == first  # the set kept its master
        second = _fail_over(rs)
        assert second != first
        for p in proxies[lead]:
            p.heal()
    finally:
        for mine in proxies:
            for p in mine:
                p.stop()
