from __future__ import annotations

import os
import subprocess
import sys

import pytest

from txmq.protocol.codec import (
    CorruptRecord,
    check_record,
    decode_record,
    decode_records,
    encode_record,
)
from txmq.protocol.message import Message, Prop, new_message_id, stable_hash, validate_topic_name


def _record(body: bytes = b"hello", offset: int = 0) -> bytes:
    return encode_record(
        topic="orders",
        queue_id=2,
        body=body,
        properties={Prop.TAGS: "created", Prop.KEYS: "k1 k2", "user": "v"},
        queue_offset=5,
        commit_log_offset=offset,
        born_timestamp=1,
        store_timestamp=2,
    )


def test_record_roundtrip() -> None:
    rec = _record()
    assert check_record(rec) == len(rec)
    m = decode_record(rec, verify=True)
    assert (m.topic, m.queue_id, m.queue_offset, m.body) == ("orders", 2, 5, b"hello")
    assert m.tags == "created" and m.keys == ["k1", "k2"] and m.properties == {"user": "v"}
    two = decode_records(_record(b"a") + _record(b"b", 100))
    assert [x.body for x in two] == [b"a", b"b"]


def test_corruption_is_detected() -> None:
    rec = bytearray(_record())
    rec[80] ^= 0xFF
    with pytest.raises(CorruptRecord, match="CRC"):
        check_record(bytes(rec))
    with pytest.raises(CorruptRecord):
        check_record(_record()[:-3])
    with pytest.raises(CorruptRecord, match="magic"):
        check_record(b"\x40\x00\x00\x00garbagegarbage" + b"\0" * 60)


def test_a_damaged_record_in_a_batch_is_skipped_when_asked() -> None:
    bad = bytearray(_record(b"b", 100))
    bad[60] ^= 0x01
    batch = _record(b"a") + bytes(bad) + _record(b"c", 200)
    with pytest.raises(CorruptRecord, match="CRC"):
        decode_records(batch)
    seen: list[tuple[int, str]] = []
    got = decode_records(batch, on_corrupt=lambda pos, exc: seen.append((pos, str(exc))))
    assert [m.body for m in got] == [b"a", b"c"]
    assert seen == [(len(_record(b"a")), "CRC mismatch")]
    # a size that cannot be trusted: what follows cannot be found, and is left
    torn = _record(b"a") + b"\xff\xff\xff\x7f" + bytes(bad)[4:]
    assert [m.body for m in decode_records(torn, on_corrupt=lambda *_: None)] == [b"a"]


def test_stable_hash_is_the_same_in_every_process() -> None:
    code = "from txmq.protocol.message import stable_hash; print(stable_hash('order-42'))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }
    assert outs == {str(stable_hash("order-42"))}


def test_message_ids_are_unique_and_topic_names_checked() -> None:
    ids = {new_message_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    assert validate_topic_name("") == "topic name is empty"
    assert "characters" in (validate_topic_name("a b") or "")
    assert validate_topic_name("orders.v1") is None
    assert "not allowed" in (validate_topic_name("..") or "")
    assert "not allowed" in (validate_topic_name(".") or "")
    assert validate_topic_name("...") is None
    with pytest.raises(ValueError, match="reserved"):
        Message("t", b"", properties={Prop.KEYS: "x"}).wire_properties("id")
