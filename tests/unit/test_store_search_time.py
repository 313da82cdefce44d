"""The store's search of a queue offset by store time (RocketMQ's SEARCH_OFFSET_BY_TIMESTAMP,
``ConsumeQueue.getOffsetInQueueByTime``): the first offset stored at or after a time, the
min offset before everything, the max offset after everything."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from txmq.broker.store import store as store_module
from txmq.protocol.message import Prop, new_message_id

T0 = 1_800_000_000_000  # store times of these tests: ms since the epoch


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The store's wall clock, set by the test (``clock.ms``)."""
    fake = SimpleNamespace(ms=T0)
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time_ns=lambda: fake.ms * 1_000_000))
    return fake


def _first_at_or_after(times: list[int], ts: int, low: int = 0) -> int:
    """The answer by brute force: the first offset (from ``low``) stored at or after ``ts``."""
    return next((i for i in range(low, len(times)) if times[i] >= ts), len(times))


def test_each_time_finds_the_first_offset_stored_at_or_after_it(make_store, put_msg, clock) -> None:
    store = make_store(cq_entries_per_file=16)  # the search crosses consume-queue files
    rng = random.Random(7)
    times: list[int] = []
    for _ in range(150):
        clock.ms += rng.choice([0, 0, 1, 5, 250])  # several messages in one millisecond
        times.append(put_msg(store, "T", 0).store_timestamp)
    assert times == sorted(times) and times[0] >= T0 and len(set(times)) < len(times)
    probes = {T0 - 10_000, T0 - 1, clock.ms + 1, clock.ms + 10**9, 0, *times}
    probes |= {t + d for t in times[::7] for d in (-1, 1)}
    for ts in sorted(probes):
        assert store.offset_by_time("T", 0, ts) == _first_at_or_after(times, ts), ts
    assert store.offset_by_time("T", 0, 0) == store.min_offset("T", 0) == 0
    assert store.offset_by_time("T", 0, clock.ms + 1) == store.max_offset("T", 0) == 150


def test_batches_queues_unknown_queues_and_a_reopened_store(make_store, clock) -> None:
    store = make_store()
    assert store.offset_by_time("nothing", 0, T0) == 0
    times: dict[int, list[int]] = {0: [], 1: []}
    for round_ in range(10):
        clock.ms = T0 + 100 * round_
        items = [
            {
                "topic": "B",
                "queue_id": i % 2,
                "body": b"x",
                "properties": {Prop.UNIQ_KEY: new_message_id()},
                "born_timestamp": T0,
            }
            for i in range(6)
        ]
        for item, r in zip(items, store.put_batch(items), strict=True):
            times[item["queue_id"]].append(r.store_timestamp)
    for qid in (0, 1):
        assert store.offset_by_time("B", qid, T0 + 250) == 9  # round 3's first message
        assert store.offset_by_time("B", qid, T0 + 300) == 9
        assert store.offset_by_time("B", qid, T0 + 901) == 30
    assert store.offset_by_time("B", 2, T0) == 0  # a queue the topic never wrote
    store.shutdown()
    store = make_store()  # the same root: the answers come from the files
    for qid in (0, 1):
        for ts in (T0 - 1, T0 + 1, T0 + 450, T0 + 900, T0 + 5000):
            assert store.offset_by_time("B", qid, ts) == _first_at_or_after(times[qid], ts)


def test_after_retention_the_min_offset_is_the_earliest_answer(make_store, put_msg, clock) -> None:
    store = make_store(cq_entries_per_file=20)
    times = []
    for _ in range(300):
        clock.ms += 10
        times.append(put_msg(store, "R", 0, b"y" * 1000).store_timestamp)
    assert store.delete_expired(now_ms=clock.ms + 73 * 3_600_000) > 0
    low = store.min_offset("R", 0)
    assert 0 < low < 300
    assert store.offset_by_time("R", 0, 0) == low  # before everything still kept
    assert store.offset_by_time("R", 0, times[low // 2]) == low  # a deleted message's time
    assert store.offset_by_time("R", 0, times[low + 3]) == low + 3
    assert store.offset_by_time("R", 0, times[-1] + 1) == 300
