"""txmq's gRPC transport, without servers: messages and properties translated both ways,
RocketMQ status codes as txmq's errors, retry back-off, and transport selection."""

from __future__ import annotations

import pytest

pytest.importorskip("rocketmq.grpc_protocol.definition_pb2")

from rocketmq.grpc_protocol import definition_pb2 as pb

from txmq import AdminClient, Producer, PullConsumer, PushConsumer
from txmq.protocol.codec import decode_record, encode_message
from txmq.protocol.grpc_convert import (
    check_error,
    delay_ms,
    duration,
    error_of,
    from_proto,
    ms_of,
    timestamp,
    to_proto,
)
from txmq.protocol.message import Message, Prop
from txmq.protocol.wire.errors import (
    BadRequest,
    BrokerBusy,
    InvalidReceiptHandle,
    ServerError,
    TopicNotFound,
    TransactionNotFound,
    UnsupportedRequest,
)
from txmq.transports.grpc.receiving import backoff_s

NOW = 1_700_000_000_000


def test_outgoing_properties_become_system_properties() -> None:
    props = Message("t", b"x", tags="TagA", keys=["k1", "k2"], properties={"color": "red"})
    wire = props.wire_properties("MSGID")
    wire[Prop.SHARDING_KEY] = "order-7"
    m = to_proto("t", b"x", wire, born_ms=NOW - 5, now_ms=NOW)
    sp = m.system_properties
    assert m.topic.name == "t" and m.body == b"x"
    assert sp.message_id == "MSGID" and sp.tag == "TagA" and list(sp.keys) == ["k1", "k2"]
    assert sp.message_group == "order-7" and sp.message_type == pb.FIFO
    assert ms_of(sp.born_timestamp) == NOW - 5
    assert dict(m.user_properties) == {"color": "red"}


def test_delay_level_becomes_a_delivery_time() -> None:
    wire = Message("t", b"x", delay_level=3).wire_properties("ID")
    m = to_proto("t", b"x", wire, now_ms=NOW)
    assert m.system_properties.message_type == pb.DELAY
    assert ms_of(m.system_properties.delivery_timestamp) == NOW + 10_000  # level 3: 10 s
    assert delay_ms(1) == 1000 and delay_ms(18) == 7_200_000 and delay_ms(99) == 7_200_000
    exact = to_proto("t", b"x", {Prop.DELIVER_AT: str(NOW + 42)}, now_ms=NOW)
    assert ms_of(exact.system_properties.delivery_timestamp) == NOW + 42


def test_transactional_properties() -> None:
    wire = {
        Prop.UNIQ_KEY: "ID",
        Prop.TRAN_MSG: "true",
        Prop.PRODUCER_GROUP: "orders-tx",
        Prop.TRANSACTION_ID: "tx-1",
        Prop.CHECK_IMMUNITY_TIME_IN_SECONDS: "7.5",
    }
    m = to_proto("t", b"x", wire, now_ms=NOW)
    sp = m.system_properties
    assert sp.message_type == pb.TRANSACTION
    assert sp.orphaned_transaction_recovery_duration.seconds == 7
    # RocketMQ reserves __transactionId__: it travels under a name of txmq's own
    assert dict(m.user_properties) == {"txmq-transaction-id": "tx-1"}
    with pytest.raises(UnsupportedRequest, match="sharding key"):
        to_proto("t", b"x", {**wire, Prop.SHARDING_KEY: "k"})
    with pytest.raises(BadRequest, match="reserved"):
        to_proto("t", b"x", {"txmq-transaction-id": "forged"})


def test_incoming_message_becomes_a_message_ext() -> None:
    sp = pb.SystemProperties(
        message_id="ID",
        tag="TagA",
        keys=["k1", "k2"],
        message_group="order-7",
        message_type=pb.FIFO,
        born_timestamp=timestamp(NOW - 10),
        store_timestamp=timestamp(NOW),
        queue_id=3,
        queue_offset=12,
        delivery_attempt=3,
        receipt_handle="h",
        invisible_duration=duration(5000),
    )
    m = pb.Message(
        topic=pb.Resource(name="t"),
        system_properties=sp,
        user_properties={"color": "red", "txmq-transaction-id": "tx-1"},
        body=b"body",
    )
    msg = from_proto(m)
    assert (msg.topic, msg.body, msg.queue_id, msg.queue_offset) == ("t", b"body", 3, 12)
    assert msg.msg_id == "ID" and msg.tags == "TagA" and msg.keys == ["k1", "k2"]
    assert msg.get_property(Prop.SHARDING_KEY) == "order-7"
    assert msg.get_property(Prop.TRANSACTION_ID) == "tx-1"
    assert msg.properties == {"color": "red"}
    assert (msg.born_timestamp, msg.store_timestamp) == (NOW - 10, NOW)
    assert msg.reconsume_times == 2  # the third delivery attempt
    # a check-back's half goes to the core as the record txmq's broker would send
    again = decode_record(encode_message(msg), verify=True)
    again.store_size = msg.store_size  # the record's size, not the body's
    assert again == msg


def test_round_trip_keeps_what_a_listener_sees() -> None:
    original = Message("t", b"x", tags="a", keys="k", properties={"p": "1"})
    wire = original.wire_properties("ID")
    wire[Prop.TRANSACTION_ID] = "tx"
    wire[Prop.TRAN_MSG] = "true"
    msg = from_proto(to_proto("t", b"x", wire))
    assert msg.properties == {"p": "1"} and msg.tags == "a" and msg.keys == ["k"]
    assert msg.get_property(Prop.TRANSACTION_ID) == "tx" and msg.msg_id == "ID"


@pytest.mark.parametrize(
    ("code", "kind", "retriable"),
    [
        (pb.BAD_REQUEST, BadRequest, False),
        (pb.ILLEGAL_MESSAGE_TAG, BadRequest, False),
        (pb.TOPIC_NOT_FOUND, TopicNotFound, False),
        (pb.INVALID_TRANSACTION_ID, TransactionNotFound, False),
        (pb.INVALID_RECEIPT_HANDLE, InvalidReceiptHandle, False),
        (pb.TOO_MANY_REQUESTS, BrokerBusy, True),
        (pb.NOT_IMPLEMENTED, UnsupportedRequest, False),
        (pb.INTERNAL_SERVER_ERROR, ServerError, True),
    ],
)
def test_status_codes_are_txmq_errors(code: int, kind: type, retriable: bool) -> None:
    exc = error_of(pb.Status(code=code, message="why"), "send")
    assert type(exc) is kind and exc.retriable is retriable
    assert "send: why" in str(exc) and pb.Code.Name(code) in str(exc)
    check_error(pb.Status(code=pb.OK))
    with pytest.raises(kind):
        check_error(pb.Status(code=code))


def test_retry_backoff_follows_the_endpoint_policy() -> None:
    custom = pb.Settings(
        backoff_policy=pb.RetryPolicy(
            max_attempts=4,
            customized_backoff=pb.CustomizedBackoff(next=[duration(300), duration(2000)]),
        )
    )
    assert [backoff_s(custom, a) for a in (1, 2, 3)] == [0.3, 2.0, 2.0]
    exp = pb.Settings(
        backoff_policy=pb.RetryPolicy(
            exponential_backoff=pb.ExponentialBackoff(
                initial=duration(100), max=duration(1000), multiplier=2
            )
        )
    )
    assert [backoff_s(exp, a) for a in (1, 2, 5)] == [0.1, 0.2, 1.0]
    assert backoff_s(None, 1) == 10.0 and backoff_s(None, 2) == 30.0  # levels 3, 4


def test_transport_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TXMQ_NAMESRV_ADDR", raising=False)
    monkeypatch.setenv("TXMQ_TRANSPORT", "grpc")
    assert Producer("127.0.0.1:8081").transport == "grpc"
    assert PushConsumer("127.0.0.1:8081").transport == "grpc"
    assert AdminClient("127.0.0.1:10911").transport == "txmq"  # txmq's protocol only
    assert Producer("127.0.0.1:1", transport="txmq").transport == "txmq"
    with pytest.raises(ValueError, match="txmq's own protocol only"):
        PullConsumer("127.0.0.1:8081", transport="grpc")
    with pytest.raises(ValueError, match="not name servers"):
        Producer(namesrv="127.0.0.1:9876")
    with pytest.raises(UnsupportedRequest, match="BROADCASTING"):
        PushConsumer("127.0.0.1:8081", message_model="BROADCASTING")
    with pytest.raises(UnsupportedRequest, match="orderly"):
        PushConsumer("127.0.0.1:8081", orderly=True)
    monkeypatch.setenv("TXMQ_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="TXMQ_TRANSPORT"):
        Producer("127.0.0.1:8081")
    with pytest.raises(ValueError, match="no transport is called 'pigeon': the transports are"):
        Producer("127.0.0.1:8081", transport="pigeon")
    with pytest.raises(ValueError, match="a name or a transport, not 42"):
        Producer("127.0.0.1:8081", transport=42)  # type: ignore[arg-type]
    monkeypatch.setenv("TXMQ_TRANSPORT", "loopback")  # every client may use it
    assert AdminClient("127.0.0.1:10911").transport == "loopback"
    monkeypatch.delenv("TXMQ_TRANSPORT")
    assert Producer("127.0.0.1:10911").transport == "txmq"
