"""The name server's route table, without a server: registrations, heartbeats, topic
changes, unregistering, expiry (with a clock the test moves) and one broker name at two
addresses."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import msgspec
import pytest

from txmq.namesrv import NamesrvConfig, RouteTable
from txmq.protocol.settings import SettingsError
from txmq.protocol.wire import (
    PERM_READ,
    BrokerData,
    QueueData,
    RegisterBroker,
    TopicConfigData,
    UnregisterBroker,
)
from txmq.protocol.wire.errors import BadRequest, InvalidTopic, TopicNotFound


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reg(
    name: str = "broker-a",
    address: str = "10.0.0.1:10911",
    *,
    topics: dict[str, int] | None = None,
    version: int = 1,
    broker_id: int = 0,
    cluster: str = "C",
) -> RegisterBroker:
    return RegisterBroker(
        cluster=cluster,
        broker_name=name,
        broker_id=broker_id,
        address=address,
        data_version=version,
        topics=[
            TopicConfigData(name=t, read_queue_nums=n, write_queue_nums=n)
            for t, n in (topics if topics is not None else {"T": 4}).items()
        ],
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> RouteTable:
    return RouteTable(expiry=120.0, clock=clock)


def test_a_topic_on_two_broker_sets_routes_to_both(table: RouteTable) -> None:
    table.register(reg("broker-b", "10.0.0.2:10911", topics={"T": 8, "only-b": 2}))
    table.register(reg("broker-a", "10.0.0.1:10911", topics={"T": 4}))
    route = table.route("T")
    assert route.topic == "T"
    assert route.queues == [
        QueueData(broker_name="broker-a", read_queue_nums=4, write_queue_nums=4),
        QueueData(broker_name="broker-b", read_queue_nums=8, write_queue_nums=8),
    ]
    assert route.brokers == [
        BrokerData(cluster="C", broker_name="broker-a", addresses={0: "10.0.0.1:10911"}),
        BrokerData(cluster="C", broker_name="broker-b", addresses={0: "10.0.0.2:10911"}),
    ]
    assert [q.broker_name for q in table.route("only-b").queues] == ["broker-b"]
    info = table.cluster_info()
    assert info.clusters == {"C": ["broker-a", "broker-b"]}
    assert [b.broker_name for b in info.brokers] == ["broker-a", "broker-b"]


def test_unknown_and_invalid_topics(table: RouteTable) -> None:
    with pytest.raises(TopicNotFound, match="no broker registered topic 'nope'"):
        table.route("nope")
    table.register(reg(topics={"T": 4}))
    with pytest.raises(TopicNotFound):
        table.route("nope")
    with pytest.raises(InvalidTopic):
        table.route("bad topic/")


def test_the_same_version_again_is_a_heartbeat(table: RouteTable, clock: Clock) -> None:
    table.register(reg(topics={"T": 4}, version=7))
    clock.now += 100
    # same version: the topics it carries are not read again (a broker sends them all the
    # same; here they differ, to show the table keeps what version 7 said)
    table.register(reg(topics={"U": 1}, version=7))
    assert table.topics() == ["T"]
    [live] = table.brokers()
    assert live.last_seen == clock.now
    clock.now += 100  # 100 s since the heartbeat, 200 s since the first registration
    assert table.expire() == []


def test_a_new_version_replaces_the_brokers_topics(table: RouteTable) -> None:
    table.register(reg(topics={"T": 4, "gone": 1}, version=1))
    table.register(reg("broker-b", "10.0.0.2:10911", topics={"gone": 2}, version=1))
    table.register(reg(topics={"T": 16, "new": 2}, version=2))
    assert table.topics() == ["T", "gone", "new"]
    assert table.route("T").queues[0].write_queue_nums == 16
    assert [q.broker_name for q in table.route("gone").queues] == ["broker-b"]
    # a lower version is a change too (a restarted broker starts from another number)
    table.register(reg(topics={"T": 4}, version=1))
    assert table.topics() == ["T", "gone"]


def test_unregister(table: RouteTable) -> None:
    table.register(reg(topics={"T": 4}))
    table.register(reg("broker-b", "10.0.0.2:10911", topics={"T": 4}))
    wrong_address = UnregisterBroker(cluster="C", broker_name="broker-a", address="10.9.9.9:1")
    assert table.unregister(wrong_address) is False
    assert len(table.route("T").queues) == 2
    ok = UnregisterBroker(cluster="C", broker_name="broker-a", address="10.0.0.1:10911")
    assert table.unregister(ok) is True
    assert [q.broker_name for q in table.route("T").queues] == ["broker-b"]
    assert table.cluster_info().clusters == {"C": ["broker-b"]}
    table.unregister(
        UnregisterBroker(cluster="C", broker_name="broker-b", address="10.0.0.2:10911")
    )
    with pytest.raises(TopicNotFound):
        table.route("T")
    assert table.topics() == [] and table.cluster_info().brokers == []


def test_a_silent_broker_expires(
    table: RouteTable, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    table.register(reg("broker-a", topics={"T": 4}))
    clock.now += 60
    table.register(reg("broker-b", "10.0.0.2:10911", topics={"T": 4}))
    clock.now += 60  # broker-a: 120 s, exactly the limit, not past it
    assert table.expire() == []
    clock.now += 1
    with caplog.at_level(logging.WARNING, logger="txmq.namesrv"):
        [gone] = table.expire()
    assert gone.broker_name == "broker-a"
    [line] = [r.getMessage() for r in caplog.records]
    assert "broker broker-a (id 0, cluster C) at 10.0.0.1:10911" in line
    assert "not heard from for 121 s" in line
    assert [q.broker_name for q in table.route("T").queues] == ["broker-b"]
    clock.now += 60
    assert [b.broker_name for b in table.expire()] == ["broker-b"]
    with pytest.raises(TopicNotFound):
        table.route("T")


def test_same_name_and_id_at_another_address_is_refused_while_the_first_lives(
    table: RouteTable, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    table.register(reg("broker-a", "10.0.0.1:10911", topics={"T": 4}, version=5))
    with pytest.raises(BadRequest, match=r"already registered at 10\.0\.0\.1:10911 .*10\.0\.0\.7"):
        table.register(reg("broker-a", "10.0.0.7:10911", topics={"T": 4}, version=5))
    assert table.route("T").brokers[0].addresses == {0: "10.0.0.1:10911"}
    # a master elected later (a higher epoch) takes the place at once
    newer = msgspec.structs.replace(
        reg("broker-a", "10.0.0.8:10911", topics={"T": 4}, version=5), epoch=2
    )
    with caplog.at_level(logging.WARNING, logger="txmq.namesrv"):
        table.register(newer)
    [line] = [r.getMessage() for r in caplog.records]
    assert "10.0.0.1:10911" in line and "10.0.0.8:10911" in line
    assert "taking the newer registration" in line
    assert table.route("T").brokers[0].addresses == {0: "10.0.0.8:10911"}
    # the old one's clean stop does not remove the newer registration
    old = UnregisterBroker(cluster="C", broker_name="broker-a", address="10.0.0.1:10911")
    assert table.unregister(old) is False
    # one silent for longer than the expiry gives way too
    clock.now += 121
    table.register(reg("broker-a", "10.0.0.9:10911", topics={"T": 4}, version=5))
    assert table.route("T").brokers[0].addresses == {0: "10.0.0.9:10911"}


def test_a_broker_set_with_a_slave(table: RouteTable) -> None:
    table.register(reg("broker-a", "10.0.0.1:10911", topics={"T": 4}))
    answer = table.register(reg("broker-a", "10.0.0.2:10911", topics={"T": 4}, broker_id=1))
    assert answer.master_address == "10.0.0.1:10911"
    [data] = table.route("T").brokers
    assert data.addresses == {0: "10.0.0.1:10911", 1: "10.0.0.2:10911"}
    # the master's topics speak for the set; once it is gone, the slave's do
    table.register(
        reg("broker-a", "10.0.0.2:10911", topics={"T": 4, "S": 1}, broker_id=1, version=2)
    )
    with pytest.raises(TopicNotFound):
        table.route("S")
    table.unregister(
        UnregisterBroker(cluster="C", broker_name="broker-a", address="10.0.0.1:10911")
    )
    assert table.route("S").brokers[0].addresses == {1: "10.0.0.2:10911"}


def test_routes_name_no_master_while_the_controller_elects(table: RouteTable) -> None:
    """Issue 32, item 3: while the controller in the same process elects, and until the
    winner registers as the master of the new epoch, the routes name no master for the set
    (the old one is fenced: sends wait for the new one instead of timing out on it, and
    none goes to a winner that does not know yet)."""
    old, new = "10.0.0.1:10911", "10.0.0.2:10911"
    master = msgspec.structs.replace(reg("broker-a", old), epoch=1)
    table.register(master)
    table.register(msgspec.structs.replace(reg("broker-a", new, broker_id=1), epoch=1))
    table.elected("broker-a", None, 2)
    [data] = table.route("T").brokers
    assert data.addresses == {1: new}  # no master: clients wait for one
    assert table.cluster_info().brokers[0].addresses == {1: new}
    table.elected("broker-a", new, 2)
    assert table.route("T").brokers[0].addresses == {1: new}  # elected, not told yet
    table.register(master)  # the old master's heartbeat (epoch 1) changes nothing
    assert table.route("T").brokers[0].addresses == {1: new}
    table.register(msgspec.structs.replace(reg("broker-a", new), epoch=2))  # promoted
    assert table.route("T").brokers[0].addresses == {0: new}
    table.register(msgspec.structs.replace(reg("broker-a", old, broker_id=1), epoch=2))
    assert table.route("T").brokers[0].addresses == {0: new, 1: old}
    # an election abandoned (a switchover that did not happen): the table as registered
    table.elected("broker-a", None, 3)
    assert table.route("T").brokers[0].addresses == {1: old}
    table.election_abandoned("broker-a")
    assert table.route("T").brokers[0].addresses == {0: new, 1: old}


def test_an_address_registering_as_another_broker_replaces_its_old_entry(
    table: RouteTable,
) -> None:
    table.register(reg("broker-a", "10.0.0.1:10911", topics={"T": 4}))
    table.register(reg("broker-z", "10.0.0.1:10911", topics={"T": 4}))
    assert [b.broker_name for b in table.brokers()] == ["broker-z"]


def test_a_closed_connection_drops_only_the_brokers_registered_on_it(table: RouteTable) -> None:
    first, second, other = object(), object(), object()
    table.register(reg("broker-a", topics={"T": 4}), conn=first)
    table.register(reg("broker-b", "10.0.0.2:10911", topics={"T": 4}), conn=other)
    table.register(reg("broker-a", topics={"T": 4}), conn=second)  # reconnected
    assert table.connection_closed(first) == []
    assert len(table.route("T").queues) == 2
    assert [b.broker_name for b in table.connection_closed(second)] == ["broker-a"]
    assert [q.broker_name for q in table.route("T").queues] == ["broker-b"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"address": "no-port"}, "address"),
        ({"address": "h:99999"}, "address"),
        ({"broker_name": "a;b"}, "broker_name"),
        ({"cluster": "C D"}, "cluster"),
        (
            {"topics": [TopicConfigData(name="a/b", read_queue_nums=1, write_queue_nums=1)]},
            "topics[0].name",
        ),
    ],
)
def test_bad_registrations(table: RouteTable, change: dict[str, object], field: str) -> None:
    fields = {"cluster": "C", "broker_name": "broker-a", "address": "10.0.0.1:10911", **change}
    with pytest.raises(BadRequest, match=re.escape(f"RegisterBroker: header field '{field}'")):
        table.register(RegisterBroker(**fields))  # type: ignore[arg-type]
    assert table.brokers() == []


def test_queue_permissions_pass_through(table: RouteTable) -> None:
    req = reg(topics={})
    table.register(
        RegisterBroker(
            cluster=req.cluster,
            broker_name=req.broker_name,
            address=req.address,
            topics=[
                TopicConfigData(name="ro", read_queue_nums=4, write_queue_nums=0, perm=PERM_READ)
            ],
        )
    )
    [q] = table.route("ro").queues
    assert (q.read_queue_nums, q.write_queue_nums, q.perm) == (4, 0, PERM_READ)


def test_settings_from_toml_and_environment(tmp_path: Path) -> None:
    toml = tmp_path / "ns.toml"
    toml.write_text("[namesrv]\nport = 9877\nbroker_expiry_s = 30\n")
    env = {"TXMQ_NAMESRV_SCAN_INTERVAL_S": "2.5", "TXMQ_NAMESRV_ADDR": "h:1"}  # (a client's)
    cfg = NamesrvConfig.load(toml, env=env, host="0.0.0.0")
    assert (cfg.host, cfg.port, cfg.broker_expiry_s, cfg.scan_interval_s) == (
        "0.0.0.0",
        9877,
        30.0,
        2.5,
    )
    assert NamesrvConfig.load(env={}) == NamesrvConfig()
    assert (NamesrvConfig().port, NamesrvConfig().broker_expiry_s) == (9876, 120.0)
    toml.write_text("[namesrv]\nexpiry = 3\n")
    with pytest.raises(SettingsError, match="unknown key 'expiry'"):
        NamesrvConfig.load(toml, env={})
    with pytest.raises(SettingsError, match="scan_interval_s must be positive"):
        NamesrvConfig.load(env={"TXMQ_NAMESRV_SCAN_INTERVAL_S": "0"})
