"""Name servers and brokers registering with them, as real processes: routes over two
broker sets from either of two name servers, topics registered as they change, a clean
stop unregistering, a killed or hung broker dropped, a name server that comes up late."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from tests.conftest import (
    ROOT,
    BrokerProcess,
    NamesrvProcess,
    ask,
    free_port,
    wait_for,
)
from tests.raw_client import RawClient
from txmq import Message
from txmq.broker.server import EmbeddedBroker
from txmq.namesrv import Controller, EmbeddedNamesrv
from txmq.protocol.wire import (
    ConsumerData,
    DeleteTopic,
    GetClusterInfo,
    GetMaxOffset,
    GetReplicaInfo,
    GetTopicRoute,
    Heartbeat,
    RequestCode,
    UpdateAndCreateTopic,
)
from txmq.protocol.wire.errors import ResponseCode, TopicNotFound, TxmqError
from txmq.sync import Producer

NamesrvFactory = Callable[..., NamesrvProcess]
BrokerFactory = Callable[..., BrokerProcess]


def route(namesrv: str, topic: str) -> dict[str, tuple[int, str]]:
    """broker name -> (write queues, master address) of ``topic``'s route; {} if none."""
    try:
        got = ask(namesrv, GetTopicRoute(topic=topic))
    except TopicNotFound:
        return {}
    addresses = {b.broker_name: b.addresses[0] for b in got.brokers}
    return {q.broker_name: (q.write_queue_nums, addresses[q.broker_name]) for q in got.queues}


def eventually(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    wait_for(predicate, timeout, interval=0.05)


def test_two_name_servers_route_two_broker_sets(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    ns1, ns2 = namesrv_process("ns1").start(), namesrv_process("ns2").start()
    names = [ns1.address, ns2.address]
    a = cluster_broker("broker-a", names).start()
    b = cluster_broker("broker-b", names).start()
    ask(a.address, UpdateAndCreateTopic(topic="orders", queue_nums=4))
    ask(b.address, UpdateAndCreateTopic(topic="orders", queue_nums=8))
    both = {"broker-a": (4, a.address), "broker-b": (8, b.address)}
    for ns in names:  # registered on creation: well within the 30 s registration interval
        eventually(lambda ns=ns: route(ns, "orders") == both, timeout=5)
        info = ask(ns, GetClusterInfo())
        assert info.clusters == {"C": ["broker-a", "broker-b"]}
        assert {x.broker_name: x.addresses for x in info.brokers} == {
            "broker-a": {0: a.address},
            "broker-b": {0: b.address},
        }

    # a topic auto-created by a send is routable at once, from both name servers
    with Producer(a.address) as p:
        p.send(Message("auto-created", b"x"))
    for ns in names:
        eventually(lambda ns=ns: route(ns, "auto-created") == {"broker-a": (4, a.address)}, 5)
    # a consumer group's retry topic is registered (its consumers route to it); the
    # broker's internal topics are not
    ask(a.address, Heartbeat(client_id="c1", consumers=[ConsumerData(group="g1")]))
    eventually(lambda: route(ns1.address, "%RETRY%g1") == {"broker-a": (1, a.address)}, 5)
    for internal in ("RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC"):
        assert not route(ns1.address, internal)

    # a deleted topic leaves the route at once
    ask(b.address, DeleteTopic(topic="orders"))
    for ns in names:
        eventually(lambda ns=ns: route(ns, "orders") == {"broker-a": (4, a.address)}, 5)
    ask(b.address, UpdateAndCreateTopic(topic="orders", queue_nums=8))

    # one name server stops: the other answers as before
    assert ns1.terminate() == 0
    eventually(lambda: route(ns2.address, "orders") == both, 5)

    # a clean stop unregisters (the 120 s expiry cannot explain a prompt disappearance)
    assert b.terminate() == 0
    eventually(lambda: route(ns2.address, "orders") == {"broker-a": (4, a.address)}, 5)
    assert ask(ns2.address, GetClusterInfo()).clusters == {"C": ["broker-a"]}
    assert f"unregistered from name servers {ns2.address}" in b.output()
    assert "broker broker-b (id 0, cluster C)" in ns2.output()
    assert "unregistered" in ns2.output()


def test_killed_and_hung_brokers_leave_the_routes(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    ns = namesrv_process(
        env={"TXMQ_NAMESRV_BROKER_EXPIRY_S": "2", "TXMQ_NAMESRV_SCAN_INTERVAL_S": "0.5"}
    ).start()
    fast = {"TXMQ_BROKER_REGISTER_INTERVAL_S": "0.5"}
    a = cluster_broker("broker-a", [ns.address], env=fast).start()
    b = cluster_broker("broker-b", [ns.address], env=fast).start()
    c = cluster_broker("broker-c", [ns.address], env=fast).start()
    for bp in (a, b, c):
        ask(bp.address, UpdateAndCreateTopic(topic="T", queue_nums=2))
    eventually(lambda: set(route(ns.address, "T")) == {"broker-a", "broker-b", "broker-c"})

    # SIGKILL: the kernel closes its connection, which drops it at once
    c.kill()
    eventually(lambda: set(route(ns.address, "T")) == {"broker-a", "broker-b"}, 1.5)
    assert "broker broker-c (id 0, cluster C)" in ns.output()
    assert "its connection closed; dropped from the routes" in ns.output()

    # a hung broker (stopped, its connection open): dropped once silent for the expiry
    assert b.proc is not None
    b.proc.send_signal(signal.SIGSTOP)
    try:
        eventually(lambda: set(route(ns.address, "T")) == {"broker-a"}, 10)
        [line] = [x for x in ns.output().splitlines() if "not heard from for" in x]
        assert "broker broker-b (id 0, cluster C)" in line and "more than 2 s" in line
        assert b.alive()
        assert route(ns.address, "T") == {"broker-a": (2, a.address)}  # a kept registering
    finally:
        b.proc.send_signal(signal.SIGCONT)
    # back: its next registration brings it back
    eventually(lambda: set(route(ns.address, "T")) == {"broker-a", "broker-b"}, 10)


def test_a_broker_starts_while_its_name_server_is_down(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    bp = cluster_broker("broker-a", [address], env={"TXMQ_BROKER_REGISTER_INTERVAL_S": "0.3"})
    bp.start()
    ask(bp.address, UpdateAndCreateTopic(topic="late", queue_nums=2))  # the broker serves
    warning = f"WARNING txmq.broker: cannot register with name server {address}"
    eventually(lambda: warning in bp.output())
    ns = namesrv_process(port=port).start()
    eventually(lambda: route(ns.address, "late") == {"broker-a": (2, bp.address)})
    # the broker logs it once the answer is back (just after the name server has it)
    eventually(lambda: f"registered with name server {address}" in bp.output())
    # several attempts failed before; one warning said so
    assert bp.output().count("cannot register with name server") == 1


def test_bad_registrations_answer_bad_request(namesrv_process: NamesrvFactory) -> None:
    ns = namesrv_process().start()
    client = RawClient(ns.address)
    good = {"cluster": "C", "broker_name": "b", "address": "127.0.0.1:1"}
    cases = [
        ({"cluster": "C"}, "misses field 'broker_name'"),
        ({**good, "broker_id": "zero"}, "'broker_id'"),
        ({**good, "broker_id": -1}, "'broker_id'"),
        ({**good, "address": "nonsense"}, "'address'"),
        ({**good, "topics": [{"name": "T", "read_queue_nums": 1}]}, "write_queue_nums"),
        (
            {**good, "topics": [{"name": "a b", "read_queue_nums": 1, "write_queue_nums": 1}]},
            "topics[0].name",
        ),
    ]
    with client.sock:
        for rid, (header, field) in enumerate(cases, 1):
            frame = client.request(RequestCode.REGISTER_BROKER, header, rid=rid)
            error = msgpack.unpackb(frame.header)["error"]
            assert (frame.code, field in error) == (ResponseCode.BAD_REQUEST, True), error
        # a request a name server does not answer
        frame = client.request(RequestCode.PULL_MESSAGE, {}, rid=99)
    assert frame.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED
    assert b"not supported by a name server" in frame.header
    # nothing was registered, and it still serves
    assert ask(ns.address, GetClusterInfo()).brokers == []
    with pytest.raises(TxmqError):
        ask(ns.address, GetTopicRoute(topic="T"))


def txmq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "txmq.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_command_line_errors_are_one_line(tmp_path: Path, namesrv_process: NamesrvFactory) -> None:
    out = txmq("broker", "start", "--store", str(tmp_path / "s"), "--namesrv", "nonsense")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "txmq: error: namesrv: 'nonsense' is not HOST:PORT (a list is 'h1:9876;h2:9876')"
    ]
    out = txmq("broker", "start", "--store", str(tmp_path / "s"), "--broker-name", "a;b")
    assert out.returncode == 1 and "broker_name 'a;b'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1

    ns = namesrv_process().start()
    out = txmq("namesrv", "start", "--port", ns.address.rpartition(":")[2])
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"txmq: error: {ns.address} is already in use (another name server?): stop it, or "
        "choose another --port (0 picks a free one)"
    )
    assert "Traceback" not in out.stderr
    out = txmq("namesrv", "start", "--port", "0", env={"TXMQ_NAMESRV_BROKER_EXPIRY_S": "-1"})
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "txmq: error: broker_expiry_s must be positive"
    ]
    assert "txmq namesrv start --host 0.0.0.0" in txmq("namesrv", "start", "--help").stdout


def test_embedded_name_server_and_broker(embedded_broker: Callable[..., EmbeddedBroker]) -> None:
    """In one process: what a broker registers, and its clean stop unregistering."""
    with EmbeddedNamesrv() as ns:
        broker = embedded_broker(namesrv=ns.address, cluster="K", broker_name="solo")
        assert broker.broker is not None and broker.broker.registration is not None
        registration = broker.broker.registration
        assert registration.registered_with() == [ns.address]  # before the start returned
        version = registration.data_version
        ask(broker.address, UpdateAndCreateTopic(topic="E", queue_nums=3))
        assert registration.data_version > version
        eventually(lambda: route(ns.address, "E") == {"solo": (3, broker.address)}, 5)
        sent = registration.request()
        names = {t.name for t in sent.topics}
        assert "E" in names and not any(n.startswith(("RMQ_SYS_", "SCHEDULE_")) for n in names)
        assert (sent.cluster, sent.broker_name, sent.address) == ("K", "solo", broker.address)
        assert ns.server is not None
        [live] = ns.server.table.brokers()
        assert (live.cluster, live.data_version) == ("K", registration.data_version)
        broker.stop()
        assert ns.server.table.brokers() == []


def test_a_second_live_broker_under_the_same_name_and_id_is_refused(
    tmp_path: Path, namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    """Two live brokers registered as one (broker-a, id 0) would take turns in the routes
    and mix their consumers' offsets: the name server keeps the first and refuses the
    other, which says so once; what was sent through the name server went to the first."""
    ns = namesrv_process("ns").start()
    a = cluster_broker("broker-a", [ns.address]).start()
    ask(a.address, UpdateAndCreateTopic(topic="orders", queue_nums=4))
    eventually(lambda: route(ns.address, "orders") == {"broker-a": (4, a.address)})
    twin = BrokerProcess(
        tmp_path / "store-twin",
        ["--namesrv", ns.address, "--cluster", "C", "--broker-name", "broker-a"],
        tmp_path / "twin.log",
        env={"TXMQ_BROKER_REGISTER_INTERVAL_S": "0.2"},
    ).start()
    try:
        ask(twin.address, UpdateAndCreateTopic(topic="orders", queue_nums=8))
        eventually(lambda: "already registered at " + a.address in twin.output())
        with Producer(namesrv=ns.address) as producer:
            sent = [producer.send(Message("orders", b"%d" % i)) for i in range(20)]
        assert {r.broker_name for r in sent} == {"broker-a"}
        stored = sum(
            ask(a.address, GetMaxOffset(topic="orders", queue_id=q)).offset for q in range(4)
        )
        assert stored == 20  # on the first broker's store
        # over several of the twin's attempts (one every 0.2 s) the route keeps the first
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            assert route(ns.address, "orders") == {"broker-a": (4, a.address)}
            time.sleep(0.1)
        assert twin.output().count("already registered") == 1  # said once, not per attempt
    finally:
        assert twin.terminate() == 0


def test_bad_controller_requests_answer_bad_request_and_nothing_is_saved(
    tmp_path: Path, namesrv_process: NamesrvFactory
) -> None:
    """A name server hosting the controller: heartbeats and switchovers with missing,
    mistyped, negative or huge fields are refused naming the field; no broker set appears,
    nothing is written to controller.json, and the controller answers on."""
    ns = namesrv_process("ns")
    ns.args = ["--controller-store", str(tmp_path / "ctl")]
    ns.start()
    good = {
        "cluster": "C", "broker_name": "a", "broker_id": 1, "address": "127.0.0.1:1",
        "ha_address": "127.0.0.1:2", "offset": 0, "epoch": 1,
    }  # fmt: skip
    cases = [
        (RequestCode.CONTROLLER_HEARTBEAT, {**good, "broker_id": "one"}, "'broker_id'"),
        (RequestCode.CONTROLLER_HEARTBEAT, {**good, "broker_id": -1}, "'broker_id'"),
        (RequestCode.CONTROLLER_HEARTBEAT, {**good, "broker_id": 2**40}, "'broker_id'"),
        (RequestCode.CONTROLLER_HEARTBEAT, {**good, "offset": -5}, "'offset'"),
        (RequestCode.CONTROLLER_HEARTBEAT, {**good, "epoch": [1]}, "'epoch'"),
        (RequestCode.CONTROLLER_HEARTBEAT, {**good, "master_silent_ms": -7}, "master_silent_ms"),
        (RequestCode.CONTROLLER_HEARTBEAT, {**good, "master": None}, "'master'"),
        (RequestCode.CONTROLLER_HEARTBEAT, {"cluster": "C"}, "broker_name"),
        (RequestCode.CONTROLLER_ELECT_MASTER, {"broker_name": "a", "timeout_ms": 0}, "timeout_ms"),
        (RequestCode.CONTROLLER_ELECT_MASTER, {"broker_name": "a", "broker_id": -9}, "broker_id"),
    ]
    client = RawClient(ns.address)
    with client.sock:
        for rid, (code, header, field) in enumerate(cases, 1):
            frame = client.request(code, header, rid=rid)
            error = msgpack.unpackb(frame.header)["error"]
            assert (frame.code, field in error) == (ResponseCode.BAD_REQUEST, True), error
    assert ask(ns.address, GetReplicaInfo()).sets == []
    assert not (tmp_path / "ctl" / "controller.json").exists()


def test_a_damaged_controller_state_file_is_set_aside_and_the_controller_starts(
    tmp_path: Path,
) -> None:
    store = tmp_path / "ctl"
    store.mkdir()
    (store / "controller.json").write_text('{"sets": {"a": {"cluster": "C", "epoch": "x"}')
    ok = Controller(store)
    assert ok.sets == {}
    assert any(p.name.startswith("controller.json.bad-") for p in store.iterdir())
