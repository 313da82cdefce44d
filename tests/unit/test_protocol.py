from __future__ import annotations

import msgpack
import pytest

from txmq.errors import (
    BrokerBusy,
    FrameTooLarge,
    MalformedFrame,
    MessageTooLarge,
    ResponseCode,
    ServerError,
    UnsupportedVersion,
    error_for_code,
)
from txmq.protocol import PREFIX, FrameDecoder, FrameKind, RequestCode, encode_frame


def test_frames_roundtrip_when_fed_byte_by_byte() -> None:
    data = encode_frame(FrameKind.REQUEST, RequestCode.SEND_MESSAGE, 7, {"topic": "t"}, b"body")
    data += encode_frame(FrameKind.RESPONSE, 0, 7)
    dec = FrameDecoder()
    frames = []
    for i in range(len(data)):
        frames += dec.feed(data[i : i + 1])
    assert [(f.kind, f.code, f.request_id, f.header, f.body) for f in frames] == [
        (FrameKind.REQUEST, RequestCode.SEND_MESSAGE, 7, {"topic": "t"}, b"body"),
        (FrameKind.RESPONSE, 0, 7, {}, b""),
    ]


def test_oversized_frame_is_refused_before_reading_it() -> None:
    dec = FrameDecoder(max_frame_size=1024)
    prefix = PREFIX.pack(10_000_000, 1, 0, 10, 42, 0)
    with pytest.raises(FrameTooLarge) as exc:
        dec.feed(prefix)
    assert exc.value.request_id == 42
    assert "over the limit of 1024 bytes" in str(exc.value)


def test_bad_version_kind_and_header_are_errors() -> None:
    with pytest.raises(UnsupportedVersion):
        FrameDecoder().feed(PREFIX.pack(12, 9, 0, 10, 1, 0))
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(PREFIX.pack(12, 1, 7, 10, 1, 0))
    bad_header = b"\xc1\xc1"  # never-used msgpack byte
    frame = PREFIX.pack(12 + len(bad_header), 1, 0, 10, 1, len(bad_header)) + bad_header
    with pytest.raises(MalformedFrame, match="not valid msgpack"):
        FrameDecoder().feed(frame)
    not_a_map = msgpack.packb([1, 2])
    frame = PREFIX.pack(12 + len(not_a_map), 1, 0, 10, 1, len(not_a_map)) + not_a_map
    with pytest.raises(MalformedFrame, match="not a map"):
        FrameDecoder().feed(frame)


def test_error_codes_map_to_classes_with_retriable_flag() -> None:
    err = error_for_code(ResponseCode.MESSAGE_TOO_LARGE, "too big")
    assert isinstance(err, MessageTooLarge) and not err.retriable and str(err) == "too big"
    assert error_for_code(ResponseCode.SYSTEM_BUSY, "").retriable
    assert isinstance(error_for_code(ResponseCode.SYSTEM_BUSY, "x"), BrokerBusy)
    unknown = error_for_code(999, "strange")
    assert isinstance(unknown, ServerError) and unknown.retriable
