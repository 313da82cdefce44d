"""``txmq admin cluster`` and ``txmq admin switchover`` on a replicated broker set, as real
processes: a name server with the controller inside, and broker set ``a`` of a SYNC_MASTER
and two slaves under it (``tests/replicaset.py``).  The cluster view shows each broker's
role, epoch and lag, the set's in-sync slaves and the controller's view; a switchover moves
the master (a new epoch) and sends follow it; a switchover that cannot happen says why in
one line."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import NamesrvProcess, ask, free_port, wait_for
from tests.integration.test_cli import txmq
from tests.replicaset import SET, ReplicaSet, consume_all, replica_sets
from txmq import Message
from txmq.protocol.wire import GetBrokerRuntimeInfo
from txmq.sync import Producer

__all__ = ["replica_sets"]  # the fixture

TOPIC = "switched"


@pytest.fixture
def replica_set(replica_sets: Callable[..., ReplicaSet]) -> ReplicaSet:
    return replica_sets("sync")


def cluster(namesrv: str) -> list[dict[str, Any]]:
    """``txmq admin cluster --json`` through the name server: the rows of set ``a``."""
    out = txmq("admin", "cluster", "--namesrv", namesrv, "--json", check=False)
    assert out.returncode == 0, out.stderr
    return [r for r in json.loads(out.stdout) if r["broker_name"] == SET]


def settled(namesrv: str, master: int, epoch: int) -> list[dict[str, Any]] | None:
    """The rows of set ``a`` once every broker says it: ``master`` is the SYNC_MASTER of
    ``epoch`` (registered as broker 0), the others its slaves, connected to it with nothing
    to copy, all of them in sync — and the controller agrees."""
    rows = cluster(namesrv)
    ids = {r["replica_id"] for r in rows}
    slaves = sorted(ids - {master})
    roles = {r["replica_id"]: (r["broker_role"], r["role"], r["broker_id"] == 0) for r in rows}
    want = {i: ("SLAVE", "SLAVE", False) for i in slaves}
    want[master] = ("SYNC_MASTER", "MASTER", True)
    if len(rows) != 3 or roles != want or any(r["error"] for r in rows):
        return None
    if any(r["epoch"] != epoch or r["in_sync"] != slaves for r in rows):
        return None
    # (the master's view of each slave: it is connected to it, and has nothing to copy)
    lags = [(r["slave_lag_bytes"], r["slave_lag_s"]) for r in rows if r["replica_id"] != master]
    if lags != [(0, 0.0)] * len(slaves):
        return None
    views = [r["controller"] for r in rows]
    if any(v is None or (v["epoch"], v["master_id"], v["in_sync"]) != (epoch, master, slaves)
           for v in views):  # fmt: skip
        return None
    return rows


def send_numbers(namesrv: str, numbers: range) -> None:
    with Producer(namesrv=namesrv) as producer:
        for n in numbers:
            r = producer.send(Message(TOPIC, str(n).encode()))
            assert (r.status, r.broker_name) == ("SEND_OK", SET), r


def test_cluster_shows_the_set_and_a_switchover_moves_the_master(replica_set: ReplicaSet) -> None:
    rs = replica_set
    ns = rs.namesrv.address
    first = rs.wait_healthy()
    state = rs.state()
    assert state is not None
    epoch = state.epoch
    assert epoch >= 1
    send_numbers(ns, range(20))

    # one master and two slaves, with their epochs, lag and the in-sync set
    rows = wait_for(lambda: settled(ns, first, epoch), timeout=30, interval=0.2)
    by_id = {r["replica_id"]: r for r in rows}
    slaves = sorted(set(by_id) - {first})
    assert slaves == sorted(set(rs.brokers) - {first})
    assert {r["address"] for r in rows} == {b.address for b in rs.brokers.values()}
    assert len({r["commit_log_max_offset"] for r in rows}) == 1  # nothing left to copy
    assert by_id[first]["commit_log_max_offset"] > 0
    for i in slaves:
        s = by_id[i]
        assert s["slave_lag_s"] == 0.0 and s["master_address"] == by_id[first]["address"]
        assert 0 <= s["last_contact_s"] < 10
        assert s["controller"]["alive"] is True
    assert by_id[first]["slave_lag_bytes"] is None and by_id[first]["controller"]["electing"] == ""

    # each broker's runtime information says its part
    master = ask(rs.brokers[first].address, GetBrokerRuntimeInfo())
    assert (master.broker_role, master.broker_id, master.epoch) == ("SYNC_MASTER", first, epoch)
    assert master.in_sync == slaves and master.controllers == [ns] and master.controlled
    assert master.slave_lag_bytes == dict.fromkeys(slaves, 0)
    assert master.slave_lag_s == dict.fromkeys(slaves, 0.0)
    for i in slaves:
        slave = ask(rs.brokers[i].address, GetBrokerRuntimeInfo())
        assert (slave.broker_role, slave.broker_id, slave.epoch) == ("SLAVE", i, epoch)
        assert (slave.master_id, slave.master_address) == (first, rs.brokers[first].address)
        assert slave.master_ha_address == master.ha_address and slave.connected
        assert slave.lag_bytes == 0 and 0 <= slave.last_contact_s < 10
        [shown_info] = json.loads(
            txmq("admin", "broker-info", "--broker", rs.brokers[i].address, "--json").stdout
        )
        assert shown_info["broker_role"] == "SLAVE" and shown_info["master_id"] == first
        assert "in_sync" not in shown_info and "slave_lag_bytes" not in shown_info

    # the table: a line per broker (its own id, role, epoch, lag), then one per set
    table = txmq("admin", "cluster", "--namesrv", ns).stdout
    brokers, sets = table.split("\n\n")
    lines = brokers.splitlines()
    assert lines[0].split()[:8] == [
        "CLUSTER", "BROKER", "ID", "ROLE", "ADDRESS", "EPOCH", "SLAVE_LAG", "SLAVE_LAG_S"
    ]  # fmt: skip
    assert lines[0].split()[-3:] == ["PUT/S", "GET/S", "LAG"]
    shown = {int(c[2]): (c[3], int(c[5]), c[6], c[7]) for c in map(str.split, lines[2:])}
    assert shown == {
        first: ("SYNC_MASTER", epoch, "-", "-"),
        **{i: ("SLAVE", epoch, "0", "0.0") for i in slaves},
    }
    head, _, line = sets.splitlines()
    assert head.split() == [
        "CLUSTER", "BROKER", "MASTER", "EPOCH", "IN_SYNC",
        "CONTROLLER", "CTL_EPOCH", "CTL_MASTER", "CTL_IN_SYNC", "ELECTING",
    ]  # fmt: skip
    in_sync = ",".join(map(str, slaves))
    assert line.split() == ["C", SET, str(first), str(epoch), in_sync, ns, str(epoch),
                            str(first), in_sync, "no"]  # fmt: skip

    # a planned switchover to a slave (the options before the subcommand)
    target = slaves[-1]
    out = txmq(
        "admin", "--namesrv", ns, "switchover", "--broker-name", SET, "--to", str(target),
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"broker set {SET}: broker {target} ({rs.brokers[target].address}) is the master in "
        f"epoch {epoch + 1} (was broker {first} in epoch {epoch})"
    ]
    state = rs.state()
    assert state is not None and (state.master_id, state.epoch) == (target, epoch + 1)

    # the new roles: the old master follows the new one, in sync again
    rows = wait_for(lambda: settled(ns, target, epoch + 1), timeout=30, interval=0.2)
    old = next(r for r in rows if r["replica_id"] == first)
    assert old["master_address"] == rs.brokers[target].address
    assert old["slave_lag_bytes"] == 0 and old["slave_lag_s"] == 0.0

    # sends through the name server reach the new master (SEND_OK: a slave confirmed them)
    send_numbers(ns, range(20, 40))
    rows = wait_for(lambda: settled(ns, target, epoch + 1), timeout=30, interval=0.2)
    offsets = {r["replica_id"]: r["commit_log_max_offset"] for r in rows}
    assert (
        len(set(offsets.values())) == 1 and offsets[target] > by_id[first]["commit_log_max_offset"]
    )
    assert consume_all(ns, TOPIC, group="after-switchover") == Counter(range(40))
    assert "now the SYNC_MASTER" in rs.brokers[target].output()

    # a switchover to the master there is changes nothing
    out = txmq("admin", "switchover", "--broker-name", SET, "--to", str(target), "--namesrv", ns)
    assert out.stdout.splitlines() == [
        f"broker set {SET}: broker {target} is the master already (epoch {epoch + 1}); "
        "nothing changed"
    ]
    state = rs.state()
    assert state is not None and (state.master_id, state.epoch) == (target, epoch + 1)


def one_error(*args: str) -> str:
    """``txmq ARGS``, which must fail with one line on stderr: that line."""
    out = txmq(*args, check=False)
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("txmq: error: ")
    return lines[0]


def test_a_switchover_that_cannot_happen_says_why(
    replica_set: ReplicaSet, namesrv_process: Callable[..., NamesrvProcess]
) -> None:
    rs = replica_set
    ns = rs.namesrv.address
    first = rs.wait_healthy()
    state = rs.state()
    assert state is not None
    epoch = state.epoch
    victim = max(set(rs.brokers) - {first})

    def switch(*args: str) -> str:
        return one_error("admin", "switchover", "--broker-name", *args)

    said = switch("zz", "--to", "1", "--namesrv", ns)
    assert f"the controller at {ns} knows no broker set 'zz' (known: {SET})" in said
    said = switch(SET, "--to", "7", "--namesrv", ns)
    assert "broker 7 is not a replica of broker set a (the controller knows 0, 1, 2)" in said

    # the master already; a broker given directly names its controller
    out = txmq(
        "admin", "switchover", "--broker-name", SET, "--to", str(first),
        "--broker", rs.brokers[victim].address,
    )  # fmt: skip
    assert out.stdout.splitlines() == [
        f"broker set {SET}: broker {first} is the master already (epoch {epoch}); nothing changed"
    ]

    # nothing listens there; a name server without a controller
    nowhere = f"127.0.0.1:{free_port()}"
    said = switch(SET, "--to", str(victim), "--controller", nowhere)
    assert said.startswith("txmq: error: no controller is reachable (") and nowhere in said
    plain = namesrv_process("plain").start()
    said = switch(SET, "--to", str(victim), "--namesrv", plain.address)
    assert f"{plain.address} hosts no controller" in said and "--controller HOST:PORT" in said

    # a dead broker: the controller stops counting it alive, and a switchover to it fails
    rs.kill(victim)

    def dead() -> bool:
        s = rs.state()
        return s is not None and any(r.broker_id == victim and not r.alive for r in s.replicas)

    wait_for(dead, timeout=30, interval=0.1)
    said = switch(SET, "--to", str(victim), "--controller", ns)
    assert f"broker {victim} of broker set a is not alive (the controller last heard" in said
    state = rs.state()
    assert state is not None and (state.master_id, state.epoch) == (first, epoch)

    # admin cluster shows it: the name server dropped it, the controller knows it is gone
    def shown_dead() -> dict[str, Any] | None:
        rows = {r["replica_id"]: r for r in cluster(ns)}
        row = rows.get(victim)
        if row is None or row["broker_id"] != -1 or len(rows) != 3:
            return None
        return row

    row = wait_for(shown_dead, timeout=30, interval=0.2)
    assert row["controller"]["alive"] is False and "not alive" in row["error"]
    assert row["address"] == rs.brokers[victim].address
    rows = {r["replica_id"]: r for r in cluster(ns)}
    assert rows[first]["broker_role"] == "SYNC_MASTER" and rows[first]["epoch"] == epoch
    # the master still sends (the other slave is in sync)
    send_numbers(ns, range(5))


def test_switchover_help_and_misplaced_options() -> None:
    shown = txmq("admin", "switchover", "--help").stdout
    assert "txmq admin switchover --broker-name broker-a --to 1 --namesrv" in shown
    assert "--to ID" in shown and "--timeout S" in shown and "--controller HOST:PORT" in shown
    assert "txmq admin switchover" in txmq("admin", "--help").stdout
    assert "--controller 127.0.0.1:9878" in txmq("admin", "cluster", "--help").stdout
    said = one_error("admin", "--controller", "127.0.0.1:9878", "topics")
    assert "--controller is for 'txmq admin cluster' and 'txmq admin switchover'" in said
    said = one_error("admin", "switchover", "--broker-name", "a", "--controller", "nowhere")
    assert "--controller: 'nowhere' is not HOST:PORT" in said
