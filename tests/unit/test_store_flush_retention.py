"""Flushing (SYNC group commit, ASYNC periodic) and retention of old segments."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from txmq.broker.store import FlushMode, GetStatus, StoreError

HOUR_MS = 3_600_000


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_sync_group_commit(make_store, put_msg, monkeypatch, tmp_path) -> None:
    store = make_store(flush_mode=FlushMode.SYNC, flush_interval_ms=60_000)
    commit_log = str(tmp_path / "store" / "commitlog")
    fsyncs = 0
    real = os.fdatasync

    def counting(fd: int) -> None:
        # only this store's commit log: consume-queue flushes (checkpoints) and stores of
        # other tests whose threads are still winding down are not group commits
        nonlocal fsyncs
        if os.readlink(f"/proc/self/fd/{fd}").startswith(commit_log):
            fsyncs += 1
            # a disk whose fsync takes 5 ms, as a real one may: on tmpfs or a fast SSD a
            # loaded machine could switch threads between every two puts, and the batches
            # this test is about would depend on the scheduler
            time.sleep(0.005)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    workers, rounds = 16, 20

    async def worker(w: int) -> None:
        for _ in range(rounds):
            r = put_msg(store, "T", w % 4, b"x" * 1024)
            await store.wait_flushed(r.end_offset)
            assert store.flushed_offset >= r.end_offset

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(workers))), 15)

    asyncio.run(main())
    assert store.flushed_offset == store.commit_log_max_offset
    # the flush interval is a minute: every wait was served by requested flushes,
    # and waiters share them
    assert 0 < fsyncs <= workers * rounds // 4


def test_sync_flush_wait_from_threads(make_store, put_msg) -> None:
    store = make_store(flush_mode=FlushMode.SYNC, flush_interval_ms=60_000)
    ok: list[bool] = []

    def work() -> None:
        for _ in range(25):
            r = put_msg(store, "T", 0, b"y" * 100)
            ok.append(store.flush_wait(r.end_offset, timeout=10))
            assert store.flushed_offset >= r.end_offset

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ok == [True] * 200


def test_async_mode_flushes_periodically(make_store, put_msg) -> None:
    store = make_store(flush_mode=FlushMode.ASYNC, flush_interval_ms=20)
    r = put_msg(store, "T", 0)

    async def main() -> None:
        await asyncio.wait_for(store.wait_flushed(r.end_offset), 10)

    asyncio.run(main())
    assert store.flushed_offset >= r.end_offset
    r2 = put_msg(store, "T", 0)
    assert store.flush_wait(r2.end_offset, timeout=10)


def test_async_flush_wait_times_out_between_flushes(make_store, put_msg) -> None:
    store = make_store(flush_interval_ms=3_600_000, cq_flush_interval_ms=3_600_000)
    r = put_msg(store, "T", 0)
    assert not store.flush_wait(r.end_offset, timeout=0.05)
    store.shutdown()  # the final flush covers it
    assert store.flush_wait(r.end_offset)
    assert store.flushed_offset >= r.end_offset


def test_wait_after_shutdown(make_store, put_msg) -> None:
    store = make_store()
    r = put_msg(store, "T", 0)
    store.shutdown()

    async def main() -> None:
        await store.wait_flushed(r.end_offset)  # already flushed: returns
        with pytest.raises(StoreError):
            await store.wait_flushed(r.end_offset + 1)

    asyncio.run(main())


def test_retention_deletes_old_segments(make_store, put_msg, read_queue, tmp_path) -> None:
    cfg = {"cq_entries_per_file": 20, "index_entries_per_file": 30, "index_slots": 64}
    store = make_store(**cfg)
    results = [put_msg(store, "T", i % 2, b"x" * 1000, keys=[f"k{i}"]) for i in range(300)]
    root = tmp_path / "store"
    segments = sorted((root / "commitlog").iterdir())
    index_files = len(list((root / "index").iterdir()))
    assert len(segments) >= 5
    assert store.delete_expired() == 0
    assert store.delete_expired(now_ms=_now_ms() + 71 * HOUR_MS) == 0

    assert store.delete_expired(now_ms=_now_ms() + 73 * HOUR_MS) == len(segments) - 1
    assert sorted((root / "commitlog").iterdir()) == segments[-1:]
    cl_min = int(segments[-1].name)
    assert store.commit_log_min_offset == cl_min
    for qid in (0, 1):
        kept = [r for r in results[qid::2] if r.commit_log_offset >= cl_min]
        low = store.min_offset("T", qid)
        assert low == kept[0].queue_offset > 0
        got = store.get_messages("T", qid, 0)
        assert got.status is GetStatus.OFFSET_TOO_SMALL and got.next_begin_offset == low
        msgs = read_queue(store, "T", qid, low)
        assert [m.commit_log_offset for m in msgs] == [r.commit_log_offset for r in kept]
        files = sorted((root / "consumequeue" / "T" / str(qid)).iterdir())
        assert int(files[0].name) // 20 > 0  # files wholly below the new minimum are gone
        assert int(files[0].name) // 20 <= low
    assert len(list((root / "index").iterdir())) < index_files
    assert store.query_by_key("k0") == []
    assert len(store.query_by_key("k299")) == 1
    assert store.look_message_by_offset(results[0].commit_log_offset) is None
    mins = {q: store.min_offset("T", q) for q in (0, 1)}
    store.shutdown()

    store = make_store(**cfg)
    assert {q: store.min_offset("T", q) for q in (0, 1)} == mins
    assert store.commit_log_min_offset == cl_min
    assert put_msg(store, "T", 0).queue_offset == 150


def test_retention_thread(make_store, put_msg) -> None:
    store = make_store(retention_hours=1e-6, retention_check_interval_s=0.02)
    for _ in range(200):
        put_msg(store, "T", 0, b"z" * 1000)
    deadline = time.monotonic() + 10
    while store.commit_log_min_offset == 0:
        assert time.monotonic() < deadline, "the retention thread deleted nothing"
        time.sleep(0.01)
    assert store.min_offset("T", 0) > 0
    got = store.get_messages("T", 0, 0)
    assert got.status is GetStatus.OFFSET_TOO_SMALL
