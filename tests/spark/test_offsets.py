"""Consumption judged on a consumer group's committed offsets (issue 30, item 8): a group that
records no consumed keys — a plain push consumer — consumed the messages its committed
offset passed, where the job used to call every one of them unconsumed; a message sent back
for a retry counts once the group's offset in ``%RETRY%<group>`` passed its copy too."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import create_engine

import txmq.sqla
from tests.conftest import wait_for
from tests.spark.conftest import Small
from txmq.broker.server import EmbeddedBroker
from txmq.client.producer import SendResult
from txmq.consumer.pull import PullConsumer
from txmq.protocol.message import Message, MessageExt, retry_topic
from txmq.protocol.wire import ConsumerSendMsgBack
from txmq.spark.job import broker_stores
from txmq.spark.offsets import Committed, consumed_topics, evidence, read_offsets
from txmq.sync import Producer, PushConsumer
from txmq.sync import PullConsumer as SyncPullConsumer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOPIC = "invoices"
GROUP = "billing"
AN_HOUR = timedelta(hours=1)


def _send(address: str, *keys: str) -> list[SendResult]:
    with Producer(address, "billing-app") as p:
        return [p.send(Message(TOPIC, b"{}", keys=[k])) for k in keys]


def _committed_past(address: str, sent: list[SendResult]) -> Callable[[], bool]:
    """Whether the group's committed offset of every queue is past the messages ``sent``."""
    ends: dict[int, int] = {}
    for r in sent:
        ends[r.queue_id] = max(ends.get(r.queue_id, 0), r.queue_offset + 1)

    def past() -> bool:
        with SyncPullConsumer(address, GROUP) as pc:
            return all(pc.fetch_offset(TOPIC, q) >= end for q, end in ends.items())

    return past


def test_a_plain_push_consumer_consumed_what_its_committed_offsets_passed(small: Small) -> None:
    sent = _send(small.address, *(f"inv-{i}" for i in range(8)))
    seen: set[str] = set()
    lock = threading.Lock()

    def listener(msg: MessageExt) -> None:  # no consumed key: a plain consumer
        with lock:
            seen.add(msg.msg_id)

    consumer = PushConsumer(
        small.address, GROUP, listener=listener, consume_from="FIRST_OFFSET", persist_interval=0.1
    )
    consumer.subscribe(TOPIC)
    with consumer:
        wait_for(lambda: seen >= {r.msg_id for r in sent}, timeout=60)
        wait_for(_committed_past(small.address, sent), timeout=60, interval=0.1)
    # sent once the consumer is gone: above the group's committed offset of its queue
    (late,) = _send(small.address, "inv-late")
    small.broker.stop()  # it saves the offsets file at its stop (else every 5 s)
    later = datetime.now(UTC) + AN_HOUR

    found = small.reconcile(now=later)
    # the group is expected on the topic by its committed offsets (it has no consumed key)
    assert found.summary["facts"]["expected"] == [[GROUP, TOPIC]], found.summary
    assert found.summary["facts"]["evidence"] == {GROUP: "committed offsets"}
    assert found.pairs("unconsumed") == {(GROUP, late.msg_id)}, found.rows["unconsumed"]
    (row,) = found.rows["unconsumed"]
    assert row["detail"] == "not passed by the group's committed offset after the SLA"
    assert row["broker"] == broker_stores([str(small.broker.config.store)])[0][0]
    assert found.rc == 1

    # told to expect it, the same; a group with neither consumed keys nor offsets misses all
    told = small.reconcile("--expect", f"{GROUP}={TOPIC}", "--expect", f"audit={TOPIC}", now=later)
    assert told.summary["facts"]["evidence"] == {GROUP: "committed offsets", "audit": "none"}
    everything = {r.msg_id for r in [*sent, late]}
    assert told.pairs("unconsumed") == {(GROUP, late.msg_id)} | {("audit", m) for m in everything}
    audit = {r["detail"] for r in told.rows["unconsumed"] if r["group"] == "audit"}
    assert audit == {
        "the group has neither consumed keys nor committed offsets: no evidence it consumed "
        "anything"
    }
    text = (small.tmp_path / "out1" / "summary.json").read_text()
    assert '"audit": "none"' in text


def test_a_retry_copy_counts_until_the_groups_retry_offset_passes_it(
    spark: Any, tmp_path: Path, embedded_broker: Callable[..., EmbeddedBroker]
) -> None:
    """The group passed all three messages; it sent two back, and its offset in its retry
    topic passed the first copy only: that message was consumed (on its retry), the other
    still waits (unconsumed, and counted as waiting in a retry topic)."""
    broker = embedded_broker(message_delay_levels=" ".join(["20ms"] * 18))
    retried, waiting, fine = sent = _send(broker.address, "inv-retried", "inv-waiting", "inv-ok")
    rt = retry_topic(GROUP)

    async def send_back(r: SendResult) -> None:
        """The group failed the message: it sends it back for a retry."""
        async with PullConsumer(broker.address, GROUP) as pc:
            got = await pc.pull(TOPIC, r.queue_id, r.queue_offset, max_msgs=1)
            assert got.messages[0].msg_id == r.msg_id
            await pc.call(
                ConsumerSendMsgBack(
                    group=GROUP,
                    commit_log_offset=got.messages[0].commit_log_offset,
                    delay_level=1,
                    origin_msg_id=r.msg_id,
                )
            )

    with SyncPullConsumer(broker.address, GROUP) as pc:
        for r in sent:  # all three passed
            pc.commit_offset(TOPIC, r.queue_id, r.queue_offset + 1)
        for n, r in enumerate((retried, waiting), start=1):
            anyio.run(send_back, r)
            wait_for(lambda n=n: pc.max_offset(rt, 0) >= n)  # its copy is in the retry topic
        pc.commit_offset(rt, 0, 1)  # the first copy consumed
    broker.stop()
    db = f"sqlite:///{tmp_path / 'app.db'}"
    engine = create_engine(db)
    with engine.connect() as conn:
        txmq.sqla.upgrade(conn)
    try:
        found = Small(broker, db, engine, spark, tmp_path).reconcile(
            now=datetime.now(UTC) + AN_HOUR
        )
    finally:
        engine.dispose()
    assert found.summary["facts"]["expected"] == [[GROUP, TOPIC]], found.summary
    assert found.pairs("unconsumed") == {(GROUP, waiting.msg_id)}, found.rows["unconsumed"]
    assert fine.msg_id not in {m for _, m in found.pairs("unconsumed")}
    assert found.summary["facts"]["retrying"] == 1, found.summary


def test_offsets_are_read_per_broker_set_and_name_the_evidence(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "config").mkdir(parents=True)
    (a / "config" / "offsets.json").write_text(
        '{"offsets": {"billing": {"invoices": {"0": 3, "1": 0}, "%RETRY%billing": {"0": 1}}}}'
    )
    (b / "config").mkdir(parents=True)
    (b / "config" / "offsets.json").write_text('{"offsets": {"billing": {"invoices": {"0": 7}}}}')
    committed = read_offsets([("broker-a", str(a)), ("broker-b", str(b)), ("c", str(tmp_path))])
    assert sorted(committed, key=lambda c: (c.broker, c.topic, c.queue_id)) == [
        Committed("broker-a", "billing", "%RETRY%billing", 0, 1),
        Committed("broker-a", "billing", "invoices", 0, 3),
        Committed("broker-a", "billing", "invoices", 1, 0),
        Committed("broker-b", "billing", "invoices", 0, 7),
    ]
    assert consumed_topics(committed) == {("billing", "invoices")}  # not its retry topic
    keyed = {"inventory-service/order-created", "audit"}
    pairs = {("billing", "invoices"), ("audit", "invoices"), ("nobody", "invoices")}
    pairs.add(("inventory-service/order-created", "invoices"))
    committed.append(Committed("broker-a", "inventory-service", "invoices", 0, 2))
    assert evidence(pairs, keyed, committed) == {
        "audit": "consumed keys",
        "billing": "committed offsets",
        "inventory-service/order-created": "both",
        "nobody": "none",
    }
    (a / "config" / "offsets.json").write_text("{not json")
    from txmq.broker.store.export import StoreUnreadable

    with pytest.raises(StoreUnreadable, match=r"offsets\.json is not a broker's offsets file"):
        read_offsets([("broker-a", str(a))])


def test_offsets_are_evidence_on_their_own_broker_set_only(spark: Any) -> None:
    """Two broker sets hold queue 0 of the topic, each with its own offsets: billing passed
    offset 5 of broker-a's queue (its offset there is 10), not of broker-b's (3)."""
    from pyspark.sql import functions as F

    from txmq.spark.common import Run
    from txmq.spark.messages import consumed_hashes, flags
    from txmq.spark.offsets import marks
    from txmq.spark.store_source import SCHEMA

    now = datetime.now(UTC)
    old = int((now - AN_HOUR).timestamp() * 1000)
    fields = [f.strip().split(" ")[0].strip("`") for f in SCHEMA.split(", ")]

    def message(msg_id: str) -> tuple[Any, ...]:
        row = dict.fromkeys(fields)
        row |= {"kind": "message", "topic": TOPIC, "msg_id": msg_id, "key": msg_id}
        row |= {"store_ts": old, "nkeys": 0, "queue_id": 0, "queue_offset": 5}
        return tuple(row[f] for f in fields)

    store = spark.createDataFrame([message("on-a"), message("on-b")], SCHEMA)
    store = store.withColumn(
        "broker", F.when(F.col("msg_id") == "on-a", "broker-a").otherwise("broker-b")
    )
    committed = [
        Committed("broker-a", GROUP, TOPIC, 0, 10),
        Committed("broker-b", GROUP, TOPIC, 0, 3),
    ]
    groups = spark.createDataFrame([(GROUP, 0, 1)], "consumer_group string, gi int, gbit long")
    consumed = spark.createDataFrame([], "consumer_group string, key string, state string")
    outbox = spark.createDataFrame([], "msg_id string, created_ms long, id long")
    run = Run(spark, now, timedelta(minutes=10))
    try:
        found = flags(
            run,
            store,
            outbox,
            consumed_hashes(consumed, groups, True),
            {TOPIC: 1},
            F.lit(0),
            {GROUP: 1},
            [GROUP],
            marks(spark, committed, {GROUP: 1}),
        )
        late = {r["k"] for r in found.where("late").collect()}
        hashes = dict(
            spark.createDataFrame([("on-a",), ("on-b",)], "m string")
            .select("m", F.xxhash64("m"))
            .collect()
        )
    finally:
        run.unpersist()
    assert late == {hashes["on-b"]}, (late, hashes)
