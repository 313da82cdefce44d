"""The store's replication primitives: a slave copies the master's commit log byte for byte
(records and segment-end blanks at the same offsets), builds its own consume queues and key
index, refuses damaged or misplaced bytes, and cuts back a tail the master never had."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from txmq.broker.store import MessageStore, PutResult, ReplicaError
from txmq.broker.store.commitlog import segment_paths
from txmq.protocol.codec import decode_records
from txmq.protocol.message import MessageExt

Put = Callable[..., PutResult]
Read = Callable[..., list[MessageExt]]


def copy_all(master: MessageStore, slave: MessageStore, chunk: int = 4096) -> int:
    """Replicate until the slave has everything; return how many transfers it took."""
    transfers = 0
    while slave.commit_log_max_offset < master.commit_log_max_offset:
        data = master.read_records(slave.commit_log_max_offset, chunk)
        assert data, "the master has bytes the slave lacks but read none"
        slave.append_replicated(slave.commit_log_max_offset, data)
        transfers += 1
    return transfers


def log_bytes(store: MessageStore) -> bytes:
    return b"".join(p.read_bytes() for p in segment_paths(store.root / "commitlog"))


def test_a_slave_copies_the_log_byte_for_byte(
    make_store: Callable[..., MessageStore], put_msg: Put, read_queue: Read, tmp_path: Path
) -> None:
    master = make_store(tmp_path / "m", segment_size=16 * 1024)
    slave = make_store(tmp_path / "s", segment_size=16 * 1024)
    for i in range(300):  # ~ 4 segments: every segment end has a blank
        put_msg(master, "T", i % 3, f"body-{i}".encode() * (1 + i % 20), keys=[f"k{i}"])
    transfers = copy_all(master, slave)
    assert transfers > 4  # chunks of 4 KiB, cut at record boundaries
    assert len(segment_paths(master.root / "commitlog")) >= 4
    assert log_bytes(slave) == log_bytes(master)
    for q in range(3):
        mine = [(m.msg_id, m.body, m.queue_offset) for m in read_queue(slave, "T", q)]
        theirs = [(m.msg_id, m.body, m.queue_offset) for m in read_queue(master, "T", q)]
        assert mine == theirs and len(mine) == 100
    found = decode_records(b"".join(slave.query_by_key("k123")))
    assert [m.body for m in found] == [b"body-123" * 4]


def test_a_record_larger_than_the_chunk_goes_whole(
    make_store: Callable[..., MessageStore], put_msg: Put, tmp_path: Path
) -> None:
    master = make_store(tmp_path / "m")
    slave = make_store(tmp_path / "s")
    put_msg(master, body=b"x" * 10_000)
    put_msg(master, body=b"y")
    first = master.read_records(0, 100)
    assert len(first) > 10_000
    slave.append_replicated(0, first)
    copy_all(master, slave, chunk=100)
    assert log_bytes(slave) == log_bytes(master)


def test_damaged_or_misplaced_bytes_are_refused_whole(
    make_store: Callable[..., MessageStore], put_msg: Put, read_queue: Read, tmp_path: Path
) -> None:
    master = make_store(tmp_path / "m")
    slave = make_store(tmp_path / "s")
    for i in range(5):
        put_msg(master, body=f"m{i}".encode())
    data = master.read_records(0)
    bad = bytearray(data)
    bad[len(bad) - 3] ^= 0xFF  # inside the last record: its CRC no longer matches
    with pytest.raises(ReplicaError, match="damaged"):
        slave.append_replicated(0, bytes(bad))
    assert slave.commit_log_max_offset == 0 and slave.max_offset("T", 0) == 0
    with pytest.raises(ReplicaError, match="ends at 0"):
        slave.append_replicated(len(data), data)
    slave.append_replicated(0, data)
    with pytest.raises(ReplicaError, match="ends at"):
        slave.append_replicated(0, data)  # the same bytes twice: refused, not doubled
    assert [m.body for m in read_queue(slave, "T", 0)] == [f"m{i}".encode() for i in range(5)]


def test_cut_back_then_follow_another_log(
    make_store: Callable[..., MessageStore], put_msg: Put, read_queue: Read, tmp_path: Path
) -> None:
    """The old master had a tail the new master never got: cut it, then copy the new
    master's records into the same offsets."""
    old = make_store(tmp_path / "old", segment_size=16 * 1024)
    new = make_store(tmp_path / "new", segment_size=16 * 1024)
    for i in range(100):
        put_msg(old, "T", i % 2, f"a{i}".encode() * 30, keys=[f"a{i}"])
    copy_all(old, new)
    common = old.commit_log_max_offset
    for i in range(60):  # acknowledged by nobody else: lost with the old master
        put_msg(old, "T", i % 2, f"lost{i}".encode() * 30, keys=[f"lost{i}"])
    for i in range(40):  # the new master's own
        put_msg(new, "T", i % 2, f"b{i}".encode() * 30, keys=[f"b{i}"])
    removed = old.truncate_to(common)
    assert removed > 0 and old.commit_log_max_offset == common
    assert old.query_by_key("lost5") == []
    copy_all(new, old)
    assert log_bytes(old) == log_bytes(new)
    bodies = [m.body for q in (0, 1) for m in read_queue(old, "T", q)]
    assert len(bodies) == 140 and not any(b.startswith(b"lost") for b in bodies)
    assert [m.body for m in decode_records(b"".join(old.query_by_key("b7")))] == [b"b7" * 30]


def test_a_cut_back_store_recovers_to_the_cut(
    make_store: Callable[..., MessageStore],
    put_msg: Put,
    read_queue: Read,
    crash_store: Callable[[MessageStore], None],
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path / "s", segment_size=16 * 1024)
    for _i in range(50):
        put_msg(store, body=b"k" * 100)
    keep = store.commit_log_max_offset
    for _i in range(200):
        put_msg(store, body=b"d" * 100)
    store.truncate_to(keep)
    crash_store(store)
    again = make_store(tmp_path / "s", segment_size=16 * 1024)
    assert again.commit_log_max_offset == keep
    assert len(read_queue(again, "T", 0)) == 50
    assert again.damage.count == 0


def test_a_new_slave_starts_at_the_masters_oldest_segment(
    make_store: Callable[..., MessageStore], put_msg: Put, read_queue: Read, tmp_path: Path
) -> None:
    master = make_store(tmp_path / "m", segment_size=16 * 1024)
    for _i in range(300):
        put_msg(master, "T", 0, b"z" * 200)
    segs = segment_paths(master.root / "commitlog")
    oldest = int(segs[1].name)
    slave = make_store(tmp_path / "s", segment_size=16 * 1024)
    slave.start_replica_at(oldest)
    while slave.commit_log_max_offset < master.commit_log_max_offset:
        at = slave.commit_log_max_offset
        slave.append_replicated(at, master.read_records(at))
    got = read_queue(slave, "T", 0, start=slave.min_offset("T", 0))
    assert got and got[-1].queue_offset == 299
    assert got[0].commit_log_offset == oldest
    with pytest.raises(ReplicaError, match="empty store"):
        slave.start_replica_at(0)


def test_replicated_segments_keep_their_times_for_retention(
    make_store: Callable[..., MessageStore], put_msg: Put, tmp_path: Path
) -> None:
    """A segment's time is its newest record's, also when its last transfer held only the
    segment-end blank (a bug once made retention delete such segments on slaves)."""
    master = make_store(tmp_path / "m", segment_size=16 * 1024)
    slave = make_store(tmp_path / "s", segment_size=16 * 1024)
    for _ in range(200):
        put_msg(master, "T", 0, b"x" * 300)
    copy_all(master, slave, chunk=1)  # one record a transfer: each blank goes alone
    assert len(segment_paths(slave.root / "commitlog")) >= 3
    assert slave.delete_expired() == master.delete_expired() == 0
    assert log_bytes(slave) == log_bytes(master)


def test_a_slave_survives_its_transfer_and_metadata_copy_failing_together() -> None:
    """A master killed fails both of a slave's requests at once: an ExceptionGroup of two
    connection errors is a lost master (retried), not a crash; anything else propagates."""
    from txmq.broker.ha.slave import _expected
    from txmq.protocol.wire.errors import BrokerUnavailable

    lost = BrokerUnavailable("connection closed")
    both = ExceptionGroup("tg", [lost, ExceptionGroup("inner", [BrokerUnavailable("closed")])])
    assert _expected(both) is lost
    assert _expected(ExceptionGroup("tg", [lost, ValueError("a bug")])) is None
    assert _expected(OSError("refused")) is not None and _expected(KeyError("x")) is None
