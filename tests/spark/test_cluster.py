"""Reconciliation over a cluster (issue 17, item 6): two broker sets behind a name server,
a store each, read together with ``--store`` once per broker set.  Anomalies are planted in
both stores; the job finds each of them, on the broker set it is on, and nothing else.

The transaction whose halves sit at the same commit-log offset in both stores is the case
offsets alone get wrong: its half in broker-b was rolled back (lost), its half in broker-a
committed later; keyed by offset alone they were one half, and a committed one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import anyio
import pytest
from sqlalchemy import Engine, create_engine, insert

import txmq.sqla
from tests.conftest import wait_for
from txmq.broker.server import EmbeddedBroker
from txmq.broker.state.config import BrokerConfig
from txmq.client.producer import SendResult
from txmq.client.transaction import LocalTransactionState
from txmq.consumer.pull import PullConsumer
from txmq.namesrv import EmbeddedNamesrv
from txmq.protocol.message import Message, MessageExt, new_message_id
from txmq.protocol.wire import ConsumerSendMsgBack
from txmq.spark.classify import CLASSES
from txmq.spark.job import BROKER_FILE, BadOption, broker_stores, main
from txmq.sqla.tables import consumed_keys, transaction_log
from txmq.sync import AdminClient, Producer, TransactionProducer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOPIC = "invoices"
GROUP = "billing"
SHOP = "shop"


class Undecided:
    """A local transaction that never says: the broker checks, then parks the half."""

    def execute_local_transaction(self, msg: Message, arg: Any) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN


@dataclass
class Cluster:
    """Two broker sets' stores, a database, what was planted (class -> {(id, broker)})."""

    stores: dict[str, Path]
    db: str
    expected: dict[str, set[tuple[str, str]]] = field(
        default_factory=lambda: {c: set() for c in CLASSES}
    )
    #: messages stored on both broker sets (one UNIQ_KEY, two stores)
    multi_stored: int = 0


def _done(engine: Engine, *keys: str) -> None:
    """``billing`` consumed these keys (ids or keys), as ``txmq.idempotent`` records it."""
    with engine.begin() as conn:
        for key in keys:
            conn.execute(
                insert(consumed_keys).values(
                    consumer_group=GROUP, key=key, state="done", created_at=datetime.now(UTC)
                )
            )


def _committed(engine: Engine, *transaction_ids: str) -> None:
    with engine.begin() as conn:
        for tx in transaction_ids:
            conn.execute(
                insert(transaction_log).values(
                    transaction_id=tx,
                    producer_group=SHOP,
                    state="COMMITTED",
                    created_at=datetime.now(UTC),
                )
            )


def _dead_letter(address: str, sent: SendResult) -> None:
    """``billing`` gives up on the message: its broker set moves it to ``%DLQ%billing``."""

    async def give_up() -> None:
        async with PullConsumer(address, GROUP) as pc:
            got = await pc.pull(TOPIC, sent.queue_id, sent.queue_offset, max_msgs=1)
            msg = got.messages[0]
            assert msg.msg_id == sent.msg_id
            await pc.call(
                ConsumerSendMsgBack(
                    group=GROUP,
                    commit_log_offset=msg.commit_log_offset,
                    delay_level=-1,
                    origin_msg_id=msg.msg_id,
                )
            )

    anyio.run(give_up)


def _on_both(a: str, b: str, msg: Message) -> str:
    """``msg`` stored on both broker sets under one message id, as a sync send that timed
    out on one set and was retried on the other stores it; its id."""
    with (
        mock.patch("txmq.client.producer.new_message_id", return_value=new_message_id()),
        Producer(a, "retrying-app") as pa,
        Producer(b, "retrying-app") as pb,
    ):
        ra, rb = pa.send(msg), pb.send(msg)
    assert ra.msg_id == rb.msg_id
    return ra.msg_id


def _plant(w: Cluster, a: str, b: str, namesrv: str, engine: Engine) -> None:
    lost, phantom, parked = w.expected["lost"], w.expected["phantom"], w.expected["parked"]
    # -- the first record of each store: one transaction, a half on each broker set, at the
    # same commit-log offset; broker-b rolled its half back, broker-a committed its own
    with TransactionProducer(a, SHOP) as ta, TransactionProducer(b, SHOP) as tb:
        ha = ta.send_half(Message(TOPIC, b"{}", keys=["order-split-a"]), transaction_id="split")
        hb = tb.send_half(Message(TOPIC, b"{}", keys=["order-split-b"]), transaction_id="split")
        assert ha.transaction_offset == hb.transaction_offset, (ha, hb)
        tb.end_transaction(hb, LocalTransactionState.ROLLBACK)
        ta.end_transaction(ha, LocalTransactionState.COMMIT)
        _committed(engine, "split")
        _done(engine, ha.msg_id)
        lost.add((hb.msg_id, "broker-b"))
        # phantom on broker-a: committed there, no local transaction (its message consumed)
        ph = ta.send_half(Message(TOPIC, b"{}", keys=["order-ph"]), transaction_id="phantom-a")
        ta.end_transaction(ph, LocalTransactionState.COMMIT)
        _done(engine, "order-ph")
        phantom.add(("phantom-a", "broker-a"))
        # healthy on broker-b: committed in both places and consumed
        ok = tb.send_half(Message(TOPIC, b"{}", keys=["order-ok"]), transaction_id="fine-b")
        tb.end_transaction(ok, LocalTransactionState.COMMIT)
        _committed(engine, "fine-b")
        _done(engine, ok.msg_id)
    # parked on broker-b: a live producer of the group that never knows
    with TransactionProducer(b, SHOP, listener=Undecided()) as tp:
        tp.send_half(
            Message(TOPIC, b"{}", keys=["order-parked"]),
            transaction_id="parked-b",
            check_immunity_s=0,
        )
        with AdminClient(b) as admin:
            wait_for(
                lambda: any(t.transaction_id == "parked-b" for t in admin.transactions("parked")),
                timeout=30,
            )
    parked.add(("parked-b", "broker-b"))

    # -- healthy traffic through the name server: spread over both sets, all consumed
    with Producer(namesrv=namesrv, group="billing-app") as p:
        sent = [p.send(Message(TOPIC, b"{}", keys=[f"inv-{i}"])) for i in range(8)]
    assert {r.broker_name for r in sent} == {"broker-a", "broker-b"}
    _done(engine, *(r.msg_id for r in sent[:4]), *(f"inv-{i}" for i in range(4, 8)))

    with Producer(a, "billing-app") as pa, Producer(b, "billing-app") as pb:
        # unconsumed on broker-b
        late = pb.send(Message(TOPIC, b"{}", keys=["inv-late"]))
        w.expected["unconsumed"].add((late.msg_id, "broker-b"))
        # dead-lettered on broker-a; on broker-b one that billing consumed since (healthy)
        poison = pa.send(Message(TOPIC, b"{not json", keys=["inv-poison"]))
        redone = pb.send(Message(TOPIC, b"{}", keys=["inv-redone"]))
        # one event applied twice: a message of it on each broker set, both consumed by id
        d1 = pa.send(Message(TOPIC, b"{}", keys=["inv-dup"]))
        d2 = pb.send(Message(TOPIC, b"{}", keys=["inv-dup"]))
    _dead_letter(a, poison)
    _dead_letter(b, redone)
    _done(engine, redone.msg_id, d1.msg_id, d2.msg_id)  # not the poison
    w.expected["dead_lettered"].add((poison.msg_id, "broker-a"))
    w.expected["duplicate"].add(("inv-dup", "broker-a, broker-b"))
    # one message stored on both sets (a retried send) and consumed once: one message, fine
    retried = _on_both(a, b, Message(TOPIC, b"{}", keys=["inv-retried"]))
    _done(engine, retried)
    # ... and one stored on both sets that billing applied twice, by its id and by its key
    twice = _on_both(a, b, Message(TOPIC, b"{}", keys=["inv-twice"]))
    _done(engine, twice, "inv-twice")
    w.expected["duplicate"].add(("inv-twice", "broker-a, broker-b"))
    w.multi_stored = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("cluster")
    url = f"sqlite:///{folder / 'app.db'}"
    engine = create_engine(url)
    with engine.connect() as conn:
        txmq.sqla.upgrade(conn)
    # broker-a's store is in a folder of another name (the job is told its name); broker-b's
    # folder is named after its broker set
    stores = {"broker-a": folder / "a-store", "broker-b": folder / "broker-b"}
    with EmbeddedNamesrv() as ns:
        brokers = [
            EmbeddedBroker(
                BrokerConfig(
                    store=store,
                    port=0,
                    namesrv=ns.address,
                    cluster="recon",
                    broker_name=name,
                    transaction_check_interval_s=0.2,
                    transaction_check_max=2,
                )
            ).start()
            for name, store in stores.items()
        ]
        try:
            w = Cluster(stores, url)
            _plant(w, brokers[0].address, brokers[1].address, ns.address, engine)
            yield w
        finally:
            for broker in brokers:
                broker.stop()
            engine.dispose()


def _named(anomaly: str, row: dict[str, Any]) -> str:
    """What names an anomaly row in ``Cluster.expected``."""
    if anomaly == "duplicate":
        return str(row["key"])
    if anomaly in ("phantom", "parked"):
        return str(row["transaction_id"])
    return str(row["msg_id"])


def test_anomalies_of_every_store_are_found_on_their_broker_set(
    cluster: Cluster, spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    now = datetime.now(UTC) + timedelta(hours=1)
    rc = main(
        [
            *("--store", f"broker-a={cluster.stores['broker-a']}"),
            *("--store", str(cluster.stores["broker-b"])),
            *("--db", cluster.db, "--out", str(out), "--sla", "10m"),
            *("--now", now.isoformat(), "--expect", f"{GROUP}={TOPIC}"),
        ],
        spark=spark,
    )
    text = capsys.readouterr().out
    rows = {c: [r.asDict() for r in spark.read.parquet(str(out / c)).collect()] for c in CLASSES}
    found = {c: {(_named(c, r), r["broker"]) for r in rows[c]} for c in CLASSES}
    assert found == cluster.expected, text
    assert rc == 1
    (split,) = rows["lost"]
    assert split["transaction_id"] == "split" and split["broker_state"] == "ROLLED_BACK"
    assert split["detail"].endswith("(another of the transaction committed)")
    assert rows["unconsumed"][0]["group"] == GROUP
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"] == {c: len(v) for c, v in cluster.expected.items()}, text
    facts = summary["facts"]
    assert facts["stores"] == {n: str(p) for n, p in cluster.stores.items()}
    assert facts["multi_stored"] == cluster.multi_stored, text
    # split, phantom-a, fine-b and parked-b
    assert facts["transactions"] == 4, text
    assert "broker stores: broker-a (" in text and "messages stored on more than one" in text


def test_stores_are_named_by_the_option_the_store_or_the_folder(tmp_path: Path) -> None:
    a, b, c = (tmp_path / n for n in ("store-a", "broker-b", "x=y"))
    for folder in (a, b, c):
        (folder / "commitlog").mkdir(parents=True)
    (b / BROKER_FILE).parent.mkdir()
    (b / BROKER_FILE).write_text(json.dumps({"cluster": "C", "broker_name": "b2"}))
    assert broker_stores([f"broker-a={a}", str(b), str(c)]) == [
        ("broker-a", str(a)),
        ("b2", str(b)),  # what the store records
        ("x=y", str(c)),  # a folder whose name has '=' in it is a folder
    ]
    assert broker_stores([str(a)]) == [("store-a", str(a))]
    with pytest.raises(BadOption, match="that store records broker set 'b2'"):
        broker_stores([f"broker-b={b}"])
    with pytest.raises(BadOption, match="two stores named 'store-a'"):
        broker_stores([str(a), f"store-a={b.parent / 'elsewhere'}"])
    with pytest.raises(BadOption, match="is named twice"):
        broker_stores([f"one={a}", f"two={a}"])


def test_bad_stores_exit_2_before_spark_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    (tmp_path / "one" / "store" / "commitlog").mkdir(parents=True)
    (tmp_path / "two" / "store" / "commitlog").mkdir(parents=True)
    stores = [str(tmp_path / "one" / "store"), str(tmp_path / "two" / "store")]
    # no spark given and none made: the error comes first
    assert main(["--store", stores[0], "--store", stores[1], "--db", db]) == 2
    assert "two stores named 'store'" in capsys.readouterr().err
    assert main(["--store", f"a={stores[0]}", "--store", f"b={tmp_path / 'no'}", "--db", db]) == 2
    assert "is not a txmq broker store" in capsys.readouterr().err
