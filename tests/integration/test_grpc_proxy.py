"""``txmq proxy start`` (RocketMQ 5's proxy in cluster mode): the official RocketMQ 5 client,
given two proxies, against a cluster of a name server and two broker sets, all real
processes: sends and receives across both sets, transactions with commit, rollback and
check-back through a proxy, FIFO order per message group, and a proxy SIGKILLed while a
producer and a consumer work (every acknowledged send is received)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BrokerProcess, NamesrvProcess, ask, wait_for
from tests.grpc_support import (
    FAST_LEVELS,
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Producer,
    ProxyProcess,
    SimpleConsumer,
    TransactionChecker,
    make_message,
    receive_all,
    started,
)
from txmq.protocol.wire import (
    GetTopicRoute,
    GetTopicStats,
    UpdateAndCreateTopic,
    UpdateSubscriptionGroup,
)
from txmq.protocol.wire.errors import TopicNotFound

pytestmark = pytest.mark.timeout(120)

BROKER_ENV = {
    "TXMQ_BROKER_TRANSACTION_CHECK_INTERVAL_S": "1",
    "TXMQ_BROKER_TRANSACTION_TIMEOUT_S": "2",
    "TXMQ_BROKER_MESSAGE_DELAY_LEVELS": FAST_LEVELS,
}


@dataclass
class Cluster:
    workdir: Path
    ns: NamesrvProcess
    brokers: list[BrokerProcess]
    proxies: list[ProxyProcess]

    def proxy(self, name: str) -> ProxyProcess:
        p = ProxyProcess(self.workdir, self.ns.address, name).start()
        self.proxies.append(p)
        return p

    def config(self, *proxies: ProxyProcess) -> Any:
        """The official client's configuration: every proxy given (default: the first
        two)."""
        endpoints = ";".join(p.address for p in (proxies or self.proxies[:2]))
        return ClientConfiguration(endpoints, Credentials(), request_timeout=5)

    def topic(self, topic: str, queues: int = 2) -> None:
        """``topic`` on both broker sets, known to the name server."""
        for bp in self.brokers:
            ask(bp.address, UpdateAndCreateTopic(topic=topic, queue_nums=queues))

        def routed() -> bool:
            try:
                route = ask(self.ns.address, GetTopicRoute(topic=topic))
            except TopicNotFound:
                return False
            return len(route.queues) == len(self.brokers)

        wait_for(routed, 15)

    def stored(self, topic: str) -> list[int]:
        """Messages each broker set holds of ``topic``."""
        return [
            sum(q.max_offset for q in ask(bp.address, GetTopicStats(topic=topic)).queues)
            for bp in self.brokers
        ]

    def fifo_group(self, group: str) -> None:
        for bp in self.brokers:
            assert ask(bp.address, UpdateSubscriptionGroup(group=group, fifo=True)).fifo


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A name server, broker sets broker-a and broker-b, and two proxies (for the module's
    tests: a test that kills a proxy starts proxies of its own)."""
    work = tmp_path_factory.mktemp("proxy-cluster")
    ns = NamesrvProcess(work, "namesrv")
    made: list[Any] = [ns]
    c = Cluster(work, ns, [], [])
    try:
        ns.start()
        for name in ("broker-a", "broker-b"):
            cli = ["--namesrv", ns.address, "--cluster", "C", "--broker-name", name]
            bp = BrokerProcess(work / f"store-{name}", cli, work / f"{name}.log", env=BROKER_ENV)
            made.append(bp)
            c.brokers.append(bp.start())
        c.proxy("proxy-1")
        c.proxy("proxy-2")
        yield c
    finally:
        for proc in [*made, *c.proxies]:
            if proc.alive():
                proc.kill()


def test_send_and_receive_across_both_broker_sets(cluster: Cluster) -> None:
    cluster.topic("spread")
    cfg = cluster.config()
    with started(Producer(cfg, ("spread",))) as producer:
        ids = [producer.send(make_message("spread", b"m%d" % i)).message_id for i in range(40)]
    assert all(n > 0 for n in cluster.stored("spread")) and sum(cluster.stored("spread")) == 40
    sub = {"spread": FilterExpression("*")}
    with started(SimpleConsumer(cfg, "spreaders", sub, await_duration=1)) as consumer:
        got = receive_all(consumer, 40)
        assert consumer.receive(32, 15) == []  # all acked through the proxies
    assert sorted(m.message_id for m in got) == sorted(ids)
    # a receipt handle names its broker set: an ack goes there through any proxy
    assert {m.receipt_handle.partition(":")[0] for m in got} == {"broker-a", "broker-b"}


class Checker(TransactionChecker):  # type: ignore[misc]
    def __init__(self, answers: dict[bytes, Any]) -> None:
        self.answers = answers
        self.checked: list[bytes] = []

    def check(self, message: Any) -> Any:
        self.checked.append(message.body)
        return self.answers[message.body]


def test_transactions_commit_rollback_and_check_back_through_a_proxy(cluster: Cluster) -> None:
    from rocketmq.grpc_protocol import TransactionResolution

    cluster.topic("payments")
    cfg = cluster.config()
    checker = Checker(
        {
            b"undecided-yes": TransactionResolution.COMMIT,
            b"undecided-no": TransactionResolution.ROLLBACK,
        }
    )
    with started(Producer(cfg, ("payments",), checker)) as producer:
        for body, end in (
            (b"committed", "commit"),
            (b"rolled-back", "rollback"),
            (b"undecided-yes", None),
            (b"undecided-no", None),
        ):
            tx = producer.begin_transaction()
            producer.send(make_message("payments", body), tx)
            if end == "commit":
                tx.commit()
            elif end == "rollback":
                tx.rollback()
        sub = {"payments": FilterExpression("*")}
        with started(SimpleConsumer(cfg, "ledger", sub, await_duration=1)) as consumer:
            got = receive_all(consumer, 2, timeout=40)
            # the rolled-back and the rejected halves never come
            assert consumer.receive(32, 15) == []
    assert sorted(m.body for m in got) == [b"committed", b"undecided-yes"]
    # each undecided half's broker set asked the proxy, which asked the producer over its
    # Telemetry stream; the answer went back through the proxy to that set
    assert sorted(set(checker.checked)) == [b"undecided-no", b"undecided-yes"]


def test_fifo_order_per_message_group(cluster: Cluster) -> None:
    cluster.topic("fifo")
    cluster.fifo_group("fifo-readers")
    cfg = cluster.config()
    groups = ("alpha", "beta", "gamma", "delta")
    n = 100
    with started(Producer(cfg, ("fifo",))) as producer:
        for i in range(n):
            for g in groups:
                producer.send(make_message("fifo", f"{g}:{i}".encode(), message_group=g))
    seen: dict[str, list[int]] = {g: [] for g in groups}
    sub = {"fifo": FilterExpression("*")}
    with started(SimpleConsumer(cfg, "fifo-readers", sub, await_duration=1)) as consumer:
        deadline = time.monotonic() + 60
        total = 0
        while total < n * len(groups):
            assert time.monotonic() < deadline, f"received {total} of {n * len(groups)}"
            batch = consumer.receive(32, 20)
            for m in batch:
                group, _, i = m.body.decode().partition(":")
                assert m.message_group == group
                seen[group].append(int(i))
            for m in batch:
                consumer.ack(m)
            total += len(batch)
    for g in groups:
        assert seen[g] == list(range(n)), g  # each group in order, each message once
    assert all(s > 0 for s in cluster.stored("fifo"))  # the groups spread over both sets


def test_a_proxy_killed_while_clients_work_loses_no_acknowledged_message(
    cluster: Cluster,
) -> None:
    cluster.topic("orders")
    mine = [cluster.proxy("kill-1"), cluster.proxy("kill-2")]
    cfg = cluster.config(*mine)
    # the client's channel to "p1;p2" uses the first address (gRPC's pick_first over the
    # sorted list) and moves to the other when it fails: that first one is killed
    victim = min(mine, key=lambda p: p.address)
    acked: list[bytes] = []
    received: set[bytes] = set()
    sent_enough = threading.Event()
    stop = threading.Event()
    errors: list[str] = []

    def produce(producer: Any) -> None:
        i = 0
        while not stop.is_set() and i < 400:
            body = b"order %d" % i
            i += 1
            try:
                producer.send(make_message("orders", body))
            except Exception as exc:  # not acknowledged: it need not arrive
                errors.append(f"send: {exc}")
                continue
            acked.append(body)
            if len(acked) == 150:
                sent_enough.set()
            time.sleep(0.005)
        sent_enough.set()

    sub = {"orders": FilterExpression("*")}
    with (
        started(Producer(cfg, ("orders",))) as producer,
        started(SimpleConsumer(cfg, "orders-readers", sub, await_duration=1)) as consumer,
    ):

        def consume() -> None:
            while not stop.is_set():
                try:
                    batch = consumer.receive(32, 3)  # an unacked message is back in 3 s
                except Exception as exc:  # the proxy died under the receive
                    errors.append(f"receive: {exc}")
                    time.sleep(0.1)
                    continue
                for m in batch:
                    received.add(m.body)
                    try:
                        consumer.ack(m)
                    except Exception as exc:  # delivered again later: counted once
                        errors.append(f"ack: {exc}")

        threads = [
            threading.Thread(target=produce, args=(producer,)),
            threading.Thread(target=consume),
        ]
        for t in threads:
            t.start()
        try:
            assert sent_enough.wait(60)
            victim.kill()  # SIGKILL
            threads[0].join(60)
            assert not threads[0].is_alive()
            wait_for(lambda: set(acked) <= received, 45)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert len(acked) > 150, (len(acked), errors[:5])  # sends went on through the other proxy
    missing = sorted(set(acked) - received)
    assert missing == [], (len(missing), errors[:5])


def test_a_broker_set_down_sends_go_to_the_other_and_receives_say_so(
    namesrv_process: Any, cluster_broker: Any, tmp_path: Path
) -> None:
    import grpc
    from rocketmq.grpc_protocol import definition_pb2 as pb
    from rocketmq.grpc_protocol import service_pb2 as spb
    from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

    ns = namesrv_process().start()
    brokers = [cluster_broker(name, [ns.address]).start() for name in ("broker-a", "broker-b")]
    c = Cluster(tmp_path, ns, brokers, [])
    try:
        c.topic("jobs")
        proxy = c.proxy("proxy")
        with started(Producer(c.config(proxy), ("jobs",))) as producer:
            for i in range(4):  # the proxy has the route of both sets now
                producer.send(make_message("jobs", b"before %d" % i))
            assert all(n > 0 for n in c.stored("jobs"))
            brokers[1].kill()  # SIGKILL
            # a receive from broker-b's assignment: the status a broker's own endpoint
            # answers when what it needs is unreachable (INTERNAL_SERVER_ERROR: retried)
            with grpc.insecure_channel(proxy.address) as channel:
                stub = spb_grpc.MessagingServiceStub(channel)
                receive = spb.ReceiveMessageRequest(
                    group=pb.Resource(name="workers"),
                    message_queue=pb.MessageQueue(
                        topic=pb.Resource(name="jobs"), id=-1, broker=pb.Broker(name="broker-b")
                    ),
                    filter_expression=pb.FilterExpression(type=pb.TAG, expression="*"),
                    batch_size=1,
                )
                meta = (("x-mq-client-id", "probe"),)
                [answer] = list(stub.ReceiveMessage(receive, metadata=meta, timeout=10))
            assert answer.status.code == pb.INTERNAL_SERVER_ERROR, answer.status
            assert "broker" in answer.status.message
            # sends the proxy tries on broker-b go to broker-a: none fails
            for i in range(20):
                producer.send(make_message("jobs", b"after %d" % i))
        stats = ask(brokers[0].address, GetTopicStats(topic="jobs"))
        assert sum(q.max_offset for q in stats.queues) >= 20
        assert proxy.alive()
    finally:
        for p in c.proxies:
            if p.alive():
                p.kill()
