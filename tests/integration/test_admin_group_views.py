"""Issue 31, items 8 and 9, against a real ``txmq broker start`` process: ``admin group
list`` shows the groups that consume (members, lag, config), ``group connections`` and
``group progress`` show a group's members and offsets, ``topic delete`` asks for --yes;
in an 80-column terminal every table fits 80 characters, ``--wide`` keeps every column,
through a pipe tables stay whole, and ``--json`` is the same whatever the width."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.acl_support import SECRETS, policy, secured_broker
from tests.conftest import BrokerProcess, wait_for
from txmq.observability.fmt import iso_ms, ms_time
from txmq.protocol.message import Message
from txmq.sync import Producer, PullConsumer, PushConsumer, TransactionProducer

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    """``txmq ARGS``; ``columns``: in a terminal that wide (a pseudo-terminal, $COLUMNS),
    else with stdout a pipe."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    cmd = [sys.executable, "-m", "txmq.cli", *args]
    if columns is None:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    master, slave = os.openpty()
    proc = subprocess.Popen(
        cmd, stdout=slave, stderr=subprocess.PIPE, cwd=ROOT, env={**env, "COLUMNS": str(columns)}
    )
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    _, err = proc.communicate(timeout=60)
    text = out.decode().replace("\r\n", "\n")
    return subprocess.CompletedProcess(cmd, proc.returncode, text, err.decode())


def as_json(*args: str) -> Any:
    out = cli(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.timeout(360)  # some thirty CLI processes: 40 s alone, minutes beside the suite
def test_groups_connections_progress_delete_and_narrow_tables(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    bp = broker_process().start()
    at = ("--broker", bp.address)
    with Producer(bp.address) as p:
        for i in range(6):
            p.send(Message("orders", f"order {i}".encode()), queue_id=i % 4)
    # a group with committed offsets and nobody connected
    with PullConsumer(bp.address, group="audit") as c:
        c.commit_offset("orders", 0, 1)
    seen: list[bytes] = []
    consumer = PushConsumer(
        bp.address,
        group="billing",
        listener=lambda m: seen.append(m.body),
        consume_from="FIRST_OFFSET",
        persist_interval=0.2,
    )
    consumer.subscribe("orders", "*")
    with consumer, TransactionProducer(bp.address, group="tx-group") as tx:
        tx.send_half(
            Message("tx-orders", b"o"), transaction_id="T-" + "x" * 40, check_immunity_s=3600
        )

        def caught_up() -> list[Any] | None:
            rows = as_json("admin", "group", "list", *at)
            billing = [r for r in rows if r["group"] == "billing"]
            return rows if billing and billing[0]["lag"] == 0 else None

        rows = wait_for(caught_up, timeout=30, interval=0.3)
        by_name = {r["group"]: r for r in rows}
        assert by_name["billing"] == {
            "group": "billing",
            "members": 1,
            "lag": 0,
            "topics": ["%RETRY%billing", "orders"]
            if "%RETRY%billing" in by_name["billing"]["topics"]
            else ["orders"],
            "config": False,
            "fifo": False,
            "retry_max_times": 16,
        }
        assert by_name["audit"]["members"] == 0 and by_name["audit"]["lag"] == 1
        assert by_name["audit"]["config"] is False

        [member] = as_json("admin", "group", "connections", "billing", *at)
        assert member["group"] == "billing" and member["client_id"]
        assert member["address"].startswith("127.0.0.1:")
        assert member["subscriptions"]["orders"] == "*"
        assert (member["consume_type"], member["message_model"]) == ("CONCURRENTLY", "CLUSTERING")
        table = cli("admin", "group", "connections", "billing", *at).stdout.splitlines()
        assert table[0].split()[:3] == ["CLIENT_ID", "ADDRESS", "TYPE"]
        assert "orders=*" in table[2]
        assert cli("admin", "group", "connections", "nobody", *at).stdout.strip() == (
            "consumer group nobody: no member is connected"
        )

        progress = as_json("admin", "group", "progress", "billing", *at)
        orders = [r for r in progress if r["topic"] == "orders"]
        assert sorted(r["queue_id"] for r in orders) == [0, 1, 2, 3]
        assert sum(r["max_offset"] for r in orders) == 6 and all(r["lag"] == 0 for r in orders)
        text = cli("admin", "group", "progress", "audit", *at).stdout.splitlines()
        assert text[0].split() == [
            "TOPIC", "QUEUE_ID", "BROKER_OFFSET", "CONSUMER_OFFSET", "LAG", "LAST_CONSUMED"
        ]  # fmt: skip
        assert text[2].split()[:5] == ["orders", "0", "2", "1", "1"]
        assert text[-1] == "total lag: 1"

        # every table fits 80 characters; --wide and a pipe keep every column; JSON the same
        for args in (
            ("admin", "cluster"),
            ("admin", "transactions", "--pending"),
            ("admin", "group", "list"),
            ("admin", "group", "connections", "billing"),
            ("admin", "offsets"),
            ("admin", "topics"),
            ("admin", "broker-info"),
        ):
            narrow = cli(*args, *at, columns=80)
            assert narrow.returncode == 0, narrow.stderr
            lines = narrow.stdout.splitlines()
            assert lines and all(len(line) <= 80 for line in lines), (args, narrow.stdout)
            # (uptimes and rates move between two runs: the columns and the keys do not)
            piped = cli(*args, *at).stdout.splitlines()
            assert cli(*args, *at, "--wide", columns=80).stdout.splitlines()[0] == piped[0]
            if args[-1] in ("cluster", "list"):  # (JSON never looks at the width: two will do)
                narrow_json = json.loads(cli(*args, *at, "--json", columns=80).stdout)
                assert [sorted(r) for r in narrow_json] == [sorted(r) for r in as_json(*args, *at)]
        wide = cli("admin", "cluster", *at).stdout.splitlines()
        assert max(map(len, wide)) > 80 and "MAX_OFFSET" in wide[0]
        narrow_head = cli("admin", "cluster", *at, columns=80).stdout.splitlines()[0].split()
        assert "MAX_OFFSET" not in narrow_head and {"BROKER", "ROLE", "LAG"} <= set(narrow_head)
        pending = cli("admin", "transactions", "--pending", *at, columns=80).stdout.splitlines()
        assert pending[0].split()[0] == "MSG_ID" and "TRANSACTION_ID" in wide_header(at)

    # topic delete: refused without --yes, in one line; done with it
    refused = cli("admin", "topic", "delete", "orders", *at)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        "txmq: error: deleting topic 'orders' drops its queues and messages: add --yes to do it"
    ]
    assert any(t["topic"] == "orders" for t in as_json("admin", "topics", *at))
    done = cli("admin", "topic", "delete", "orders", "--yes", *at)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "topic orders deleted (from every broker set holding it)"
    assert not any(t["topic"] == "orders" for t in as_json("admin", "topics", *at))
    assert bp.alive() and "Traceback" not in bp.output()


def test_group_progress_shows_when_the_last_consumed_message_was_stored(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    """LAST_CONSUMED (mqadmin's LastTime): the store time of the message before the
    committed offset, to the millisecond; - for offset 0 and for a message not there."""
    bp = broker_process().start()
    at = ("--broker", bp.address)
    with Producer(bp.address) as p:
        sent = [p.send(Message("orders", f"order {i}".encode()), queue_id=0) for i in range(3)]
        p.send(Message("orders", b"other"), queue_id=1)
        p.send(Message("orders", b"third"), queue_id=2)
    assert [s.queue_offset for s in sent] == [0, 1, 2]
    with PullConsumer(bp.address, group="audit") as c:
        c.commit_offset("orders", 0, 2)  # consumed offsets 0 and 1
        c.commit_offset("orders", 1, 0)  # nothing yet
        c.commit_offset("orders", 2, 5)  # past the end: there is no message at offset 4
    rows = {r["queue_id"]: r for r in as_json("admin", "group", "progress", "audit", *at)}
    last = sent[1].store_timestamp
    assert last > 0
    assert rows[0] == {
        "group": "audit",
        "topic": "orders",
        "queue_id": 0,
        "offset": 2,
        "max_offset": 3,
        "lag": 1,
        "last_consumed_timestamp": last,
        "last_consumed_time": iso_ms(last),
    }
    for q in (1, 2):
        assert rows[q]["last_consumed_timestamp"] is None, rows[q]
        assert rows[q]["last_consumed_time"] is None
    text = cli("admin", "group", "progress", "audit", *at)
    assert text.returncode == 0 and "could not be read" not in text.stderr, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split()[-1] == "LAST_CONSUMED"
    by_queue = {line.split()[1]: line for line in lines[2:-1]}
    assert by_queue["0"].endswith(ms_time(last))  # local time, to the millisecond
    assert by_queue["1"].split()[-1] == "-" and by_queue["2"].split()[-1] == "-"


def test_group_progress_under_access_control_without_the_right_to_read_has_no_time(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    """The time is read with a pull naming no consumer group: a user the broker does not
    let read the messages that way (no ``sub`` on group "", which a super user has) sees
    the offsets, no time, and a warning."""
    acl = policy({"bob": [("cluster", "admin"), ("topic:orders", "sub")]})
    bp = secured_broker(broker_process, tmp_path, acl)
    ops = {"access_key": "ops", "secret_key": SECRETS["ops"]}
    with Producer(bp.address, **ops) as p:
        p.send(Message("orders", b"x"), queue_id=0)
    with PullConsumer(bp.address, group="audit", **ops) as c:
        c.commit_offset("orders", 0, 1)
    for user, shown in (("ops", True), ("bob", False)):
        out = subprocess.run(
            [sys.executable, "-m", "txmq.cli", "admin", "group", "progress", "audit",
             "--broker", bp.address, "--json"],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
            env={**os.environ, "TXMQ_ACCESS_KEY": user, "TXMQ_SECRET_KEY": SECRETS[user]},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        [row] = json.loads(out.stdout)
        assert row["offset"] == 1 and (row["last_consumed_timestamp"] is not None) is shown
        warned = "the last consumed message of 1 queue(s) could not be read" in out.stderr
        assert warned is not shown, out.stderr


def wide_header(at: tuple[str, str]) -> list[str]:
    return cli("admin", "transactions", "--pending", *at).stdout.splitlines()[0].split()
