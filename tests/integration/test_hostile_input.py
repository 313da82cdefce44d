"""Requests no real client sends, against a broker process: each gets a clear error code,
the broker logs little of it, and it keeps serving everyone else."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from tests.conftest import BrokerProcess
from tests.raw_client import RawClient, still_serving
from txmq.protocol.connection import error_message
from txmq.protocol.wire import PREFIX, FrameDecoder, FrameKind, RequestCode, encode_frame
from txmq.protocol.wire.errors import MalformedFrame, ResponseCode

Code = RequestCode


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("hostile")
    bp = BrokerProcess(tmp / "store", [], tmp / "broker.log").start()
    yield bp
    assert bp.terminate() == 0, bp.output()[-2000:]


@pytest.fixture
def raw(broker: BrokerProcess) -> Iterator[RawClient]:
    client = RawClient(broker.address)
    yield client
    client.sock.close()


GARBAGE: list[tuple[int, dict[str, Any], str]] = [
    (
        Code.PULL_MESSAGE,
        {"topic": "t", "queue_id": 0, "offset": 0, "suspend_ms": None},
        "suspend_ms",
    ),
    (Code.PULL_MESSAGE, {"topic": "t", "queue_id": 0, "offset": [0]}, "offset"),
    (Code.QUERY_MESSAGE_BY_KEY, {"key": "k", "max_num": None}, "max_num"),
    (Code.END_TRANSACTION, {"group": "g", "transaction_offset": 0, "state": [1]}, "state"),
    (Code.END_TRANSACTION, {"group": "g", "transaction_offset": 0, "state": {"a": 1}}, "state"),
    (Code.END_TRANSACTION, {"group": "g", "transaction_offset": 0, "state": "MAYBE"}, "state"),
    (Code.VIEW_MESSAGE_BY_ID, {"msg_id": None}, "msg_id"),
    (Code.SEND_MESSAGE, {"topic": "t", "queue_id": 0, "properties": [["a", "b"]]}, "properties"),
    (Code.HEARTBEAT, {"client_id": None}, "client_id"),
    (Code.LOCK_BATCH_MQ, {"group": "g", "client_id": "c", "queues": "all"}, "queues"),
    (Code.CONSUMER_SEND_MSG_BACK, {"group": "g", "commit_log_offset": "x"}, "commit_log_offset"),
    (Code.SEND_MESSAGE, {"topic": "t", "queue_id": 0, "flag": 2**64 - 1}, "flag"),
    (Code.SEND_MESSAGE, {"topic": "t", "queue_id": 0, "born_timestamp": -1}, "born_timestamp"),
]


@pytest.mark.parametrize(("code", "header", "field"), GARBAGE, ids=lambda v: str(v)[:30])
def test_a_mistyped_field_is_a_bad_request_naming_it(
    raw: RawClient, broker: BrokerProcess, code: int, header: dict[str, Any], field: str
) -> None:
    frame = raw.request(code, header)
    assert frame.code == ResponseCode.BAD_REQUEST, error_message(frame)
    assert f"'{field}'" in error_message(frame)
    assert raw.request(Code.GET_ALL_TOPIC_CONFIG, {}, rid=2).code == ResponseCode.SUCCESS


def test_a_huge_bad_header_is_answered_and_logged_in_a_few_hundred_bytes(
    raw: RawClient, broker: BrokerProcess
) -> None:
    before = len(broker.output())
    huge = "A" * (2 * 1024 * 1024)
    end = Code.END_TRANSACTION
    for code, header in (
        (end, {"group": "g", "transaction_offset": 0, "state": huge}),  # quoted by the decoder
        (end, {"group": huge, "transaction_offset": 0, "state": "COMMIT"}),  # by the service
        # a client's and a group's name were logged as it joined (found by the fuzz test)
        (Code.HEARTBEAT, {"client_id": huge, "consumers": [{"group": "g"}]}),
        (Code.HEARTBEAT, {"client_id": "c", "consumers": [{"group": huge}]}),
    ):
        frame = raw.request(code, header)
        assert frame.code != ResponseCode.SUCCESS
        assert len(error_message(frame)) < 1024
    still_serving(broker.address)
    assert len(broker.output()) - before < 4096


def _frame(header_len: int, length: int, rid: int) -> bytes:
    """A frame whose prefix says ``length`` and ``header_len``, filled with zeros."""
    return PREFIX.pack(length, 1, FrameKind.REQUEST, Code.GET_ALL_TOPIC_CONFIG, rid, header_len) + (
        b"\x80" + bytes(length - 13) if length > 12 else b""
    )


@pytest.mark.parametrize("followed", [False, True], ids=["alone", "followed"])
def test_the_header_length_rule_is_the_same_alone_and_followed(followed: bool) -> None:
    body = 8
    ok = _frame(1, 12 + 1 + body, 1)  # header of 1 byte, body of 8: fits
    fits = ok + (ok if followed else b"")
    assert len(FrameDecoder().feed(fits)) == (2 if followed else 1)
    over = _frame(12 + 1 + body, 12 + 1 + body, 3)  # header length = the frame's length
    data = over + (ok if followed else b"")
    with pytest.raises(MalformedFrame, match="header length"):
        FrameDecoder().feed(data)
    decoder = FrameDecoder()
    with pytest.raises(MalformedFrame, match="header length"):
        for i in range(len(data)):  # byte by byte: one rule, whatever arrives when
            decoder.feed(data[i : i + 1])


def test_a_frame_whose_header_overruns_it_is_refused_by_the_broker(
    raw: RawClient, broker: BrokerProcess
) -> None:
    length = 12 + 16
    raw.send(PREFIX.pack(length, 1, FrameKind.REQUEST, Code.GET_ALL_TOPIC_CONFIG, 9, length))
    raw.send(bytes(16) + encode_frame(FrameKind.REQUEST, Code.GET_ALL_TOPIC_CONFIG, 10, b""))
    frame = raw.read_frame()
    assert frame is not None and frame.request_id == 9
    assert frame.code == ResponseCode.MALFORMED_FRAME
    assert raw.closed_by_peer()
    still_serving(broker.address)


def test_the_header_is_msgpack_of_a_map(raw: RawClient) -> None:
    for header in (msgpack.packb([1, 2]), msgpack.packb("x"), b"\xc1"):
        raw.send(encode_frame(FrameKind.REQUEST, Code.GET_MAX_OFFSET, 4, header))
        frame = raw.read_frame()
        assert frame is not None and frame.code == ResponseCode.BAD_REQUEST
