"""How ``txmq admin cluster`` joins what each broker says of itself, what its set's master
says of it and what the controller says of the set — without servers: a slave's lag is its
master's view when the master answered, its own otherwise; a broker that did not answer is
known to the controller by its address; a replica only the controller knows gets a row; the
table shows one line per replicated set."""

from __future__ import annotations

from typing import Any

from txmq.admin.cluster import BrokerRow, _row, _with_replication
from txmq.admin.fanout import BrokerAddress
from txmq.cli.admin_ha import _broker_line, _set_lines
from txmq.protocol.wire import BrokerSetState, ReplicaState, RuntimeInfo


def info(broker_id: int, role: str, **fields: Any) -> RuntimeInfo:
    return RuntimeInfo(
        version="0.1.0",
        address=f"h:{broker_id}",
        pid=1,
        flush="async",
        store="s",
        uptime_s=1.0,
        connections=0,
        topics=0,
        commit_log_min_offset=0,
        commit_log_max_offset=0,
        flushed_offset=0,
        pending_transactions=0,
        cluster="C",
        broker_name="a",
        broker_id=broker_id,
        broker_role=role,
        **fields,
    )


def registered(registered_id: int, address: str, error: str = "") -> BrokerRow:
    return _row(BrokerAddress("C", "a", registered_id, address), error=error)


STATE = BrokerSetState(
    cluster="C",
    broker_name="a",
    epoch=3,
    master_id=2,
    in_sync=[1],
    replicas=[
        ReplicaState(broker_id=i, address=f"h:{i}", alive=i != 3, offset=100, silent_s=s)
        for i, s in ((0, 0.1), (1, 0.2), (2, 0.1), (3, 42.0))
    ],
)


def test_a_slave_s_lag_is_its_master_s_view_and_the_controller_fills_the_gaps() -> None:
    master = info(
        2,
        "SYNC_MASTER",
        epoch=3,
        in_sync=[1],
        slave_lag_bytes={0: 100, 1: 0},
        slave_lag_s={0: 1.5, 1: 0.0},
    )
    slave = info(0, "SLAVE", epoch=3, lag_bytes=40, master_address="h:2", last_contact_s=0.3)
    answers: list[tuple[BrokerRow, RuntimeInfo | None]] = [
        (registered(0, "h:2"), master),
        (registered(2, "h:0"), slave),  # a slave whose own id is 0 registers as its master's
        (registered(1, "h:1", error="cannot connect"), None),
    ]
    rows = _with_replication(answers, ("ctl:1", [STATE]), add_missing=True)
    by_id = {r.replica_id: r for r in rows}
    assert sorted(by_id) == [0, 1, 2, 3]
    m, s, silent, gone = by_id[2], by_id[0], by_id[1], by_id[3]
    assert (m.broker_role, m.epoch, m.slave_lag_bytes, m.in_sync) == ("SYNC_MASTER", 3, None, [1])
    # the master's view (100 bytes, 1.5 s), not the slave's own (40)
    assert (s.slave_lag_bytes, s.slave_lag_s, s.last_contact_s) == (100, 1.5, 0.3)
    assert (s.master_address, s.in_sync, s.broker_id) == ("h:2", [1], 2)
    # it did not answer: the controller knows it by its address
    assert silent.error == "cannot connect" and silent.controller is not None
    assert (silent.controller.alive, silent.controller.silent_s) == (True, 0.2)
    # only the controller knows this one
    assert (gone.broker_id, gone.address, gone.role) == (-1, "h:3", "SLAVE")
    assert gone.error.startswith("not registered with the name servers; not alive")
    assert "42 s ago" in gone.error
    assert all(
        r.controller is not None and (r.controller.epoch, r.controller.master_id) == (3, 2)
        for r in rows
    )

    lines = {line["id"]: line for line in (_broker_line(r, True) for r in rows)}
    assert (lines[0]["role"], lines[0]["slave_lag"], lines[0]["slave_lag_s"]) == ("SLAVE", 100, 1.5)
    assert (lines[3]["role"], lines[3]["epoch"]) == ("SLAVE", None)
    [line] = _set_lines(rows)
    assert line == {
        "cluster": "C",
        "broker": "a",
        "master": 2,
        "epoch": 3,
        "in_sync": "1",
        "controller": "ctl:1",
        "ctl_epoch": 3,
        "ctl_master": 2,
        "ctl_in_sync": "1",
        "electing": "no",
    }


def test_without_a_master_or_a_controller() -> None:
    slave = info(1, "SLAVE", epoch=2, lag_bytes=40, last_contact_s=-1.0)
    rows = _with_replication(
        [(registered(0, "h:0", error="down"), None), (registered(1, "h:1"), slave)],
        None,
        add_missing=True,
    )
    down, s = rows
    # the slave's own view; seconds not known; the in-sync set not known
    assert (s.slave_lag_bytes, s.slave_lag_s, s.in_sync, s.controller) == (40, None, None, None)
    assert down.replica_id == -1 and down.broker_role == ""
    assert _broker_line(s, True)["slave_lag_s"] is None
    [line] = _set_lines(rows)
    assert (line["master"], line["epoch"], line["in_sync"]) == (None, None, None)
    assert "controller" not in line


def test_a_broker_alone_has_no_set_table() -> None:
    alone = info(0, "ASYNC_MASTER")
    rows = _with_replication([(registered(0, "h:0"), alone)], None, add_missing=True)
    assert rows[0].in_sync == [] and _set_lines(rows) == []
    assert _broker_line(rows[0], False)["role"] == "ASYNC_MASTER"
