"""Bad input gets a clear error and the broker keeps serving everyone else."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgpack
import pytest

from tests.raw_client import RawClient, still_serving
from txmq import InvalidTopic, Message, MessageTooLarge, NoPermission
from txmq.broker.server import EmbeddedBroker
from txmq.protocol.connection import error_message
from txmq.protocol.wire import PREFIX, FrameKind, RequestCode, encode_frame
from txmq.protocol.wire.errors import BadRequest, ResponseCode, TopicNotFound
from txmq.sync import Producer, PullConsumer


@pytest.fixture
def address(embedded_broker: Callable[..., EmbeddedBroker]) -> str:
    return embedded_broker(max_message_size=64 * 1024, max_frame_size=1024 * 1024).address


@pytest.fixture(autouse=True)
def _close_raw_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    opened: list[RawClient] = []
    real_init = RawClient.__init__

    def tracking_init(self: RawClient, address: str) -> None:
        real_init(self, address)
        opened.append(self)

    monkeypatch.setattr(RawClient, "__init__", tracking_init)
    yield
    for raw in opened:
        raw.sock.close()


def test_oversized_message_client_and_broker_side(address: str) -> None:
    with Producer(address, max_message_size=10**7) as p:
        with pytest.raises(MessageTooLarge, match="over the limit of 65536 bytes"):
            p.send(Message("big", b"x" * 100_000))
    with Producer(address) as p, pytest.raises(MessageTooLarge, match="over the limit"):
        p.send(Message("big", b"x" * (5 * 1024 * 1024)))
    still_serving(address)


def test_topic_names(address: str) -> None:
    raw = RawClient(address)
    for topic, code, text in [
        ("", ResponseCode.INVALID_TOPIC, "topic name is empty"),
        ("bad topic", ResponseCode.INVALID_TOPIC, "characters"),
        # auto-created but refused by the store: it stayed in topics.json (fuzz test)
        ("..", ResponseCode.INVALID_TOPIC, "not allowed"),
        (".", ResponseCode.INVALID_TOPIC, "not allowed"),
        ("RMQ_SYS_TRANS_HALF_TOPIC", ResponseCode.NO_PERMISSION, "reserved system topic"),
        ("%DLQ%group", ResponseCode.NO_PERMISSION, "reserved system topic"),
    ]:
        frame = raw.request(RequestCode.SEND_MESSAGE, {"topic": topic, "queue_id": 0}, b"x")
        assert frame.code == code and text in error_message(frame)
    frame = raw.request(RequestCode.GET_ALL_TOPIC_CONFIG, {})
    assert b".." not in frame.header and b"\xa1." not in frame.header
    frame = raw.request(RequestCode.SEND_MESSAGE, {"queue_id": 0}, b"x")
    assert frame.code == ResponseCode.BAD_REQUEST and "'topic'" in error_message(frame)
    frame = raw.request(RequestCode.SEND_MESSAGE, {"topic": "t1", "queue_id": 99}, b"x")
    assert frame.code == ResponseCode.BAD_REQUEST and "out of range" in error_message(frame)
    with Producer(address) as p:
        with pytest.raises(InvalidTopic, match="empty"):
            p.send(Message("", b"x"))
        with pytest.raises(InvalidTopic, match="reserved"):
            p.send(Message("RMQ_SYS_TRANS_HALF_TOPIC", b"x"))
    with PullConsumer(address) as c, pytest.raises(TopicNotFound):
        c.pull("never-created", 0, 0, long_poll=0)
    still_serving(address)


def test_no_permission_and_bad_header_types(address: str) -> None:
    raw = RawClient(address)
    frame = raw.request(RequestCode.UPDATE_AND_CREATE_TOPIC, {"topic": "%RETRY%g", "queue_nums": 1})
    assert frame.code == ResponseCode.NO_PERMISSION
    frame = raw.request(RequestCode.PULL_MESSAGE, {"topic": "t", "queue_id": "zero", "offset": 0})
    assert frame.code == ResponseCode.BAD_REQUEST and "queue_id" in error_message(frame)
    frame = raw.request(
        RequestCode.SEND_MESSAGE, {"topic": "t", "queue_id": 0, "properties": {"a": 1}}, b"x"
    )
    assert frame.code == ResponseCode.BAD_REQUEST and "properties" in error_message(frame)
    assert NoPermission.code == ResponseCode.NO_PERMISSION and BadRequest.code == 7


def test_unknown_request_code_keeps_the_connection(address: str) -> None:
    raw = RawClient(address)
    frame = raw.request(9999, {}, rid=5)
    assert frame.request_id == 5 and frame.code == ResponseCode.REQUEST_CODE_NOT_SUPPORTED
    assert "9999" in error_message(frame)
    frame = raw.request(RequestCode.GET_ALL_TOPIC_CONFIG, {}, rid=6)
    assert frame.code == ResponseCode.SUCCESS


def test_a_header_that_is_not_msgpack_is_a_bad_request_and_keeps_the_connection(
    address: str,
) -> None:
    raw = RawClient(address)
    junk = b"\xc1\xc1\xc1"
    raw.send(PREFIX.pack(12 + len(junk), 1, 0, RequestCode.SEND_MESSAGE, 77, len(junk)) + junk)
    frame = raw.read_frame()
    assert frame is not None
    assert frame.code == ResponseCode.BAD_REQUEST and frame.request_id == 77
    assert "msgpack" in error_message(frame)
    frame = raw.request(RequestCode.GET_ALL_TOPIC_CONFIG, {}, rid=78)
    assert frame.code == ResponseCode.SUCCESS and frame.request_id == 78
    still_serving(address)


def test_malformed_frame_gets_an_error_then_close(address: str) -> None:
    raw = RawClient(address)
    raw.send(PREFIX.pack(12, 1, 9, RequestCode.SEND_MESSAGE, 77, 0))  # no such frame kind
    frame = raw.read_frame()
    assert frame is not None
    assert frame.code == ResponseCode.MALFORMED_FRAME and frame.request_id == 77
    assert "malformed frame" in error_message(frame)
    assert raw.closed_by_peer()
    still_serving(address)


def test_an_unknown_request_version_is_refused_and_keeps_the_connection(address: str) -> None:
    raw = RawClient(address)
    header = msgpack.packb({"topic": "v", "queue_id": 0})
    raw.send(encode_frame(FrameKind.REQUEST, RequestCode.SEND_MESSAGE, 5, header, b"x", 9))
    frame = raw.read_frame()
    assert frame is not None and frame.version == 9
    assert frame.code == ResponseCode.VERSION_NOT_SUPPORTED and "version 9" in error_message(frame)
    still_serving(address)


def test_frame_over_the_limit(address: str) -> None:
    raw = RawClient(address)
    raw.send(PREFIX.pack(50 * 1024 * 1024, 1, 0, RequestCode.SEND_MESSAGE, 3, 0))
    frame = raw.read_frame()
    assert frame.code == ResponseCode.FRAME_TOO_LARGE and "over the limit" in error_message(frame)
    assert raw.closed_by_peer()
    still_serving(address)


def test_garbage_bytes_on_the_socket(address: str) -> None:
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 4, b"\x00" * 64):
        raw = RawClient(address)
        raw.send(junk)
        frame = raw.read_frame()
        assert frame is None or frame.code != ResponseCode.SUCCESS
        assert raw.closed_by_peer()
    still_serving(address)


def test_bad_batch_sizes(address: str) -> None:
    raw = RawClient(address)
    header = {"topic": "b", "queue_id": 0, "messages": [{"size": 10}, {"size": 10}]}
    frame = raw.request(RequestCode.SEND_BATCH_MESSAGE, header, b"x" * 15)
    assert frame.code == ResponseCode.BAD_REQUEST and "sizes" in error_message(frame)
    raw.send(PREFIX.pack(0, 1, 0, RequestCode.SEND_MESSAGE, 9, 0))  # shorter than its prefix
    frame = raw.read_frame()
    assert frame.code == ResponseCode.MALFORMED_FRAME and frame.request_id == 9
    still_serving(address)


def test_oversized_properties(address: str) -> None:
    with Producer(address) as p, pytest.raises(BadRequest, match="properties are over 32767"):
        p.send(Message("props", b"x", properties={"big": "v" * 40_000}))
    still_serving(address)
