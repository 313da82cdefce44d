from __future__ import annotations

from typing import Any

import msgpack
import pytest

from txmq.protocol.wire import (
    PREFIX,
    EndTransaction,
    FrameDecoder,
    FrameKind,
    Heartbeat,
    LockBatchMq,
    PullMessage,
    QueryConsumerOffset,
    QueryMessageByKey,
    Request,
    RequestCode,
    SendBatchMessage,
    SendMessage,
    Sent,
    ViewMessageById,
    decode,
    encode,
    encode_frame,
    request_class,
    requests,
)
from txmq.protocol.wire.errors import (
    BadRequest,
    BrokerBusy,
    FrameTooLarge,
    MalformedFrame,
    MessageTooLarge,
    ResponseCode,
    ServerError,
    UnsupportedRequest,
    UnsupportedVersion,
    error_for_code,
)


def test_frames_roundtrip_when_fed_byte_by_byte() -> None:
    header = encode(SendMessage(topic="t", queue_id=1))
    data = encode_frame(FrameKind.REQUEST, RequestCode.SEND_MESSAGE, 7, header, b"body")
    data += encode_frame(FrameKind.RESPONSE, 0, 7)
    dec = FrameDecoder()
    frames = []
    for i in range(len(data)):
        frames += dec.feed(data[i : i + 1])
    assert [(f.kind, f.code, f.request_id, f.header, f.body) for f in frames] == [
        (FrameKind.REQUEST, RequestCode.SEND_MESSAGE, 7, header, b"body"),
        (FrameKind.RESPONSE, 0, 7, b"", b""),
    ]
    assert decode(SendMessage, frames[0].header) == SendMessage(topic="t", queue_id=1)


def test_oversized_frame_is_refused_before_reading_it() -> None:
    dec = FrameDecoder(max_frame_size=1024)
    prefix = PREFIX.pack(10_000_000, 1, 0, 10, 42, 0)
    with pytest.raises(FrameTooLarge) as exc:
        dec.feed(prefix)
    assert exc.value.request_id == 42
    assert "over the limit of 1024 bytes" in str(exc.value)


def test_bad_kind_and_header_length_are_stream_errors() -> None:
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(PREFIX.pack(12, 1, 7, 10, 1, 0))


@pytest.mark.parametrize("followed", [False, True])
def test_a_header_longer_than_the_frame_is_refused_alone_or_followed(followed: bool) -> None:
    """One rule: the header must fit in the frame after its 12 bytes of fixed fields."""
    header = b"\x80" * 12
    frame = PREFIX.pack(12 + 12, 1, 0, 10, 1, 24) + header
    if followed:
        frame += encode_frame(FrameKind.REQUEST, 10, 2)
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(frame)
    fits = PREFIX.pack(12 + 12, 1, 0, 10, 1, 12) + header
    assert len(FrameDecoder().feed(fits)) == 1


def test_every_request_class_is_registered_once_with_its_response() -> None:
    table = requests()
    assert len(table) == len(RequestCode)
    assert {code for code, _ in table} == {int(c) for c in RequestCode}
    for (code, version), cls in table.items():
        assert cls.CODE == code and cls.VERSION == version
        assert issubclass(cls, Request) and cls.RESPONSE is not None
    assert SendMessage.RESPONSE is Sent
    assert request_class(RequestCode.PULL_MESSAGE, 1) is PullMessage
    with pytest.raises(UnsupportedRequest, match="9999"):
        request_class(9999, 1)
    with pytest.raises(UnsupportedVersion, match=r"PullMessage.*version 7"):
        request_class(RequestCode.PULL_MESSAGE, 7)


@pytest.mark.parametrize(
    ("cls", "header", "expected"),
    [
        (SendMessage, {"queue_id": 1}, "misses field 'topic'"),
        (SendMessage, {"topic": "t", "queue_id": None}, "'queue_id': Expected `int`, got `None`"),
        (SendMessage, {"topic": "t", "queue_id": True}, "'queue_id': Expected `int`, got `bool`"),
        (
            QueryConsumerOffset,
            {"group": "", "topic": "t", "queue_id": 1},
            "'group': Expected `str` of length >= 1",
        ),
        (SendMessage, {"topic": "t", "queue_id": 1, "properties": {"a": 1}}, "'properties"),
        (PullMessage, {"topic": "t", "queue_id": 0, "offset": 0, "suspend_ms": None}, "suspend_ms"),
        (EndTransaction, {"group": "g", "transaction_offset": 1, "state": ["x"]}, "'state'"),
        (EndTransaction, {"group": "g", "transaction_offset": 1, "state": "MAYBE"}, "'state'"),
        (LockBatchMq, {"group": "g", "client_id": "c", "queues": [["t"]]}, "'queues[0]'"),
        (Heartbeat, {"consumers": [{"group": "g", "message_model": "X"}]}, "message_model"),
        (SendMessage, [1, 2], "not a map"),
        # the stored record's flag is 32 bits unsigned, its born time unsigned (fuzz test)
        (SendMessage, {"topic": "t", "queue_id": 0, "flag": 2**32}, "'flag': Expected `int` <="),
        (SendMessage, {"topic": "t", "queue_id": 0, "flag": -1}, "'flag': Expected `int` >="),
        (SendMessage, {"topic": "t", "queue_id": 0, "born_timestamp": -1}, "'born_timestamp'"),
        # group and client names: at most 255 characters (the broker logs and keeps them)
        (Heartbeat, {"client_id": "c" * 256}, "'client_id': Expected `str` of length <= 255"),
        (Heartbeat, {"consumers": [{"group": "g" * 256}]}, "'consumers[0].group'"),
        (
            QueryConsumerOffset,
            {"group": "g" * 256, "topic": "t", "queue_id": 0},
            "'group': Expected `str` of length <= 255",
        ),
        (SendMessage, {"topic": "t", "queue_id": 0, "group": "g" * 256}, "'group'"),
        (
            SendBatchMessage,
            {"topic": "t", "queue_id": 0, "messages": [{"size": 1, "born_timestamp": -1}]},
            "'messages[0].born_timestamp'",
        ),
    ],
)
def test_a_header_that_does_not_fit_is_a_bad_request_naming_the_field(
    cls: type[Request[Any]], header: object, expected: str
) -> None:
    with pytest.raises(BadRequest) as exc:
        decode(cls, msgpack.packb(header))
    assert expected in str(exc.value)
    assert str(exc.value).startswith(cls.__name__)


def test_a_header_that_is_not_msgpack_is_a_bad_request() -> None:
    with pytest.raises(BadRequest, match="not valid msgpack"):
        decode(SendMessage, b"\xc1\xc1")


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        # an unknown field is skipped, but skipping a deep value still recurses
        (b"\x83\xa5topic\xa1t\xa8queue_id\x00\xa1z" + b"\x91" * 100_000 + b"\x00", "nested"),
        (b"\x82\xa5topic\xa2\xed\xa0\xa8queue_id\x00", "not UTF-8"),
        (b"\x83\xa5topic\xa1t\xa8queue_id\x00\xaaproperties\x81\xa1\xff\xa0", "not UTF-8"),
    ],
    ids=["deep unknown field", "bad UTF-8 value", "bad UTF-8 map key"],
)
def test_a_deep_or_non_utf8_header_is_a_bad_request(header: bytes, expected: str) -> None:
    """(found by tests/integration/test_fuzz.py: the broker answered SYSTEM_ERROR)"""
    with pytest.raises(BadRequest, match=expected):
        decode(SendMessage, header)


def test_message_keys_and_ids_may_be_long() -> None:
    key = "k" * 1000
    assert decode(QueryMessageByKey, msgpack.packb({"key": key})).key == key
    assert decode(ViewMessageById, msgpack.packb({"msg_id": key})).msg_id == key


def test_unknown_fields_are_ignored_and_defaults_are_not_sent() -> None:
    header = msgpack.packb({"topic": "t", "queue_id": 2, "from_the_future": [1]})
    assert decode(SendMessage, header) == SendMessage(topic="t", queue_id=2)
    assert msgpack.unpackb(encode(SendMessage(topic="t", queue_id=2))) == {
        "topic": "t",
        "queue_id": 2,
    }


def test_error_codes_map_to_classes_with_retriable_flag() -> None:
    err = error_for_code(ResponseCode.MESSAGE_TOO_LARGE, "too big")
    assert isinstance(err, MessageTooLarge) and not err.retriable and str(err) == "too big"
    assert error_for_code(ResponseCode.SYSTEM_BUSY, "").retriable
    assert isinstance(error_for_code(ResponseCode.SYSTEM_BUSY, "x"), BrokerBusy)
    unknown = error_for_code(999, "strange")
    assert isinstance(unknown, ServerError) and unknown.retriable
