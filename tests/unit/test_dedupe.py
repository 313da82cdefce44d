"""The dedupe window (broker/state/dedupe.py): the window, its bound, its memory, loading it from a
store's key index, and which records count as a client's send."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from txmq.broker.state.dedupe import DedupeWindow, client_topic
from txmq.broker.store import MessageStore, PutResult
from txmq.broker.store.index import uniq_key_hash
from txmq.protocol.message import HALF_TOPIC, SCHEDULE_TOPIC, Prop, SysFlag, new_message_id

T0 = 1_700_000_000_000  # ms


def _known(window: DedupeWindow, ids: list[str]) -> list[str]:
    return [i for i in ids if i in window]


def test_a_retry_is_answered_within_the_window_only(
    make_store: Callable[..., MessageStore],
) -> None:
    store = make_store()
    w = DedupeWindow(window_s=10, max_entries=1000)
    msg_id = new_message_id()
    assert w.admit(store, msg_id, "orders", False) is None  # new: remembered, store it
    assert msg_id in w
    r = _put(store, "orders", msg_id)
    got = w.admit(store, msg_id, "orders", False, now_ms=r.store_timestamp + 9_999)
    assert got is not None and got.commit_log_offset == r.commit_log_offset
    # stored more than the window ago: a new message
    assert w.admit(store, msg_id, "orders", False, now_ms=r.store_timestamp + 10_001) is None
    # remembered, but the store refused it (or never got it): a new message too
    lost = new_message_id()
    assert w.admit(store, lost, "orders", False) is None
    assert w.admit(store, lost, "orders", False) is None
    assert w.duplicates == 1


def test_memory_is_bounded_by_the_cap_the_newest_half_always_kept(
    make_store: Callable[..., MessageStore],
) -> None:
    store = make_store()
    w = DedupeWindow(window_s=600, max_entries=1000)
    ids = [new_message_id() for _ in range(10_000)]
    for i, msg_id in enumerate(ids):
        assert w.admit(store, msg_id, "orders", False) is None
        assert len(w) < 1000
        newest = ids[max(i - 499, 0) : i + 1]
        assert _known(w, newest) == newest
    assert _known(w, ids) == ids[-500:]  # (the newer generation was full: it is the older now)


def test_memory_per_id_is_about_70_bytes(make_store: Callable[..., MessageStore]) -> None:
    store = make_store()
    n = 200_000
    ids = [new_message_id() for _ in range(n)]
    # ids whose 32-bit hashes are alike count once: the window holds hashes (and looks a hit
    # up in the store, so two ids alike cost a lookup, never a message).  CRC-32 is linear
    # and the ids differ in a few bytes (time, counter): among 200,000 of them a loaded
    # machine's CI saw 164 alike, a quiet one a few — not the 5 of random 32-bit hashes
    distinct = len({uniq_key_hash(i) for i in ids[:-1]})
    assert distinct > n * 0.99
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        w = DedupeWindow(window_s=600, max_entries=n)
        for msg_id in ids[:-1]:  # (the last one would turn a generation over)
            w.admit(store, msg_id, "orders", False)
        per_id = (tracemalloc.get_traced_memory()[0] - before) / len(w)
    finally:
        tracemalloc.stop()
    assert len(w) == distinct
    print(f"{per_id:.0f} bytes per id")
    assert 40 < per_id < 100, per_id  # the ids themselves are the request's, not kept


def test_client_sends_are_told_from_the_brokers_own_copies() -> None:
    assert client_topic("orders", 0, {}) == "orders"
    assert client_topic("orders", SysFlag.TRANSACTION_COMMIT_TYPE, {}) is None  # a commit
    assert client_topic("%RETRY%g", 0, {}) is None
    assert client_topic("%DLQ%g", 0, {}) is None
    assert client_topic(SCHEDULE_TOPIC, 0, {Prop.REAL_TOPIC: "orders"}) == "orders"
    assert client_topic(SCHEDULE_TOPIC, 0, {Prop.REAL_TOPIC: "%RETRY%g"}) is None
    prepared = SysFlag.TRANSACTION_PREPARED_TYPE
    assert client_topic(HALF_TOPIC, prepared, {Prop.REAL_TOPIC: "orders"}) == "orders"
    recheck = {Prop.REAL_TOPIC: "orders", Prop.RECHECK_OF: "12"}
    assert client_topic(HALF_TOPIC, prepared, recheck) is None  # a parked half re-checked


def _put(store: MessageStore, topic: str, msg_id: str, qid: int = 0, **kw: object) -> PutResult:
    props = {Prop.UNIQ_KEY: msg_id, **kw.pop("props", {})}  # type: ignore[dict-item]
    r = store.put(
        topic=topic, queue_id=qid, body=b"x" * 50, properties=props, born_timestamp=T0, **kw
    )
    assert r.ok
    return r


def test_retries_are_answered_from_the_store_and_survive_a_restart(
    make_store: Callable[..., MessageStore], tmp_path: Path
) -> None:
    store = make_store(segment_size=64 * 1024)
    w = DedupeWindow(window_s=120, max_entries=10_000)
    plain = [new_message_id() for _ in range(300)]  # several segments
    results = {}
    for n, msg_id in enumerate(plain):
        assert w.admit(store, msg_id, "orders", False) is None
        results[msg_id] = _put(store, "orders", msg_id, qid=n % 3, props={Prop.KEYS: "k"})
    delayed, half, retry = new_message_id(), new_message_id(), new_message_id()
    real = {Prop.REAL_TOPIC: "orders", Prop.REAL_QID: "1"}
    d = _put(store, SCHEDULE_TOPIC, delayed, 2, props=real)
    h = _put(
        store,
        HALF_TOPIC,
        half,
        props={Prop.REAL_TOPIC: "orders", Prop.REAL_QID: "2", Prop.TRAN_MSG: "true"},
        sys_flag=SysFlag.TRANSACTION_PREPARED_TYPE,
    )
    assert w.admit(store, delayed, "orders", False) is None  # (before, in the broker)
    assert w.admit(store, half, "orders", True) is None
    # the broker's own copies with the same ids come later and are not the answer
    _put(store, "orders", delayed, 1)  # delivered
    _put(store, "orders", half, 2, sys_flag=SysFlag.TRANSACTION_COMMIT_TYPE)  # committed
    _put(store, "%RETRY%g", retry)

    def check(w: DedupeWindow) -> None:
        for msg_id in plain[::37]:
            r = results[msg_id]
            got = w.admit(store, msg_id, "orders", half=False)
            assert got is not None
            sent = got.sent(msg_id)
            assert (sent.queue_id, sent.queue_offset) == (plain.index(msg_id) % 3, r.queue_offset)
            assert sent.offset_msg_id == f"{r.commit_log_offset:016X}"
            assert (sent.store_timestamp, got.end_offset) == (r.store_timestamp, r.end_offset)
        got = w.admit(store, delayed, "orders", half=False)
        assert got is not None and (got.queue_id, got.commit_log_offset) == (1, d.commit_log_offset)
        got = w.admit(store, half, "orders", half=True)
        assert got is not None and got.sent(half).transaction_offset == h.commit_log_offset
        assert got.queue_id == 2
        assert w.admit(store, half, "orders", half=False) is None  # another kind
        assert w.admit(store, plain[0], "other-topic", half=False) is None  # another topic
        assert w.admit(store, retry, "%RETRY%g", half=False) is None  # never a client's
        assert w.admit(store, new_message_id(), "orders", half=False) is None
        assert w.duplicates == 11  # 9 plain, the delayed one, the half

    check(w)
    # a restart: loaded from the key index (KEYS hashes come along)
    store.shutdown()
    store = make_store(root=tmp_path / "store", segment_size=64 * 1024)
    w = DedupeWindow(window_s=120, max_entries=10_000)
    assert w.load(store) == 2 * 300 + 5
    check(w)
    # nothing of it in a window that ended long before now
    late = DedupeWindow(window_s=120, max_entries=10_000)
    assert late.load(store, now_ms=2**62) == 0 and len(late) == 0
    # a small cap keeps the newest
    small = DedupeWindow(window_s=120, max_entries=10)
    assert small.load(store) == 9 and len(small) <= 9  # (KEYS hashes repeat)
    assert small.admit(store, plain[0], "orders", False) is None
    assert small.admit(store, half, "orders", True) is not None
