"""Damage in the middle of the commit log (issue 16, items 7 and 8): a record whose bytes
changed is skipped when read and reported; recovery steps over damage to the sound records
after it instead of cutting them; missing or shortened segments are loud."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.unit.test_store_recovery import LOGGER, NO_CHECKPOINTS, _segment_of
from txmq.broker.store import GetStatus

SEG = 64 * 1024


def _flip(root: Path, offset: int, at: int, *, junk: bytes | None = None) -> None:
    seg, pos = _segment_of(root, offset)
    with seg.open("r+b") as f:
        f.seek(pos + at)
        byte = f.read(1)
        f.seek(pos + at)
        f.write(junk if junk is not None else bytes([byte[0] ^ 0x20]))


def _fill(store, put_msg, n: int):
    return [put_msg(store, "T", i % 2, b"%05d" % i * 60, keys=[f"k{i}"]) for i in range(n)]


def test_a_damaged_old_record_is_skipped_when_read_and_reported(
    make_store, put_msg, read_queue, tmp_path, caplog
) -> None:
    store = make_store()
    results = _fill(store, put_msg, 400)
    victim = results[101]  # queue 1, well below the checkpoint: recovery never looks at it
    caplog.set_level(logging.WARNING, logger=LOGGER)
    _flip(tmp_path / "store", victim.commit_log_offset, 90)  # in its body: CRC mismatch

    # one message at a time, from just before it: the consumer moves past it
    got = store.get_messages("T", 1, victim.queue_offset, max_count=1)
    assert got.status is GetStatus.OFFSET_FOUND_NULL and not got.records
    assert got.next_begin_offset == victim.queue_offset + 1
    msgs = read_queue(store, "T", 1)
    assert [m.queue_offset for m in msgs] == [
        r.queue_offset for r in results[1::2] if r is not victim
    ]
    assert len(read_queue(store, "T", 0)) == 200
    # reported once, however often it is read
    [damage] = store.damage.entries()
    assert damage.kind == "corrupt record" and damage.offset == victim.commit_log_offset
    assert f"T/1 queue offset {victim.queue_offset}: CRC mismatch" in damage.detail
    assert store.damage.count == 1
    assert caplog.text.count("store damage: corrupt record") == 1


@pytest.mark.parametrize("damage", ["crc", "magic"])
def test_recovery_keeps_the_sound_records_after_a_damaged_one(
    make_store, put_msg, read_queue, tmp_path, caplog, crash_store, damage: str
) -> None:
    store = make_store(**NO_CHECKPOINTS)
    results = _fill(store, put_msg, 600)
    crash_store(store)
    victim = next(r for r in results if r.commit_log_offset > 100_000)
    if damage == "crc":
        _flip(tmp_path / "store", victim.commit_log_offset, 90)
    else:
        _flip(tmp_path / "store", victim.commit_log_offset, 4, junk=b"JUNK")
    caplog.set_level(logging.WARNING, logger=LOGGER)

    store = make_store()
    assert store.last_recovery.truncated_bytes == 0
    kept = [r for r in results if r is not victim]
    got = read_queue(store, "T", 0) + read_queue(store, "T", 1)
    assert sorted(m.commit_log_offset for m in got) == [r.commit_log_offset for r in kept]
    [found] = store.damage.entries()
    assert found.kind == "skipped at recovery"
    assert found.offset == victim.commit_log_offset and found.size == victim.size
    assert "the sound records after it are kept" in caplog.text
    # the log goes on after its old end; the queue after its old last offset
    r = put_msg(store, "T", 0, b"after")
    assert r.commit_log_offset == results[-1].commit_log_offset + results[-1].size
    assert r.queue_offset == 300


def test_a_torn_tail_is_cut_quietly(make_store, put_msg, read_queue, tmp_path, crash_store) -> None:
    store = make_store(**NO_CHECKPOINTS)
    results = _fill(store, put_msg, 50)
    crash_store(store)
    last = results[-1]
    seg, pos = _segment_of(tmp_path / "store", last.commit_log_offset)
    with seg.open("r+b") as f:  # half a record after the last, as a killed writer leaves it
        f.seek(pos)
        half = f.read(last.size // 2)
        f.seek(pos + last.size)
        f.write(half)
    store = make_store()
    assert store.last_recovery.truncated_bytes > 0
    assert store.damage.count == 0 and store.damage.lost_messages == 0
    got = read_queue(store, "T", 0) + read_queue(store, "T", 1)
    assert len(got) == 50


def test_a_stored_record_cut_mid_record_is_reported_with_its_count(
    make_store, put_msg, read_queue, tmp_path, caplog, crash_store
) -> None:
    store = make_store(**NO_CHECKPOINTS)
    results = _fill(store, put_msg, 50)
    crash_store(store)
    cut = results[-3]  # it and the two after it were stored (the queues say so): lost
    seg, pos = _segment_of(tmp_path / "store", cut.commit_log_offset)
    with seg.open("r+b") as f:
        f.truncate(pos + cut.size // 2)
    caplog.set_level(logging.WARNING, logger=LOGGER)

    store = make_store()
    assert store.last_recovery.truncated_bytes == cut.size // 2
    [found] = store.damage.entries()
    assert found.kind == "commit log cut" and found.offset == cut.commit_log_offset
    assert found.size == results[-1].commit_log_offset + results[-1].size - cut.commit_log_offset
    assert store.damage.count == 1 and store.damage.lost_messages == 3
    [line] = [r.getMessage() for r in caplog.records if "store damage" in r.getMessage()]
    assert "acknowledged messages are lost, 3 known from the consume queues" in line
    assert "T/1 queue offsets 23-24" in line and "T/0 queue offsets 24-24" in line
    got = read_queue(store, "T", 0) + read_queue(store, "T", 1)
    assert len(got) == 47


def test_a_deleted_newest_segment_after_a_crash_is_reported_with_its_count(
    make_store, put_msg, tmp_path, caplog, crash_store
) -> None:
    store = make_store(**NO_CHECKPOINTS)
    results = _fill(store, put_msg, 300)
    store._checkpoint()  # what the checkpoint thread does every second
    checkpointed = store.commit_log_max_offset
    results += _fill(store, put_msg, 150)
    crash_store(store)
    newest = sorted((tmp_path / "store" / "commitlog").iterdir())[-1]
    start = int(newest.name)
    assert start > checkpointed  # the checkpoint knew nothing of the newest segment
    lost = [r for r in results if r.commit_log_offset >= start]
    newest.unlink()
    caplog.set_level(logging.WARNING, logger=LOGGER)

    store = make_store()
    [found] = store.damage.entries()
    assert found.kind == "commit log cut" and found.offset == start
    assert store.damage.lost_messages == len(lost) > 0
    assert f"{len(lost)} known from the consume queues" in caplog.text


def test_a_missing_segment_in_the_middle_loses_only_its_records(
    make_store, put_msg, read_queue, tmp_path, caplog, crash_store
) -> None:
    store = make_store(**NO_CHECKPOINTS)
    results = _fill(store, put_msg, 900)
    crash_store(store)
    segments = sorted((tmp_path / "store" / "commitlog").iterdir())
    assert len(segments) >= 4
    gone = segments[1]
    start = int(gone.name)
    gone.unlink()
    caplog.set_level(logging.WARNING, logger=LOGGER)

    store = make_store()
    assert store.last_recovery.truncated_bytes == 0
    expected = [r for r in results if not start <= r.commit_log_offset < start + SEG]
    got = read_queue(store, "T", 0) + read_queue(store, "T", 1)
    assert sorted(m.commit_log_offset for m in got) == [r.commit_log_offset for r in expected]
    kinds = {(d.kind, d.offset) for d in store.damage.entries()}
    assert ("missing segment", start) in kinds
    assert f"segment file {gone.name} is missing" in caplog.text
    assert sorted((tmp_path / "store" / "commitlog").iterdir()) == [
        p for p in segments if p != gone
    ]


def test_a_deleted_newest_segment_is_a_loud_warning(
    make_store, put_msg, tmp_path, caplog, crash_store
) -> None:
    store = make_store()
    _fill(store, put_msg, 300)
    store.shutdown()  # a clean stop: the checkpoint knows every byte
    newest = sorted((tmp_path / "store" / "commitlog").iterdir())[-1]
    newest.unlink()
    caplog.set_level(logging.WARNING, logger=LOGGER)

    store = make_store()
    [found] = store.damage.entries()
    assert found.kind == "commit log short of checkpoint"
    assert found.offset == int(newest.name) and found.size > 0
    assert "acknowledged messages are lost" in caplog.text
    # every message of the deleted segment is counted (the queues pointed into it)
    assert store.damage.lost_messages > 0
    assert f"{store.damage.lost_messages} known from the consume queues" in caplog.text
