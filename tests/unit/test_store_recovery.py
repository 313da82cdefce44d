"""Recovery: clean and unclean restarts, torn commit-log tails, lost consume-queue files."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from txmq.broker.store import GetStatus
from txmq.protocol.codec import decode_record

LOGGER = "txmq.broker.store"
NO_CHECKPOINTS = {"cq_flush_interval_ms": 3_600_000}  # only the one written at start-up


def _fill(store, put_msg, n: int = 60, topics: tuple[str, ...] = ("T", "U"), queues: int = 3):
    return [
        put_msg(store, topics[i % len(topics)], i % queues, b"body-%d" % i, keys=[f"key{i}"])
        for i in range(n)
    ]


def _snapshot(store, read_queue) -> dict[tuple[str, int], list[tuple[int, int, bytes]]]:
    out = {}
    for topic, queues in store.queue_offsets().items():
        for qid in queues:
            out[(topic, qid)] = [
                (m.queue_offset, m.commit_log_offset, m.body)
                for m in read_queue(store, topic, qid, store.min_offset(topic, qid))
            ]
    return out


def _segment_of(root: Path, offset: int, segment_size: int = 64 * 1024) -> tuple[Path, int]:
    start = offset - offset % segment_size
    return root / "commitlog" / f"{start:020d}", offset - start


def test_clean_restart_reads_nothing_again(make_store, put_msg, read_queue, tmp_path) -> None:
    store = make_store()
    _fill(store, put_msg, 500)
    end = store.commit_log_max_offset
    before = _snapshot(store, read_queue)
    store.shutdown()
    assert not (tmp_path / "store" / "abort").exists()

    store = make_store()
    rec = store.last_recovery
    assert rec.clean
    assert rec.redispatched == 0 and rec.truncated_bytes == 0
    assert rec.scanned_from == end  # the scan starts at the end: nothing is read again
    assert store.commit_log_max_offset == end and store.flushed_offset == end
    assert _snapshot(store, read_queue) == before
    r = put_msg(store, "T", 0, b"next")
    assert r.queue_offset == len(before[("T", 0)]) and r.commit_log_offset == end
    assert [decode_record(x).body for x in store.query_by_key("key77")] == [b"body-77"]


def test_unclean_restart_rebuilds_from_the_checkpoint(
    make_store, put_msg, read_queue, crash_store
) -> None:
    store = make_store(index_slots=7, index_entries_per_file=40, **NO_CHECKPOINTS)
    _fill(store, put_msg, 100)
    store._checkpoint()  # what the checkpoint thread does every second
    ckpt = store.commit_log_max_offset
    _fill(store, put_msg, 70, topics=("T", "V"))
    before = _snapshot(store, read_queue)
    crash_store(store)

    store = make_store(index_slots=7, index_entries_per_file=40)
    rec = store.last_recovery
    assert not rec.clean
    assert rec.scanned_from == ckpt and rec.redispatched == 70 and rec.truncated_bytes == 0
    assert _snapshot(store, read_queue) == before
    for i in range(100):  # key0..key69 were used before and after the checkpoint
        assert len(store.query_by_key(f"key{i}")) == (2 if i < 70 else 1), i
    assert put_msg(store, "V", 1).queue_offset == len(before[("V", 1)])


def test_crash_without_any_checkpoint_rebuilds_everything(
    make_store, put_msg, read_queue, crash_store
) -> None:
    store = make_store(**NO_CHECKPOINTS)
    _fill(store, put_msg, 300)
    before = _snapshot(store, read_queue)
    crash_store(store)
    store = make_store()
    rec = store.last_recovery
    assert not rec.clean and rec.scanned_from == 0 and rec.redispatched == 300
    assert _snapshot(store, read_queue) == before
    assert all(len(store.query_by_key(f"key{i}")) == 1 for i in range(300))


def test_deleted_checkpoint_rebuilds_consume_queues(
    make_store, put_msg, read_queue, tmp_path
) -> None:
    store = make_store()
    _fill(store, put_msg, 200)
    before = _snapshot(store, read_queue)
    store.shutdown()
    (tmp_path / "store" / "checkpoint").unlink()
    store = make_store()
    assert store.last_recovery.scanned_from == 0 and store.last_recovery.redispatched == 200
    assert _snapshot(store, read_queue) == before


def test_unreadable_checkpoint_is_ignored(
    make_store, put_msg, read_queue, tmp_path, caplog
) -> None:
    store = make_store()
    _fill(store, put_msg, 50)
    before = _snapshot(store, read_queue)
    store.shutdown()
    ckpt = tmp_path / "store" / "checkpoint"
    data = bytearray(ckpt.read_bytes())
    data[-3] ^= 0x55
    ckpt.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = make_store()
    assert "checkpoint" in caplog.text and "unreadable" in caplog.text
    assert store.last_recovery.redispatched == 50
    assert _snapshot(store, read_queue) == before


def test_lost_consume_queue_files_are_rebuilt(
    make_store, put_msg, read_queue, tmp_path, caplog
) -> None:
    store = make_store(cq_entries_per_file=16)
    _fill(store, put_msg, 600)
    before = _snapshot(store, read_queue)
    store.shutdown()
    cq = tmp_path / "store" / "consumequeue"
    shutil.rmtree(cq / "T" / "1")  # a whole queue
    files = sorted((cq / "U" / "0").iterdir())
    os.truncate(files[-1], 3 * 20 + 7)  # a truncated last file with a partial entry
    files = sorted((cq / "T" / "2").iterdir())
    files[3].unlink()  # a file in the middle
    caplog.set_level(logging.WARNING, logger=LOGGER)

    store = make_store(cq_entries_per_file=16)
    assert _snapshot(store, read_queue) == before
    assert "consume queue T/1 has 0 entries, the checkpoint recorded 100" in caplog.text
    assert "consume queue U/0" in caplog.text and "consume queue T/2" in caplog.text
    assert put_msg(store, "T", 1).queue_offset == 100


def test_whole_consume_queue_directory_lost(make_store, put_msg, read_queue, tmp_path) -> None:
    store = make_store()
    _fill(store, put_msg, 300)
    before = _snapshot(store, read_queue)
    store.shutdown()
    shutil.rmtree(tmp_path / "store" / "consumequeue")
    store = make_store()
    assert store.last_recovery.redispatched == 300
    assert _snapshot(store, read_queue) == before


def test_garbage_after_the_last_record_is_cut(
    make_store, put_msg, read_queue, tmp_path, caplog
) -> None:
    store = make_store()
    _fill(store, put_msg, 50)
    end = store.commit_log_max_offset
    before = _snapshot(store, read_queue)
    store.shutdown()
    seg, _ = _segment_of(tmp_path / "store", end)
    with seg.open("ab") as f:
        f.write(b"\xff" * 100)
    caplog.set_level(logging.WARNING, logger=LOGGER)

    store = make_store()
    assert store.last_recovery.truncated_bytes == 100
    assert f"commit log: truncated 100 bytes at offset {end} (garbage" in caplog.text
    assert store.commit_log_max_offset == end
    assert _snapshot(store, read_queue) == before
    assert put_msg(store, "T", 0).commit_log_offset == end


def test_flipped_byte_fails_the_crc(
    make_store, put_msg, read_queue, tmp_path, caplog, crash_store
) -> None:
    store = make_store(**NO_CHECKPOINTS)
    results = _fill(store, put_msg, 50)
    before = _snapshot(store, read_queue)
    crash_store(store)
    last = results[-1]
    seg, pos = _segment_of(tmp_path / "store", last.commit_log_offset)
    with seg.open("r+b") as f:
        f.seek(pos + 75)
        byte = f.read(1)
        f.seek(pos + 75)
        f.write(bytes([byte[0] ^ 0x01]))
    caplog.set_level(logging.WARNING, logger=LOGGER)

    store = make_store()
    assert store.last_recovery.truncated_bytes == last.size
    assert (
        f"commit log: truncated {last.size} bytes at offset {last.commit_log_offset} "
        "(corrupt record: CRC mismatch)" in caplog.text
    )
    after = _snapshot(store, read_queue)
    lost = ("U", 49 % 3)
    assert after[lost] == before[lost][:-1]
    assert {k: v for k, v in after.items() if k != lost} == {
        k: v for k, v in before.items() if k != lost
    }
    assert store.query_by_key("key49") == []
    r = put_msg(store, *lost)
    assert r.queue_offset == last.queue_offset and r.commit_log_offset == last.commit_log_offset


def test_half_written_record_is_cut(
    make_store, put_msg, read_queue, tmp_path, caplog, crash_store
) -> None:
    store = make_store(**NO_CHECKPOINTS)
    _fill(store, put_msg, 40)
    before = _snapshot(store, read_queue)
    last = put_msg(store, "Solo", 0, b"x" * 500)
    crash_store(store)
    seg, pos = _segment_of(tmp_path / "store", last.commit_log_offset)
    os.truncate(seg, pos + last.size // 2)
    caplog.set_level(logging.WARNING, logger=LOGGER)

    store = make_store()
    half = last.size // 2
    assert store.last_recovery.truncated_bytes == half
    assert (
        f"commit log: truncated {half} bytes at offset {last.commit_log_offset} "
        f"(partial record ({half} of {last.size} bytes))" in caplog.text
    )
    after = _snapshot(store, read_queue)
    assert after.pop(("Solo", 0)) == []
    assert after == before
    got = store.get_messages("Solo", 0, 0)
    assert got.status is GetStatus.NO_MESSAGE_IN_QUEUE and got.next_begin_offset == 0
    assert put_msg(store, "Solo", 0).queue_offset == 0


def test_explicit_tag_code_survives_rebuild(make_store, put_msg, crash_store) -> None:
    store = make_store(**NO_CHECKPOINTS)
    put_msg(store, "SCHEDULE_TOPIC_XXXX", 3, b"d", tags="t", cq_tag_code=1_800_000_000_000)
    crash_store(store)
    store = make_store()
    assert store.last_recovery.redispatched == 1
    got = store.get_messages("SCHEDULE_TOPIC_XXXX", 3, 0, tag_codes={1_800_000_000_000})
    assert len(got.records) == 1


_CHILD = """
import sys
from pathlib import Path
from txmq.broker.store import FlushMode, MessageStore, StoreConfig

store = MessageStore(StoreConfig(
    root=Path(sys.argv[1]), segment_size=64 * 1024, flush_mode=FlushMode.SYNC,
    flush_interval_ms=60_000, cq_flush_interval_ms=3_600_000,
))
store.start()
i = 0
while True:
    r = store.put(topic="K", queue_id=i % 2, body=b"msg-%d" % i,
                  properties={"KEYS": "key%d" % i}, born_timestamp=0)
    assert store.flush_wait(r.end_offset, timeout=10)
    print(i, r.queue_offset, r.commit_log_offset, flush=True)
    i += 1
"""


def test_sync_acknowledged_messages_survive_sigkill(make_store, tmp_path) -> None:
    root = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CHILD), str(root)],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    acked: list[tuple[int, int, int]] = []
    deadline = time.monotonic() + 15
    try:
        assert proc.stdout is not None
        while len(acked) < 300 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            i, qoff, phy = map(int, line.split())
            acked.append((i, qoff, phy))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert len(acked) == 300, "the child did not acknowledge 300 messages in time"

    store = make_store(root=root)
    assert not store.last_recovery.clean
    for i, qoff, phy in acked:
        got = store.get_messages("K", i % 2, qoff, max_count=1)
        assert got.status is GetStatus.FOUND
        m = decode_record(got.records[0], verify=True)
        assert (m.body, m.commit_log_offset) == (b"msg-%d" % i, phy)
    assert len(store.query_by_key("key123")) == 1


def test_crash_after_several_rolls(make_store, put_msg, read_queue, crash_store) -> None:
    store = make_store(**NO_CHECKPOINTS)
    for i in range(150):
        put_msg(store, "T", i % 2, b"a%d" % i * 200, keys=[f"key{i}"])
    store._checkpoint()
    ckpt = store.commit_log_max_offset
    results = [put_msg(store, "T", i % 2, b"b%d" % i * 200) for i in range(400)]
    assert results[-1].commit_log_offset // (64 * 1024) > ckpt // (64 * 1024) + 2
    before = _snapshot(store, read_queue)
    crash_store(store)
    store = make_store()
    rec = store.last_recovery
    assert (rec.scanned_from, rec.redispatched, rec.truncated_bytes) == (ckpt, 400, 0)
    assert _snapshot(store, read_queue) == before
    assert len(store.query_by_key("key3")) == 1


def test_queue_rebuilt_after_retention_starts_at_the_first_surviving_message(
    make_store, put_msg, read_queue, tmp_path
) -> None:
    store = make_store()
    results = [put_msg(store, "T", 0, b"x" * 1000) for _ in range(300)]
    assert store.delete_expired(now_ms=time.time_ns() // 1_000_000 + 100 * 3_600_000) > 0
    low = store.min_offset("T", 0)
    before = _snapshot(store, read_queue)
    store.shutdown()
    shutil.rmtree(tmp_path / "store" / "consumequeue" / "T" / "0")

    store = make_store()
    assert store.min_offset("T", 0) == low
    assert store.max_offset("T", 0) == 300
    assert _snapshot(store, read_queue) == before
    assert [m[1] for m in before[("T", 0)]] == [
        r.commit_log_offset for r in results if r.commit_log_offset >= store.commit_log_min_offset
    ]
    got = store.get_messages("T", 0, 0)
    assert got.status is GetStatus.OFFSET_TOO_SMALL and got.next_begin_offset == low
