"""txmq's gRPC endpoint: messages cross between txmq's own clients and the official
RocketMQ 5 client both ways; bad requests get RocketMQ's codes with a readable message;
the endpoint's port is chosen, defaulted or refused clearly."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc
from sqlalchemy import insert
from sqlalchemy.orm import Session

import txmq
from tests.conftest import ROOT, BrokerProcess, ask, free_port, wait_for
from tests.grpc_support import (
    FilterExpression,
    GrpcBroker,
    Producer,
    SimpleConsumer,
    TransactionChecker,
    grpc_broker,
    make_message,
    receive_all,
    started,
)
from tests.outbox_support import effects, make_db
from txmq import Message, MessageExt
from txmq.protocol.wire import GetTopicRoute, GetTopicStats, UpdateAndCreateTopic
from txmq.protocol.wire.errors import TopicNotFound
from txmq.sync import Producer as TxmqProducer
from txmq.sync import PushConsumer as TxmqPushConsumer

__all__ = ["grpc_broker"]

pytestmark = pytest.mark.timeout(120)


def test_txmq_producer_to_the_official_consumer(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    with TxmqProducer(gb.address) as producer:
        sent = [
            producer.send(
                Message(
                    "crossing",
                    b"txmq %d" % i,
                    tags="t",
                    keys=f"k{i}",
                    properties={"origin": "txmq"},
                ),
                sharding_key="order-9" if i < 3 else None,
            )
            for i in range(6)
        ]
    sub = {"crossing": FilterExpression("t")}
    with started(SimpleConsumer(gb.config(), "official", sub, await_duration=2)) as consumer:
        got = receive_all(consumer, 6)
    assert sorted(m.message_id for m in got) == sorted(r.msg_id for r in sent)
    m = next(m for m in got if m.body == b"txmq 1")
    assert m.tag == "t" and m.keys == {"k1"} and m.properties == {"origin": "txmq"}
    assert m.message_group == "order-9"  # txmq's sharding key is RocketMQ 5's message group


def test_official_producer_to_a_txmq_consumer_same_queue_for_a_group(grpc_broker: Any) -> None:
    gb: GrpcBroker = grpc_broker()
    got: dict[str, MessageExt] = {}
    lock = threading.Lock()

    def listener(msg: MessageExt) -> None:
        with lock:
            got[msg.msg_id] = msg

    consumer = TxmqPushConsumer(
        gb.address, group="txmq-side", listener=listener, consume_from="FIRST_OFFSET"
    )
    consumer.subscribe("other-way")
    with started(Producer(gb.config(), ("other-way",))) as producer, consumer:
        ids = [
            producer.send(
                make_message(
                    "other-way", b"rmq %d" % i, tag="x", keys=f"key{i}", message_group="g1"
                )
            ).message_id
            for i in range(5)
        ]
        wait_for(lambda: len(got) == 5, 30)
    assert sorted(got) == sorted(ids)
    assert {m.tags for m in got.values()} == {"x"} and got[ids[2]].keys == ["key2"]
    # a message group is a sharding key: one queue, the one txmq's producer picks for it
    assert {m.queue_id for m in got.values()} == {txmq.stable_hash("g1") % 4}
    assert {m.all_properties.get("SHARDING_KEY") for m in got.values()} == {"g1"}


def test_official_transaction_consumed_by_an_idempotent_consumer(
    grpc_broker: Any, tmp_path: Path
) -> None:
    gb: GrpcBroker = grpc_broker()

    class Never(TransactionChecker):  # type: ignore[misc]
        def check(self, message: Any) -> Any:
            raise AssertionError("the transaction was ended by the producer")

    with make_db("sqlite", tmp_path) as db:

        @txmq.idempotent(db.engine, group="ship")
        def apply(msg: MessageExt, session: Session) -> None:
            session.execute(insert(effects).values(key=msg.msg_id, body=msg.body.decode()))

        consumer = TxmqPushConsumer(
            gb.address, group="ship", listener=apply, consume_from="FIRST_OFFSET"
        )
        consumer.subscribe("shipments")
        with started(Producer(gb.config(), ("shipments",), Never())) as producer, consumer:
            tx = producer.begin_transaction()
            receipt = producer.send(make_message("shipments", b"ship order 7"), tx)
            tx.commit()
            wait_for(lambda: db.effects() == [(receipt.message_id, "ship order 7")], 30)


# -- bad requests ---------------------------------------------------------------------------


@pytest.fixture
def stub(grpc_broker: Any) -> Any:
    gb: GrpcBroker = grpc_broker("--no-auto-create-topic")
    channel = grpc.insecure_channel(gb.endpoint)
    yield spb_grpc.MessagingServiceStub(channel), gb
    channel.close()


META = (("x-mq-client-id", "test-client"),)


def call(method: Any, request: Any) -> Any:
    return method(request, metadata=META, timeout=10)


def test_bad_requests_get_rocketmq_codes(stub: Any) -> None:
    s, gb = stub
    txmq.sync.AdminClient(gb.address).start().create_topic("known", queue_nums=2)
    known = pb.Resource(name="known")
    r = call(s.QueryRoute, spb.QueryRouteRequest(topic=pb.Resource(name="nowhere")))
    assert r.status.code == pb.TOPIC_NOT_FOUND and "nowhere" in r.status.message
    r = call(s.QueryRoute, spb.QueryRouteRequest(topic=pb.Resource(name="bad topic!")))
    assert r.status.code in (pb.ILLEGAL_TOPIC, pb.TOPIC_NOT_FOUND)
    r = call(
        s.QueryRoute,
        spb.QueryRouteRequest(topic=pb.Resource(name="known", resource_namespace="ns1")),
    )
    assert r.status.code == pb.ILLEGAL_TOPIC and "namespace" in r.status.message
    r = call(s.QueryRoute, spb.QueryRouteRequest(topic=known))
    assert r.status.code == pb.OK and [q.id for q in r.message_queues] == [0, 1]
    assert r.message_queues[0].permission == pb.READ_WRITE
    assert set(r.message_queues[0].accept_message_types) >= {pb.NORMAL, pb.FIFO, pb.TRANSACTION}
    assert r.message_queues[0].broker.endpoints.addresses[0].port == gb.grpc_port

    def send(body: bytes, **sp: Any) -> Any:
        msg = pb.Message(
            topic=known, body=body, system_properties=pb.SystemProperties(message_id="M1", **sp)
        )
        return call(s.SendMessage, spb.SendMessageRequest(messages=[msg]))

    assert send(b"").status.code == pb.MESSAGE_BODY_EMPTY
    big = send(b"x" * (4 * 1024 * 1024 + 1))
    assert big.status.code == pb.MESSAGE_BODY_TOO_LARGE and "limit" in big.status.message
    assert send(b"ok", tag="a||b").status.code == pb.ILLEGAL_MESSAGE_TAG
    conflict = send(b"x", message_type=pb.TRANSACTION, message_group="g")
    assert conflict.status.code == pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE
    reserved = call(
        s.SendMessage,
        spb.SendMessageRequest(
            messages=[pb.Message(topic=known, body=b"x", user_properties={"UNIQ_KEY": "x"})]
        ),
    )
    assert reserved.status.code == pb.ILLEGAL_MESSAGE_PROPERTY_KEY
    ok = send(b"fine")
    assert ok.status.code == pb.OK and ok.entries[0].message_id == "M1"

    end = call(
        s.EndTransaction,
        spb.EndTransactionRequest(
            topic=known, message_id="M1", transaction_id="not-hex", resolution=pb.COMMIT
        ),
    )
    assert end.status.code == pb.INVALID_TRANSACTION_ID
    end = call(
        s.EndTransaction,
        spb.EndTransactionRequest(
            topic=known, message_id="M1", transaction_id="0000000000000000", resolution=pb.COMMIT
        ),
    )
    assert end.status.code == pb.INVALID_TRANSACTION_ID and "not a half" in end.status.message

    group = pb.Resource(name="g")
    ack = call(
        s.AckMessage,
        spb.AckMessageRequest(
            group=group,
            topic=known,
            entries=[spb.AckMessageEntry(message_id="M1", receipt_handle="forged")],
        ),
    )
    assert ack.status.code == pb.INVALID_RECEIPT_HANDLE
    change = call(
        s.ChangeInvisibleDuration,
        spb.ChangeInvisibleDurationRequest(
            group=group, topic=known, receipt_handle="forged", message_id="M1"
        ),
    )
    assert change.status.code == pb.ILLEGAL_INVISIBLE_TIME
    change = call(
        s.ChangeInvisibleDuration,
        spb.ChangeInvisibleDurationRequest(
            group=group,
            topic=known,
            receipt_handle="forged",
            message_id="M1",
            invisible_duration={"seconds": 5},
        ),
    )
    assert change.status.code == pb.INVALID_RECEIPT_HANDLE

    receive = spb.ReceiveMessageRequest(
        group=group,
        message_queue=pb.MessageQueue(topic=known),
        filter_expression=pb.FilterExpression(type=pb.SQL, expression="a > 1"),
        batch_size=1,
    )
    [only] = list(s.ReceiveMessage(receive, metadata=META, timeout=10))
    assert only.status.code == pb.NOT_IMPLEMENTED and "SQL92" in only.status.message
    receive.filter_expression.CopyFrom(pb.FilterExpression(type=pb.TAG, expression="a ||"))
    [only] = list(s.ReceiveMessage(receive, metadata=META, timeout=10))
    assert only.status.code == pb.ILLEGAL_FILTER_EXPRESSION
    receive.filter_expression.CopyFrom(pb.FilterExpression(type=pb.TAG, expression="*"))
    receive.batch_size = 1000
    [only] = list(s.ReceiveMessage(receive, metadata=META, timeout=10))
    assert only.status.code == pb.BAD_REQUEST and "batch_size" in only.status.message

    [pulled] = list(s.PullMessage(spb.PullMessageRequest(group=group), metadata=META, timeout=10))
    assert pulled.status.code == pb.NOT_IMPLEMENTED and "PullMessage" in pulled.status.message
    offset = call(s.QueryOffset, spb.QueryOffsetRequest())
    assert offset.status.code == pb.NOT_IMPLEMENTED

    # a Telemetry stream without a client id is told so and ended
    [answer] = list(s.Telemetry(iter([spb.TelemetryCommand()]), timeout=10))
    assert answer.status.code == pb.CLIENT_ID_REQUIRED
    assert gb.process.alive()  # and nothing of the above upset the broker


def test_settings_answer_the_clients(stub: Any) -> None:
    s, _ = stub
    settings = pb.Settings(
        client_type=pb.SIMPLE_CONSUMER,
        subscription=pb.Subscription(
            group=pb.Resource(name="g"),
            subscriptions=[pb.SubscriptionEntry(topic=pb.Resource(name="known"))],
        ),
    )
    stream = s.Telemetry(iter([spb.TelemetryCommand(settings=settings)]), metadata=META, timeout=5)
    first = next(stream)
    stream.cancel()
    assert first.status.code == pb.OK
    assert first.settings.backoff_policy.max_attempts == 17  # 16 retries, RocketMQ's default
    assert len(first.settings.backoff_policy.customized_backoff.next) == 16
    assert first.settings.subscription.receive_batch_size == 32
    assert first.settings.subscription.long_polling_timeout.seconds == 20


# -- the port -------------------------------------------------------------------------------


def test_a_chosen_grpc_port_that_is_taken_stops_the_start(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "txmq.cli",
                "broker",
                "start",
                "--store",
                str(tmp_path / "s"),
                "--port",
                "0",
                "--grpc-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
    assert out.returncode != 0
    assert f"gRPC port 127.0.0.1:{port} is in use" in out.stderr
    assert "--grpc-port" in out.stderr and "Traceback" not in out.stderr


def test_off_and_bad_grpc_ports(tmp_path: Path) -> None:
    bp = BrokerProcess(tmp_path / "s", ["--grpc-port", "0"], tmp_path / "b.log").start()
    try:
        assert "gRPC endpoint" not in bp.output()
    finally:
        bp.terminate()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "txmq.cli",
            "broker",
            "start",
            "--store",
            str(tmp_path / "s2"),
            "--grpc-port",
            "70000",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode != 0 and "grpc_port 70000" in out.stderr
    assert "Traceback" not in out.stderr


# -- a cluster ------------------------------------------------------------------------------


def test_one_brokers_endpoint_routes_over_the_whole_cluster(
    namesrv_process: Any, cluster_broker: Any
) -> None:
    ns = namesrv_process().start()
    ports = {name: free_port() for name in ("broker-a", "broker-b")}
    brokers = [
        cluster_broker(name, [ns.address], "--grpc-port", str(port)).start()
        for name, port in ports.items()
    ]
    for bp in brokers:
        ask(bp.address, UpdateAndCreateTopic(topic="spread", queue_nums=2))

    def routed() -> bool:
        try:
            route = ask(ns.address, GetTopicRoute(topic="spread"))
        except TopicNotFound:
            return False
        return len(route.queues) == 2 and all(b.grpc_addresses for b in route.brokers)

    wait_for(routed, 15)
    from tests.grpc_support import ClientConfiguration, Credentials, Recorder
    from tests.grpc_support import PushConsumer as OfficialPush

    # the clients know broker-a's endpoint alone
    cfg = ClientConfiguration(f"127.0.0.1:{ports['broker-a']}", Credentials(), request_timeout=5)
    rec = Recorder()
    sub = {"spread": FilterExpression("*")}
    with (
        started(Producer(cfg, ("spread",))) as producer,
        started(OfficialPush(cfg, "spreaders", rec, sub)),
    ):
        ids = [producer.send(make_message("spread", b"m%d" % i)).message_id for i in range(40)]
        rec.wait(40, 60)
    assert sorted(m for m, _, _, _ in rec.got) == sorted(ids)
    # both broker sets stored some of them
    stored = {
        bp.address: sum(q.max_offset for q in ask(bp.address, GetTopicStats(topic="spread")).queues)
        for bp in brokers
    }
    assert sum(stored.values()) == 40 and all(n > 0 for n in stored.values()), stored
