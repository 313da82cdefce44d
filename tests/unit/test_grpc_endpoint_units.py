"""The gRPC endpoint's pieces without a server: a Telemetry session's command queue and the
check-back it writes, statuses for txmq's errors, delivered messages."""

from __future__ import annotations

import zlib

from rocketmq.grpc_protocol import definition_pb2 as pb

from txmq.protocol.codec import decode_record, encode_record
from txmq.protocol.message import Prop
from txmq.protocol.wire import CheckTransactionState
from txmq.protocol.wire.errors import DiskFull, InvalidReceiptHandle, MessageTooLarge
from txmq.server.grpc.convert import message_of, status_of
from txmq.server.grpc.telemetry import MAX_PENDING_COMMANDS, Session


def half_record() -> bytes:
    return encode_record(
        topic="RMQ_SYS_TRANS_HALF_TOPIC",
        queue_id=0,
        body=b"pay 7",
        properties={
            Prop.UNIQ_KEY: "M7",
            Prop.REAL_TOPIC: "payments",
            Prop.REAL_QID: "2",
            Prop.TRAN_MSG: "true",
            Prop.TAGS: "t",
            "region": "eu",
        },
        queue_offset=5,
        commit_log_offset=4096,
        born_timestamp=1_700_000_000_000,
        store_timestamp=1_700_000_000_123,
    )


def test_a_check_back_is_a_recover_orphaned_transaction_command() -> None:
    s = Session("c1", "ipv4:127.0.0.1:5000")
    check = CheckTransactionState(transaction_offset=4096, msg_id="M7", topic="payments",
                                  queue_id=2, check_times=1)  # fmt: skip
    s.send_oneway(check, half_record())
    cmd = s.queue.get_nowait().recover_orphaned_transaction_command
    assert cmd.transaction_id == "0000000000001000"  # what EndTransaction gives back
    m = cmd.message
    assert m.topic.name == "payments" and m.body == b"pay 7"
    assert m.system_properties.message_id == "M7" and m.system_properties.tag == "t"
    assert m.system_properties.message_type == pb.TRANSACTION
    assert dict(m.user_properties) == {"region": "eu"}
    s.send_oneway(object())  # not a check: nothing to write
    assert s.queue.empty()


def test_a_client_that_never_reads_is_closed_and_its_writer_still_ends() -> None:
    s = Session("slow", "peer")
    for _ in range(MAX_PENDING_COMMANDS):
        assert s.push("cmd")
    assert not s.push("one too many")  # the queue is full: the session is closed
    assert s.closed
    drained = [s.queue.get_nowait() for _ in range(s.queue.qsize())]
    assert drained[-1] is None  # the end marker made room for itself
    assert not s.push("after close")
    s.close()  # closing twice is harmless
    assert s.queue.empty()


def test_statuses_of_txmq_errors() -> None:
    assert status_of(MessageTooLarge("big")).code == pb.MESSAGE_BODY_TOO_LARGE
    assert status_of(InvalidReceiptHandle("old")).code == pb.INVALID_RECEIPT_HANDLE
    assert status_of(DiskFull("full")).code == pb.INTERNAL_SERVER_ERROR  # retried elsewhere
    st = status_of(RuntimeError("boom"))
    assert st.code == pb.INTERNAL_SERVER_ERROR and "RuntimeError: boom" in st.message


def test_a_delivered_message_carries_its_digest_and_times() -> None:
    msg = decode_record(half_record())
    m = message_of(msg, topic=pb.Resource(name="payments"), handle="h", attempt=3,
                   invisible_ms=1500)  # fmt: skip
    sp = m.system_properties
    assert sp.body_digest.type == pb.CRC32
    assert sp.body_digest.checksum == f"{zlib.crc32(b'pay 7'):08X}"
    assert sp.receipt_handle == "h" and sp.delivery_attempt == 3
    assert (sp.invisible_duration.seconds, sp.invisible_duration.nanos) == (1, 500_000_000)
    assert sp.born_timestamp.seconds == 1_700_000_000 and sp.delivery_timestamp.seconds > 0
