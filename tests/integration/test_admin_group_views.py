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

from tests.conftest import BrokerProcess, wait_for
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
        assert text[0].split() == ["TOPIC", "QUEUE_ID", "BROKER_OFFSET", "CONSUMER_OFFSET", "LAG"]
        assert text[2].split() == ["orders", "0", "2", "1", "1"]
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


def wide_header(at: tuple[str, str]) -> list[str]:
    return cli("admin", "transactions", "--pending", *at).stdout.splitlines()[0].split()
