"""Reads from a slave: with the master down, consumers pull from its slave and commit their
offsets there; when the master is back the slave hands those offsets back.  A consumer
reading far behind the log's end is told to read from a slave next."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.conftest import ask, wait_for
from txmq import Message
from txmq.broker.server import Broker, EmbeddedBroker
from txmq.broker.state.offsets import ConsumerOffsetManager
from txmq.namesrv import EmbeddedNamesrv
from txmq.protocol.wire import HaHandBackOffsets
from txmq.sync import AdminClient, Producer, PullConsumer

Start = Callable[..., EmbeddedBroker]


def _b(e: EmbeddedBroker) -> Broker:
    assert e.broker is not None
    return e.broker


def _pair(start: Start, namesrv: str, tmp: Path, **master: object) -> tuple[EmbeddedBroker, ...]:
    common = {"namesrv": namesrv, "cluster": "C", "broker_name": "a"}
    m = start(broker_id=0, store=tmp / "m", **common, **master)
    s = start(broker_id=1, store=tmp / "s", ha_metadata_sync_interval_s=0.2, **common)
    wait_for(lambda: _b(s).replication.client.connected)
    return m, s


def _caught_up(master: EmbeddedBroker, slave: EmbeddedBroker) -> None:
    end = _b(master).store.commit_log_max_offset
    wait_for(lambda: _b(slave).store.commit_log_max_offset == end)


def test_with_the_master_down_consumers_read_from_the_slave_and_their_offsets_come_back(
    embedded_broker: Start, tmp_path: Path
) -> None:
    with EmbeddedNamesrv() as ns:
        master, slave = _pair(embedded_broker, ns.address, tmp_path)
        with Producer(namesrv=ns.address) as producer:
            for i in range(40):
                producer.send(Message("orders", f"m{i}".encode()))
        _caught_up(master, slave)
        wait_for(lambda: _b(slave).topics.get("orders") is not None)
        master.stop()  # (a clean stop unregisters it: the route has the slave alone)
        with PullConsumer(namesrv=ns.address, group="billing") as consumer:
            got = []
            for mq in consumer.message_queues("orders", refresh=True):
                res = consumer.pull("orders", mq.queue_id, 0, long_poll=0, broker_name="a")
                got += [m.body for m in res.messages]
                consumer.commit_offset("orders", mq.queue_id, res.next_offset, broker_name="a")
            assert sorted(got) == sorted(f"m{i}".encode() for i in range(40))
            slave_offsets = {q: _b(slave).offsets.query("billing", "orders", q) for q in range(4)}
            assert sum(slave_offsets.values()) == 40
            assert _b(slave).offsets.pending()  # kept, to hand back
            again = embedded_broker(
                broker_id=0, store=master.config.store, namesrv=ns.address, cluster="C",
                broker_name="a",
            )  # fmt: skip
            # the slave follows the master again and hands the offsets back
            wait_for(
                lambda: (
                    {q: _b(again).offsets.query("billing", "orders", q) for q in range(4)}
                    == slave_offsets
                )
            )
            wait_for(lambda: not _b(slave).offsets.pending())
            # and they are what the group resumes from, on the master
            assert consumer.fetch_offset("orders", 0, broker_name="a") == slave_offsets[0]


def test_a_consumer_far_behind_is_sent_to_the_slave_and_back(
    embedded_broker: Start, tmp_path: Path
) -> None:
    with EmbeddedNamesrv() as ns:
        # every reader is "far behind" for this master: its advice is always a slave
        master, slave = _pair(
            embedded_broker, ns.address, tmp_path, access_message_in_memory_max_ratio=1e-15
        )
        with Producer(namesrv=ns.address) as producer:
            for i in range(20):
                producer.send(Message("t", f"x{i}".encode()), queue_id=0, broker_name="a")
        _caught_up(master, slave)
        with PullConsumer(namesrv=ns.address, group="g") as consumer:
            consumer.message_queues("t")
            before = _b(slave).context.throughput.got
            first = consumer.pull("t", 0, 0, max_msgs=5, long_poll=0, broker_name="a")
            assert len(first.messages) == 5 and _b(slave).context.throughput.got == before
            second = consumer.pull("t", 0, 5, max_msgs=5, long_poll=0, broker_name="a")
            assert [m.body for m in second.messages] == [f"x{i}".encode() for i in range(5, 10)]
            assert _b(slave).context.throughput.got == before + 5  # read from the slave
            # the slave (default ratio) finds the reader close to the end: back to the master
            third = consumer.pull("t", 0, 10, max_msgs=5, long_poll=0, broker_name="a")
            assert len(third.messages) == 5
            assert _b(slave).context.throughput.got == before + 5


def test_a_hand_back_keeps_only_offsets_of_queues_the_master_has(
    embedded_broker: Start, tmp_path: Path
) -> None:
    """The HA port's HaHandBackOffsets with an unknown topic, a queue out of range, a
    negative queue id or an empty group: the master keeps only the valid offset (and only
    where it is further than its own), persists nothing else, and serves on."""
    master = embedded_broker(broker_id=0, store=tmp_path / "m")
    with AdminClient(master.address) as admin:
        admin.create_topic("orders", 2)
    with PullConsumer(master.address, group="billing") as consumer:
        consumer.commit_offset("orders", 1, 9)
    hostile = {
        "billing": {"orders": {0: 5, 1: 3, 2: 7, -1: 4}, "no-such-topic": {0: 1}},
        "": {"orders": {0: 6}},
    }
    answer = ask(_b(master).replication.ha_address, HaHandBackOffsets(broker_id=1, offsets=hostile))
    assert answer.log_end >= 0  # answered with the master's metadata
    b = _b(master)
    assert b.offsets.snapshot() == {"billing": {"orders": {0: 5, 1: 9}}}  # 3 < 9: kept 9
    b.offsets.persist(force=True)
    saved = (master.config.store / "config" / "offsets.json").read_text()
    assert "no-such-topic" not in saved and '"-1"' not in saved and '"2"' not in saved
    with Producer(master.address) as producer:  # and it serves on
        assert producer.send(Message("orders", b"x"), queue_id=0).status == "SEND_OK"


def test_a_slave_forgets_kept_offsets_of_a_topic_its_master_deleted() -> None:
    offsets = ConsumerOffsetManager(Path("/nonexistent/offsets.json"))
    offsets.commit("g", "kept", 0, 4, hand_back=True)
    offsets.commit("g", "deleted", 1, 2, hand_back=True)
    offsets.drop_pending(lambda group, topic, queue_id: topic == "kept")
    assert offsets.pending() == {"g": {"kept": {0: 4}}}
