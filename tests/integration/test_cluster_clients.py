"""Clients through name servers, as real processes: producers spread over two broker sets
and steer around a killed one, push consumers rebalance over every queue of every broker
set, a topic is created on first send, a broker added later takes traffic, a name server
stopped changes nothing, a transactional producer restarted gets the check-backs of every
broker set."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

import txmq
from tests.conftest import ROOT, BrokerProcess, NamesrvProcess, ask, wait_for
from txmq import Message
from txmq.client.transaction import LocalTransactionState
from txmq.protocol.message import MessageExt, Prop
from txmq.protocol.wire import GetClusterInfo, GetTopicRoute, UpdateAndCreateTopic
from txmq.protocol.wire.errors import TopicNotFound, TxmqError
from txmq.sync import AdminClient, Producer, PullConsumer, PushConsumer, TransactionProducer

NamesrvFactory = Callable[..., NamesrvProcess]
BrokerFactory = Callable[..., BrokerProcess]


def _cluster(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory, brokers: int = 2
) -> tuple[list[NamesrvProcess], list[BrokerProcess], str]:
    names = [namesrv_process(f"ns{i}").start() for i in range(2)]
    addrs = [ns.address for ns in names]
    bps = [cluster_broker(f"broker-{chr(97 + i)}", addrs).start() for i in range(brokers)]
    return names, bps, ";".join(addrs)


def _routed(names: list[NamesrvProcess], topic: str, broker_sets: int) -> None:
    """Wait until every name server routes ``topic`` over ``broker_sets`` broker sets (a
    broker registers a new topic right away, but not before answering its creation)."""

    def done() -> bool:
        for ns in names:
            try:
                if len(ask(ns.address, GetTopicRoute(topic=topic)).queues) != broker_sets:
                    return False
            except TopicNotFound:
                return False
        return True

    wait_for(done, timeout=10, interval=0.05)


def _topic(
    names: list[NamesrvProcess], brokers: list[BrokerProcess], topic: str, queues: int
) -> None:
    """Create ``topic`` on every broker and wait until the name servers route it so."""
    for bp in brokers:
        ask(bp.address, UpdateAndCreateTopic(topic=topic, queue_nums=queues))
    _routed(names, topic, len(brokers))


def _stop(names: list[NamesrvProcess], brokers: list[BrokerProcess]) -> None:
    """Stop every broker and name server still running; each must stop cleanly."""
    for proc in [*brokers, *names]:
        if proc.alive():
            assert proc.terminate() == 0, proc.output()[-2000:]


def _topic_create(namesrv: str, topic: str, cluster: str) -> dict[str, int]:
    """``txmq admin topic-create TOPIC --queues 2 --cluster CLUSTER --namesrv NAMESRV``;
    the queue count it made on each broker set."""
    out = subprocess.run(
        [sys.executable, "-m", "txmq.cli", "admin", "topic-create", topic, "--queues", "2",
         "--cluster", cluster, "--namesrv", namesrv, "--json"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    [created] = json.loads(out.stdout)
    assert created["topic"] == topic
    return dict(created["brokers"])


class Collector:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: dict[str, MessageExt] = {}

    def __call__(self, msg: MessageExt) -> None:
        with self.lock:
            self.got[msg.msg_id] = msg


def test_sends_spread_over_broker_sets_and_consumers_get_every_message(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker)
    _topic(names, brokers, "orders", 4)
    received = Collector()
    consumer = PushConsumer(
        namesrv=namesrv, group="billing", listener=received, consume_from="FIRST_OFFSET"
    )
    consumer.subscribe("orders")
    with Producer(namesrv=namesrv) as producer, consumer:
        sent = [producer.send(Message("orders", b"%d" % i)) for i in range(200)]
        # round robin over all 8 queues of both broker sets
        per_broker = {r.broker_name for r in sent}
        assert per_broker == {"broker-a", "broker-b"}
        assert {(r.broker_name, r.queue_id) for r in sent} == {
            (b, q) for b in ("broker-a", "broker-b") for q in range(4)
        }
        wait_for(lambda: len(received.got) == 200, timeout=30)
        assert {m.broker_name for m in received.got.values()} == {"broker-a", "broker-b"}
        assert sorted(received.got) == sorted(r.msg_id for r in sent)
        assert len(consumer.queues_held()) == 8 + 2  # and the retry topic on each broker
        # a topic no broker has is created on first send on every broker set
        fresh = [producer.send(Message("born-in-cluster", b"x")) for _ in range(16)]
        assert {r.broker_name for r in fresh} == {"broker-a", "broker-b"}
    with PullConsumer(namesrv=namesrv) as pc:
        queues = pc.message_queues("born-in-cluster")
        assert {q.broker_name for q in queues} == {"broker-a", "broker-b"}
        total = 0
        for q in queues:
            got = pc.pull(q.topic, q.queue_id, 0, long_poll=0, broker_name=q.broker_name)
            total += len(got.messages)
        assert total == 16
    _stop(names, brokers)


def test_a_killed_broker_set_is_steered_around_and_nothing_acknowledged_is_lost(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker)
    _topic(names, brokers, "pay", 2)
    acked: list[str] = []
    with Producer(namesrv=namesrv, send_timeout=3) as producer:
        for i in range(100):
            acked.append(producer.send(Message("pay", b"a%d" % i)).msg_id)
        brokers[1].kill()
        # every sync send still succeeds: a failure is retried on the other broker set,
        # which is then preferred while the dead one is left out
        after = [producer.send(Message("pay", b"b%d" % i)) for i in range(100)]
        assert {r.broker_name for r in after[-50:]} == {"broker-a"}
        acked += [r.msg_id for r in after]
        brokers[1].start()  # the same store: what it acknowledged is still there
    received = Collector()
    consumer = PushConsumer(
        namesrv=namesrv, group="ledger", listener=received, consume_from="FIRST_OFFSET"
    )
    consumer.subscribe("pay")
    with consumer:
        wait_for(lambda: set(acked) <= set(received.got), timeout=60)
    _stop(names, brokers)


def test_one_name_server_stopped_changes_nothing_and_a_new_broker_takes_traffic(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker, brokers=1)
    assert _topic_create(namesrv, "grow", "C") == {"broker-a": 2}
    _routed(names, "grow", 1)
    received = Collector()
    consumer = PushConsumer(namesrv=namesrv, group="grow-g", listener=received,
                            rebalance_interval=0.5, consume_from="FIRST_OFFSET")  # fmt: skip
    consumer.subscribe("grow")
    with Producer(namesrv=namesrv, route_ttl=0.5) as producer, consumer:
        assert producer.send(Message("grow", b"1")).broker_name == "broker-a"
        assert names[0].terminate() == 0
        assert producer.send(Message("grow", b"2")).broker_name == "broker-a"
        # scaling out: one more broker set with the same name servers, the topic on it
        added = cluster_broker("broker-b", [ns.address for ns in names]).start()
        # as an operator does it (one of the name servers listed is down)
        assert _topic_create(namesrv, "grow", "C") == {"broker-a": 2, "broker-b": 2}
        on_b: list[str] = []

        def reaches_b() -> bool:
            sent = producer.send(Message("grow", b"more"))
            if sent.broker_name == "broker-b":
                on_b.append(sent.msg_id)
            return bool(on_b)

        wait_for(reaches_b, timeout=20, interval=0.1)
        # the running consumer rebalances onto broker-b's queues and gets what went there
        wait_for(lambda: set(on_b) <= set(received.got), timeout=20)
        assert {mq.broker_name for mq in consumer.queues_held()} == {"broker-a", "broker-b"}
        assert added.terminate() == 0
    assert brokers[0].terminate() == 0
    names[1].terminate()


@pytest.mark.parametrize("bad", ["h1:9876;nonsense"])
def test_a_client_given_a_bad_name_server_list_says_so(bad: str) -> None:
    with pytest.raises(ValueError, match="'nonsense' is not HOST:PORT"):
        Producer(namesrv=bad)
    with pytest.raises(ValueError, match="not both"):
        Producer("127.0.0.1:10911", namesrv="127.0.0.1:9876")


def test_a_key_on_a_dead_broker_set_fails_moves_later_or_at_once_as_chosen(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker)
    _topic(names, brokers, "keys", 2)
    # routes fetched when the test says (refresh=True), not when a short TTL runs out
    modes = {m: Producer(namesrv=namesrv, sharding=m) for m in ("route", "strict", "available")}
    for p in modes.values():
        p.start()
    try:
        route, strict, available = modes.values()
        on_b = next(
            f"key{i}" for i in range(100)
            if route.send(Message("keys", b"x"), sharding_key=f"key{i}").broker_name == "broker-b"
        )  # fmt: skip
        for p in modes.values():  # all agree on the key's queue while all is well
            assert p.send(Message("keys", b"y"), sharding_key=on_b).broker_name == "broker-b"
        brokers[1].kill()
        # at once: 'available' moves the key, the other two fail
        moved = available.send(Message("keys", b"z"), sharding_key=on_b)
        assert moved.broker_name == "broker-a"
        for p in (route, strict):
            with pytest.raises(TxmqError):
                p.send(Message("keys", b"z"), sharding_key=on_b)
        # once the route has dropped broker-b, 'route' moves it too; 'strict' never does
        _routed(names, "keys", 1)
        for p in modes.values():
            p.route("keys", refresh=True)
        assert route.send(Message("keys", b"w"), sharding_key=on_b).broker_name == "broker-a"
        with pytest.raises(TxmqError, match="strict key order: the send is not moved"):
            strict.send(Message("keys", b"w"), sharding_key=on_b)
        # broker-b back on its store: the key returns there in every mode
        brokers[1].start()
        _routed(names, "keys", 2)
        for p in modes.values():
            p.route("keys", refresh=True)
        for p in (route, strict):
            assert p.send(Message("keys", b"v"), sharding_key=on_b).broker_name == "broker-b"
    finally:
        for p in modes.values():
            p.stop()
    _stop(names, brokers)


def test_every_name_server_down_keeps_the_routes_known_and_a_topic_nobody_has_is_clear(
    namesrv_process: NamesrvFactory,
    cluster_broker: BrokerFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker, brokers=1)
    ask(brokers[0].address, UpdateAndCreateTopic(topic="kept", queue_nums=2))
    _routed(names, "kept", 1)
    with Producer(namesrv=namesrv, route_ttl=0.2) as producer:
        assert producer.send(Message("kept", b"1")).broker_name == "broker-a"
        for ns in names:
            assert ns.terminate() == 0
        deadline = time.monotonic() + 1.0  # several route lifetimes without a name server
        sent = 0
        while time.monotonic() < deadline:
            assert producer.send(Message("kept", b"more")).broker_name == "broker-a"
            sent += 1
        assert sent > 1
        assert caplog.text.count("keeping the one known") == 1  # said once, not per refresh
        # a topic no route knows, with no name server to ask: a clear error, nothing sent
        with pytest.raises(TxmqError, match="no name server answered"):
            producer.send(Message("never-routed", b"x"))
    assert brokers[0].terminate() == 0


def test_a_topic_no_broker_creates_is_a_clear_error(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    names = [namesrv_process("ns0").start()]
    broker = cluster_broker("broker-a", [names[0].address], "--no-auto-create-topic").start()
    with Producer(namesrv=names[0].address) as producer:
        with pytest.raises(TopicNotFound, match="does not exist and no broker created it"):
            producer.send(Message("nobody-has-it", b"x"))
    assert broker.terminate() == 0
    assert names[0].terminate() == 0


def test_a_failed_message_is_retried_through_its_own_broker_set(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    quick = {"TXMQ_BROKER_MESSAGE_DELAY_LEVELS": "100ms 100ms 100ms 100ms 100ms 100ms"}
    names = [namesrv_process(f"ns{i}").start() for i in range(2)]
    addrs = [ns.address for ns in names]
    brokers = [cluster_broker(f"broker-{c}", addrs, env=quick).start() for c in "ab"]
    _topic(names, brokers, "flaky", 1)
    namesrv = ";".join(addrs)
    attempts: dict[str, list[str]] = {}
    lock = threading.Lock()

    def listener(msg: MessageExt) -> bool:
        with lock:
            tries = attempts.setdefault(msg.body.decode(), [])
            tries.append(msg.broker_name)
            return len(tries) >= 3  # fail twice, then succeed

    consumer = PushConsumer(namesrv=namesrv, group="flaky-g", listener=listener,
                            rebalance_interval=0.5, consume_from="FIRST_OFFSET")  # fmt: skip
    consumer.subscribe("flaky")
    with Producer(namesrv=namesrv) as producer, consumer:
        sent = [producer.send(Message("flaky", b"m%d" % i)) for i in range(4)]
        assert {r.broker_name for r in sent} == {"broker-a", "broker-b"}
        wait_for(lambda: all(len(attempts.get(f"m{i}", [])) >= 3 for i in range(4)), timeout=60)
    for r, body in zip(sent, [f"m{i}" for i in range(4)], strict=True):
        # every delivery of a message, the retries included, came from the broker set that
        # first stored it: sent back there, re-stored in its %RETRY% queue
        assert set(attempts[body]) == {r.broker_name}, (body, attempts[body])
    _stop(names, brokers)


def test_a_store_names_its_broker_set_and_refuses_another(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    bp = broker_process("--cluster", "C", "--broker-name", "broker-a").start()
    assert bp.terminate() == 0
    recorded = json.loads((tmp_path / "store" / "config" / "broker.json").read_text())
    assert recorded == {"cluster": "C", "broker_name": "broker-a", "broker_id": 0}
    other = subprocess.run(
        [sys.executable, "-m", "txmq.cli", "broker", "start", "--store", str(tmp_path / "store"),
         "--port", "0", "--cluster", "C", "--broker-name", "broker-b"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert other.returncode == 1
    [line] = [x for x in other.stderr.splitlines() if x.startswith("txmq: error:")]
    assert "belongs to broker set 'broker-a' of cluster 'C'" in line, other.stderr
    assert "Traceback" not in other.stderr
    assert broker_process("--cluster", "C", "--broker-name", "broker-a").start().terminate() == 0


def test_half_messages_steer_around_a_dead_broker_set_too(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    names, brokers, namesrv = _cluster(namesrv_process, cluster_broker)
    _topic(names, brokers, "halves", 2)

    async def run() -> tuple[int, set[str]]:
        failed, on = 0, set()
        async with txmq.TransactionProducer(namesrv=namesrv, group="halves-tx") as producer:
            await producer.send_half(Message("halves", b"warm"), transaction_id="w")
            brokers[1].kill()
            for i in range(20):
                try:
                    r = await producer.send_half(Message("halves", b"h"), transaction_id=f"t{i}")
                except TxmqError:
                    failed += 1  # not retried (it would be a second half): once, then left out
                    continue
                on.add(r.broker_name)
        return failed, on

    failed, on = anyio.run(run)
    assert failed <= 1 and on == {"broker-a"}
    assert brokers[0].terminate() == 0
    for ns in names:
        assert ns.terminate() == 0


class Checks:
    """A transaction listener that answers every check-back with ``answer`` and records
    the transaction id of each."""

    def __init__(self, answer: LocalTransactionState) -> None:
        self.answer = answer
        self.lock = threading.Lock()
        self.checked: list[str] = []

    def execute_local_transaction(self, msg: Message, arg: object) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        with self.lock:
            self.checked.append(msg.get_property(Prop.TRANSACTION_ID) or "")
        return self.answer

    def ids(self) -> set[str]:
        with self.lock:
            return set(self.checked)


def test_a_restarted_transaction_producer_gets_the_check_backs_of_every_broker_set(
    namesrv_process: NamesrvFactory, cluster_broker: BrokerFactory
) -> None:
    # quick check-backs: a round every 0.2 s, a half message checked once 0.5 s old
    fast = {"TXMQ_BROKER_TRANSACTION_CHECK_INTERVAL_S": "0.2",
            "TXMQ_BROKER_TRANSACTION_TIMEOUT_S": "0.5"}  # fmt: skip
    names = [namesrv_process("ns0").start()]
    namesrv = names[0].address
    brokers = [cluster_broker(f"broker-{c}", [namesrv], env=fast).start() for c in "ab"]
    _topic(names, brokers, "undecided", 2)
    with AdminClient(namesrv=namesrv) as admin:

        def pending() -> dict[str, str]:
            return {r.transaction_id: r.broker_name for r in admin.transactions()}

        # a producer leaves one undecided half on each broker set, then is gone
        undecided = Checks(LocalTransactionState.UNKNOWN)
        with TransactionProducer(namesrv=namesrv, group="restart-tx", listener=undecided) as gone:
            for b in ("broker-a", "broker-b"):
                r = gone.send_half(Message("undecided", b"x"), transaction_id=f"on-{b}",
                                   broker_name=b, queue_id=0)  # fmt: skip
                assert r.broker_name == b
        assert pending() == {"on-broker-a": "broker-a", "on-broker-b": "broker-b"}
        # broker-b stops too, and comes back only after the new producer has started
        assert brokers[1].terminate() == 0
        checks = Checks(LocalTransactionState.COMMIT)
        with TransactionProducer(namesrv=namesrv, group="restart-tx", listener=checks,
                                 heartbeat_interval=0.3) as fresh:  # fmt: skip
            # it has sent nothing and knows no route, yet broker-a checks back with it
            wait_for(lambda: "on-broker-a" in checks.ids(), timeout=20)
            wait_for(lambda: "on-broker-a" not in pending(), timeout=20, interval=0.1)
            assert "on-broker-b" not in checks.ids()
            brokers[1].start()  # on another port: the name server's cluster info says where
            assert any(b.broker_name == "broker-b" for b in ask(namesrv, GetClusterInfo()).brokers)
            # within a heartbeat interval the producer heartbeats it: its check-back too
            wait_for(lambda: "on-broker-b" in checks.ids(), timeout=20)
            wait_for(lambda: not pending(), timeout=20, interval=0.1)
            assert fresh.aio.routes.cached("undecided") is None
        assert checks.ids() == {"on-broker-a", "on-broker-b"}
    # both committed: each delivered from the broker set that held its half
    with PullConsumer(namesrv=namesrv) as pc:
        got = {}
        for q in pc.message_queues("undecided"):
            pulled = pc.pull(q.topic, q.queue_id, 0, long_poll=0, broker_name=q.broker_name)
            for m in pulled.messages:
                got[m.get_property(Prop.TRANSACTION_ID)] = q.broker_name
    assert got == {"on-broker-a": "broker-a", "on-broker-b": "broker-b"}
    _stop(names, brokers)
