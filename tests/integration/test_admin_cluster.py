"""``txmq admin`` over a cluster, as real processes: two name servers, two brokers, every
admin view answering for both broker sets through ``--namesrv`` (given after the
subcommand), and the mistakes an operator makes getting one line each."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import BrokerProcess, NamesrvProcess, free_port, wait_for
from tests.integration.test_cli import txmq
from txmq import Message
from txmq.protocol.message import MessageExt
from txmq.sync import Producer, PushConsumer, TransactionProducer

NamesrvFactory = Callable[..., NamesrvProcess]
BrokerFactory = Callable[..., BrokerProcess]


def admin(namesrv: str, *args: str) -> Any:
    """``txmq admin ARGS --namesrv NAMESRV --json`` (the options after the subcommand)."""
    out = txmq("admin", *args, "--namesrv", namesrv, "--json", check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# ~30 `txmq admin` processes (a second each on an idle machine, several on a loaded one) and
# waits of up to 30 s each: the suite's 120 s was missed under four workers on 2 cores
@pytest.mark.timeout(360)
def test_every_admin_view_answers_for_the_whole_cluster(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    names = [namesrv_process(f"ns{i}").start() for i in range(2)]
    ns = [n.address for n in names]
    namesrv = ";".join(ns)
    a, b = (cluster_broker(f"broker-{x}", ns).start() for x in "ab")
    address = {"broker-a": a.address, "broker-b": b.address}

    # the cluster: both brokers, with their addresses, as masters
    rows = admin(namesrv, "cluster")
    assert [(r["cluster"], r["broker_name"], r["address"], r["role"]) for r in rows] == [
        ("C", "broker-a", a.address, "MASTER"),
        ("C", "broker-b", b.address, "MASTER"),
    ]
    assert all(r["version"] and r["uptime_s"] >= 0 and not r["error"] for r in rows)
    table = txmq("admin", "cluster", "--namesrv", namesrv).stdout.splitlines()
    assert table[0].split()[:5] == ["CLUSTER", "BROKER", "ID", "ROLE", "ADDRESS"]
    assert {line.split()[4] for line in table[2:]} == {a.address, b.address}
    # a broker asked directly names itself as it registers
    [alone] = json.loads(txmq("admin", "cluster", "--broker", a.address, "--json").stdout)
    assert (alone["cluster"], alone["broker_name"], alone["address"]) == (
        "C",
        "broker-a",
        a.address,
    )

    # topic-create --cluster: the topic on both broker sets, and routed over both
    created = admin(namesrv, "topic-create", "ledger", "--queues", "2", "--cluster", "C")
    assert created == [
        {"topic": "ledger", "queue_nums": 4, "brokers": {"broker-a": 2, "broker-b": 2}}
    ]
    for topic in ("poison", "tx-orders"):
        admin(namesrv, "topic-create", topic, "--queues", "2", "--cluster", "C")
    # --broker-name: one broker set only
    assert admin(namesrv, "topic-create", "only-b", "--broker-name", "broker-b")[0]["brokers"] == {
        "broker-b": 4
    }

    def routed(topic: str) -> list[Any] | None:
        """The topic's route once both broker sets registered it (right after creating)."""
        out = txmq("admin", "route", topic, "--namesrv", namesrv, "--json", check=False)
        rows = json.loads(out.stdout) if out.returncode == 0 else []
        return rows if len(rows) == 2 else None

    for topic in ("poison", "tx-orders"):
        wait_for(lambda t=topic: routed(t), timeout=15, interval=0.1)
    route = wait_for(lambda: routed("ledger"), timeout=15, interval=0.1)
    assert [(r["broker_name"], r["read_queues"], r["write_queues"], r["perm"]) for r in route] == [
        ("broker-a", 2, 2, "rw"),
        ("broker-b", 2, 2, "rw"),
    ]
    assert [r["addresses"] for r in route] == [{"0": a.address}, {"0": b.address}]

    # messages through the name servers, spread over both broker sets
    with Producer(namesrv=namesrv) as producer:
        sent = [
            producer.send(Message("ledger", b"entry %d" % i, keys=[f"k{i}", "shared"]))
            for i in range(40)
        ]
        poison = [producer.send(Message("poison", b"bad %d" % i)) for i in range(8)]
    assert {r.broker_name for r in sent} == {r.broker_name for r in poison} == set(address)
    # each broker's produce rate (messages stored per second, the last minute) shows them
    assert all(r["put_tps"] > 0 for r in admin(namesrv, "cluster")), admin(namesrv, "cluster")

    topics = {t["topic"]: t for t in admin(namesrv, "topics")}
    assert topics["ledger"]["queue_nums"] == 4 and topics["ledger"]["messages"] == 40
    assert topics["ledger"]["brokers"] == {"broker-a": 2, "broker-b": 2}
    assert topics["only-b"]["brokers"] == {"broker-b": 4}
    stats = admin(namesrv, "topic-stats", "ledger")
    assert sorted((q["broker_name"], q["queue_id"]) for q in stats) == [
        (x, q) for x in ("broker-a", "broker-b") for q in range(2)
    ]
    assert sum(q["max_offset"] for q in stats) == 40

    on_b = next(r for r in sent if r.broker_name == "broker-b")
    [found] = admin(namesrv, "message", "--id", on_b.msg_id)
    assert (found["broker_name"], found["msg_id"], found["topic"]) == (
        "broker-b",
        on_b.msg_id,
        "ledger",
    )
    by_key = admin(namesrv, "message", "--key", "shared", "--max", "100")
    assert sorted(m["msg_id"] for m in by_key) == sorted(r.msg_id for r in sent)
    assert {m["broker_name"] for m in by_key} == set(address)
    missing = txmq("admin", "message", "--id", "F" * 32, "--namesrv", namesrv, check=False)
    assert missing.returncode == 1 and "no message with id" in missing.stderr

    # consume: offsets on both brokers; every poison message dead-lettered where it was
    got: set[str] = set()
    lock = threading.Lock()

    def read(msg: MessageExt) -> None:
        with lock:
            got.add(msg.msg_id)

    reader = PushConsumer(namesrv=namesrv, group="reader", listener=read,
                          consume_from="FIRST_OFFSET")  # fmt: skip
    reader.subscribe("ledger")
    refuser = PushConsumer(namesrv=namesrv, group="refuser", listener=lambda m: False,
                           consume_from="FIRST_OFFSET", max_reconsume_times=0)  # fmt: skip
    refuser.subscribe("poison")
    with reader, refuser:
        wait_for(lambda: len(got) == 40, timeout=30)

        def dead_letters() -> list[Any] | None:
            rows = admin(namesrv, "dlq", "list", "--group", "refuser")
            return rows if len(rows) == 8 else None

        dead = wait_for(dead_letters, timeout=30, interval=0.2)
    assert sorted(d["origin_msg_id"] for d in dead) == sorted(r.msg_id for r in poison)
    assert {d["broker_name"] for d in dead} == set(address)

    def consumed() -> list[Any] | None:
        rows = [o for o in admin(namesrv, "offsets") if o["group"] == "reader"]
        return rows if sum(o["offset"] for o in rows) == 40 else None

    offsets = wait_for(consumed, timeout=30, interval=0.2)
    assert {o["broker_name"] for o in offsets} == set(address)
    assert all(o["lag"] == 0 and o["topic"] == "ledger" for o in offsets)
    # each broker's consume rate shows the pulls; its lag grows by what arrives that the
    # groups have not consumed yet
    rows = admin(namesrv, "cluster")
    assert all(r["get_tps"] > 0 for r in rows), rows
    lag_before = {r["broker_name"]: r["lag"] for r in rows}
    # enough that each broker's put rate shows them even when the earlier sends have left
    # its 60 s window (a slow run): 1 put in 60 s rounds to 0.0/s, 10 to 0.2/s
    with Producer(namesrv=namesrv) as producer:
        late = Counter(producer.send(Message("ledger", b"late")).broker_name for _ in range(30))
    assert set(late) == set(address)
    lag_now = {b: lag_before[b] + late[b] for b in address}

    def lagging() -> list[Any] | None:
        rows = admin(namesrv, "cluster")
        return rows if {r["broker_name"]: r["lag"] for r in rows} == lag_now else None

    wait_for(lagging, timeout=15, interval=0.2)
    table = txmq("admin", "cluster", "--namesrv", namesrv).stdout.splitlines()
    assert table[0].split()[-3:] == ["PUT/S", "GET/S", "LAG"]
    shown = {line.split()[1]: line.split()[-3:] for line in table[2:]}
    assert {b: int(cols[2]) for b, cols in shown.items()} == lag_now
    assert all(float(cols[0]) > 0 and float(cols[1]) > 0 for cols in shown.values()), table
    assert admin(namesrv, "dlq", "resend", "--group", "refuser", "--all") == [
        {"group": "refuser", "resent": 8}
    ]

    # undecided transactions, from both brokers (no check-back for an hour)
    with TransactionProducer(namesrv=namesrv, group="tx-group") as tx:
        halves = [
            tx.send_half(Message("tx-orders", b"o"), transaction_id=f"T{i}", check_immunity_s=3600)
            for i in range(8)
        ]
        pending = admin(namesrv, "transactions", "--pending")
        assert sorted(p["transaction_id"] for p in pending) == [f"T{i}" for i in range(8)]
        assert {(p["broker_name"], p["msg_id"]) for p in pending} == {
            (h.broker_name, h.msg_id) for h in halves
        }
        assert {p["broker_name"] for p in pending} == set(address)
        by_broker = admin(namesrv, "transactions", "--pending", "--broker-name", "broker-a")
        assert {p["broker_name"] for p in by_broker} == {"broker-a"}
        assert len(by_broker) == sum(h.broker_name == "broker-a" for h in halves)
        table = txmq("admin", "transactions", "--pending", "--namesrv", namesrv).stdout
        assert table.splitlines()[0].split()[0] == "BROKER_NAME"

    # broker-info: every broker, one column each
    infos = admin(namesrv, "broker-info")
    assert [(i["broker_name"], i["address"]) for i in infos] == sorted(address.items())

    # one name server down (listed first): the other answers for the cluster
    assert names[0].terminate() == 0
    with_dead = f"{ns[0]};{ns[1]}"
    assert [r["broker_name"] for r in admin(with_dead, "cluster")] == ["broker-a", "broker-b"]
    assert "ledger" in {t["topic"] for t in admin(with_dead, "topics")}

    for bp in (a, b):
        assert bp.terminate() == 0, bp.output()[-2000:]
    assert names[1].terminate() == 0


def test_a_broker_and_name_servers_together_get_one_line(tmp_path: Any) -> None:
    ns = f"127.0.0.1:{free_port()}"
    broker = f"127.0.0.1:{free_port()}"
    cases = [
        ("admin", "topics", "--broker", broker, "--namesrv", ns),
        ("admin", "--namesrv", ns, "cluster", "--broker", broker),
        (
            "outbox",
            "relay",
            "--db",
            f"sqlite:///{tmp_path}/app.db",
            "--broker",
            broker,
            "--namesrv",
            ns,
        ),
    ]
    for args in cases:
        out = txmq(*args, check=False)
        assert out.returncode == 1, args
        assert out.stderr.splitlines() == [
            "txmq: error: give --broker or --namesrv, not both (--broker talks to that broker "
            "alone, --namesrv to the whole cluster through its name servers)"
        ], args
    # no name server up: one line saying so
    out = txmq("admin", "cluster", "--namesrv", ns, check=False)
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1
    assert "no name server is reachable" in out.stderr


def test_help_shows_the_cluster_examples() -> None:
    for args, text in [
        (("admin", "--help"), "--namesrv"),
        (("admin", "cluster", "--help"), "txmq admin cluster --namesrv"),
        (("admin", "topic-create", "--help"), "--cluster C"),
        (("outbox", "relay", "--help"), "--namesrv"),
    ]:
        assert text in txmq(*args).stdout, args
