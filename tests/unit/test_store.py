"""The message store: writing, reading, filtering, key queries, concurrency."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest

from txmq.broker.store import (
    CQ_TAG_PROPERTY,
    GetStatus,
    MessageStore,
    PutStatus,
    StoreConfig,
    StoreError,
)
from txmq.broker.store.index import key_hash
from txmq.protocol.codec import check_record, decode_record, decode_records
from txmq.protocol.message import Prop, new_message_id, tag_hash
from txmq.protocol.wire.errors import MessageTooLarge


def test_roundtrip_keeps_everything_and_queue_order(make_store, put_msg, read_queue) -> None:
    store = make_store()
    sent = []
    for i in range(40):
        body = f"payload-{i}".encode() * (i + 1)
        r = put_msg(
            store,
            "orders",
            i % 3,
            body,
            tags=f"tag{i % 2}",
            keys=[f"order-{i}", "shared"],
            props={"user": f"u{i}"},
            sys_flag=4 if i == 7 else 0,
            reconsume_times=i % 5,
        )
        sent.append((i, r, body))
    for qid in range(3):
        got = read_queue(store, "orders", qid)
        expect = [(i, r, body) for i, r, body in sent if i % 3 == qid]
        assert [m.queue_offset for m in got] == list(range(len(expect)))
        for m, (i, r, body) in zip(got, expect, strict=True):
            assert m.body == body
            assert m.topic == "orders" and m.queue_id == qid
            assert m.commit_log_offset == r.commit_log_offset
            assert m.store_timestamp == r.store_timestamp
            assert m.store_size == r.size
            assert m.tags == f"tag{i % 2}"
            assert m.keys == [f"order-{i}", "shared"]
            assert m.properties == {"user": f"u{i}"}
            assert m.born_timestamp == 1_700_000_000_000
            assert m.reconsume_times == i % 5
            assert m.sys_flag == (4 if i == 7 else 0)
    offsets = [r.commit_log_offset for _, r, _ in sent]
    assert offsets == sorted(offsets)
    assert store.commit_log_max_offset == sent[-1][1].end_offset


def test_rollover_with_small_segments(make_store, put_msg, read_queue, tmp_path) -> None:
    store = make_store(segment_size=64 * 1024)
    bodies = [bytes([i % 251]) * (900 + i * 7 % 300) for i in range(400)]
    results = [put_msg(store, "roll", i % 2, b) for i, b in enumerate(bodies)]
    segments = sorted((tmp_path / "store" / "commitlog").iterdir())
    assert len(segments) >= 5
    assert [int(p.name) for p in segments] == [i * 64 * 1024 for i in range(len(segments))]
    for r in results:  # no record straddles a segment
        assert r.commit_log_offset // (64 * 1024) == (r.end_offset - 1) // (64 * 1024)
    got = read_queue(store, "roll", 0) + read_queue(store, "roll", 1)
    assert sorted(m.body for m in got) == sorted(bodies)
    for r in results[::37]:
        rec = store.look_message_by_offset(r.commit_log_offset)
        assert rec is not None and check_record(rec) == r.size


def test_many_small_messages_over_topics_and_queues(make_store, read_queue) -> None:
    store = make_store(segment_size=1024 * 1024)
    topics = [f"topic{t}" for t in range(5)]
    expected: dict[tuple[str, int], list[bytes]] = defaultdict(list)
    n = 100_000
    for i in range(n):
        topic, qid = topics[i % 5], (i // 5) % 4
        body = b"m%d" % i
        r = store.put(topic=topic, queue_id=qid, body=body, properties={}, born_timestamp=i)
        assert r.queue_offset == len(expected[(topic, qid)])
        expected[(topic, qid)].append(body)
    total = 0
    for (topic, qid), bodies in expected.items():
        got = read_queue(store, topic, qid)
        assert [m.body for m in got] == bodies
        total += len(got)
    assert total == n
    offsets = store.queue_offsets()
    assert offsets == {t: {q: (0, n // 20) for q in range(4)} for t in topics}


def test_get_messages_statuses(make_store, put_msg) -> None:
    store = make_store()
    got = store.get_messages("nope", 0, 0)
    assert got.status is GetStatus.NO_MATCHED_LOGIC_QUEUE and got.next_begin_offset == 0
    for i in range(10):
        put_msg(store, "T", 0, b"%d" % i)
    got = store.get_messages("T", 1, 0)
    assert got.status is GetStatus.NO_MATCHED_LOGIC_QUEUE
    got = store.get_messages("T", 0, 0, max_count=4)
    assert got.status is GetStatus.FOUND and len(got.records) == 4
    assert (got.next_begin_offset, got.min_offset, got.max_offset) == (4, 0, 10)
    got = store.get_messages("T", 0, 10)
    assert got.status is GetStatus.OFFSET_OVERFLOW_ONE and got.next_begin_offset == 10
    assert got.records == []
    got = store.get_messages("T", 0, 25)
    assert got.status is GetStatus.OFFSET_OVERFLOW_BADLY and got.next_begin_offset == 10
    got = store.get_messages("T", 0, 8, max_count=32)
    assert [decode_record(r).body for r in got.records] == [b"8", b"9"]
    assert got.next_begin_offset == 10
    # at least one record even when it alone exceeds max_bytes
    got = store.get_messages("T", 0, 3, max_bytes=1)
    assert len(got.records) == 1 and got.next_begin_offset == 4
    size = len(got.records[0])
    got = store.get_messages("T", 0, 0, max_bytes=3 * size)
    assert len(got.records) == 3 and got.next_begin_offset == 3


def test_tag_filtering(make_store, put_msg) -> None:
    store = make_store()
    for i in range(10):
        put_msg(store, "T", 0, b"b%d" % i, tags="b")
    put_msg(store, "T", 0, b"a0", tags="a")
    put_msg(store, "T", 0, b"none")
    want_a = {tag_hash("a")}
    got = store.get_messages("T", 0, 0, tag_codes=want_a)
    assert got.status is GetStatus.FOUND
    assert [decode_record(r).body for r in got.records] == [b"a0"]
    assert got.next_begin_offset == 12
    got = store.get_messages("T", 0, 0, max_count=3, tag_codes={tag_hash("b")})
    assert [decode_record(r).body for r in got.records] == [b"b0", b"b1", b"b2"]
    assert got.next_begin_offset == 3
    got = store.get_messages("T", 0, 0, tag_codes={tag_hash("zzz")})
    assert got.status is GetStatus.NO_MATCHED_MESSAGE and got.records == []
    assert got.next_begin_offset == 12  # skipped entries are consumed
    got = store.get_messages("T", 0, 11, tag_codes={0})  # no tag -> code 0
    assert [decode_record(r).body for r in got.records] == [b"none"]


def test_explicit_cq_tag_code(make_store, put_msg) -> None:
    store = make_store()
    put_msg(store, "SCHEDULE_TOPIC_XXXX", 2, b"later", tags="t", cq_tag_code=1234567)
    got = store.get_messages("SCHEDULE_TOPIC_XXXX", 2, 0, tag_codes={1234567})
    assert len(got.records) == 1
    stored = decode_record(got.records[0])
    assert stored.tags == "t"
    assert stored.get_property(CQ_TAG_PROPERTY) == "1234567"
    # re-storing that message without an explicit code does not carry the old one along
    r2 = store.put(
        topic="real",
        queue_id=0,
        body=stored.body,
        properties=stored.all_properties,
        born_timestamp=0,
    )
    rec = store.look_message_by_offset(r2.commit_log_offset)
    assert rec is not None and CQ_TAG_PROPERTY not in decode_record(rec).all_properties
    assert store.get_messages("real", 0, 0, tag_codes={tag_hash("t")}).records == [rec]


def test_put_batch_spanning_segments(make_store, read_queue) -> None:
    store = make_store(segment_size=64 * 1024)
    items = [
        {
            "topic": "batch",
            "queue_id": i % 3,
            "body": bytes([i]) * 1000,
            "properties": {Prop.KEYS: f"bk{i}"},
            "born_timestamp": i,
        }
        for i in range(150)
    ]
    items.insert(5, {**items[0], "topic": "bad topic!"})
    results = store.put_batch(items)
    assert results[5].status is PutStatus.MESSAGE_ILLEGAL
    ok = [r for r in results if r.ok]
    assert len(ok) == 150
    for qid in range(3):
        got = read_queue(store, "batch", qid)
        assert [m.body[0] for m in got] == [i for i in range(150) if i % 3 == qid]
        assert [m.queue_offset for m in got] == list(range(50))
    assert len(store.query_by_key("bk77")) == 1
    more = store.put_batch(items[:3])
    assert [r.queue_offset for r in more] == [50, 50, 50]


def test_rejections(make_store, put_msg) -> None:
    store = make_store(max_message_size=1000)
    with pytest.raises(MessageTooLarge, match="1001 bytes, more than max_message_size"):
        store.put(topic="T", queue_id=0, body=b"x" * 1001, properties={}, born_timestamp=0)
    with pytest.raises(MessageTooLarge):
        store.put_batch(
            [
                {
                    "topic": "T",
                    "queue_id": 0,
                    "body": b"x" * 2000,
                    "properties": {},
                    "born_timestamp": 0,
                }
            ]
        )
    assert store.max_offset("T", 0) == 0
    for topic, qid in (("", 0), ("a b", 0), ("..", 0), ("T", -1)):
        r = store.put(topic=topic, queue_id=qid, body=b"", properties={}, born_timestamp=0)
        assert r.status is PutStatus.MESSAGE_ILLEGAL
    r = store.put(
        topic="T", queue_id=0, body=b"", properties={"big": "x" * 40000}, born_timestamp=0
    )
    assert r.status is PutStatus.PROPERTIES_SIZE_EXCEEDED
    assert put_msg(store, "T", 0).queue_offset == 0


def test_record_larger_than_a_segment(make_store) -> None:
    store = make_store(segment_size=64 * 1024)
    with pytest.raises(MessageTooLarge, match="does not fit in a commit-log segment"):
        store.put(topic="T", queue_id=0, body=b"x" * 70_000, properties={}, born_timestamp=0)
    r = store.put(topic="T", queue_id=0, body=b"x" * 60_000, properties={}, born_timestamp=0)
    assert r.ok and r.queue_offset == 0


def test_look_message_by_offset(make_store, put_msg) -> None:
    store = make_store()
    rs = [put_msg(store, "T", 0, b"abc%d" % i) for i in range(3)]
    rec = store.look_message_by_offset(rs[1].commit_log_offset)
    assert rec is not None and decode_record(rec, verify=True).body == b"abc1"
    assert store.get_messages("T", 0, 1, max_count=1).records == [rec]
    assert store.look_message_by_offset(rs[1].commit_log_offset + 3) is None
    assert store.look_message_by_offset(rs[2].end_offset) is None
    assert store.look_message_by_offset(10**12) is None


def test_query_by_key_and_uniq_key(make_store, put_msg) -> None:
    store = make_store()
    ids = []
    for i in range(30):
        msg_id = new_message_id()
        ids.append(msg_id)
        keys = [f"k{i}"] + (["shared"] if i in (3, 17, 25) else [])
        put_msg(store, f"T{i % 2}", 0, b"v%d" % i, keys=keys, props={Prop.UNIQ_KEY: msg_id})
    got = [decode_record(r) for r in store.query_by_key("shared")]
    assert [m.body for m in got] == [b"v25", b"v17", b"v3"]  # newest first
    assert [m.body for m in map(decode_record, store.query_by_key("shared", max_num=2))] == [
        b"v25",
        b"v17",
    ]
    assert [decode_record(r).body for r in store.query_by_key("k4")] == [b"v4"]
    assert store.query_by_key("k") == [] and store.query_by_key("nothing") == []
    rec = store.query_by_uniq_key(ids[11])
    assert rec is not None and decode_record(rec).body == b"v11"
    assert store.query_by_uniq_key(new_message_id()) is None
    # a KEYS value equal to a message id is not found as that id, and the other way round
    put_msg(store, "T0", 0, b"tricky", keys=[ids[5]])
    rec = store.query_by_uniq_key(ids[5])
    assert rec is not None and decode_record(rec).body == b"v5"
    assert [decode_record(r).body for r in store.query_by_key(ids[5])] == [b"tricky"]
    # time range
    ts = decode_record(store.query_by_key("k25")[0]).store_timestamp
    assert store.query_by_key("k25", end_ts=ts - 1) == []
    assert len(store.query_by_key("k25", begin_ts=ts, end_ts=ts)) == 1


def test_query_by_key_with_colliding_hashes(make_store, put_msg) -> None:
    a, b = "nsCfdSvdyCAN", "upTFoisuNZPh"
    assert key_hash(a) == key_hash(b)  # a real CRC-32 collision
    store = make_store(index_slots=1)  # and every key in one slot chain
    for i in range(20):
        put_msg(store, "T", i % 2, b"x%d" % i, keys=[f"key{i}"])
    put_msg(store, "T", 0, b"with-a", keys=[a])
    put_msg(store, "T", 0, b"with-b", keys=[b, "key3"])
    assert [decode_record(r).body for r in store.query_by_key(a)] == [b"with-a"]
    assert [decode_record(r).body for r in store.query_by_key(b)] == [b"with-b"]
    assert [decode_record(r).body for r in store.query_by_key("key3")] == [b"with-b", b"x3"]


def test_index_rolls_to_new_files(make_store, put_msg, tmp_path) -> None:
    store = make_store(index_slots=16, index_entries_per_file=50)
    for i in range(100):  # three index entries each: UNIQ_KEY and two keys
        put_msg(store, "T", 0, b"%d" % i, keys=[f"k{i}", "all"])
    assert len(list((tmp_path / "store" / "index").iterdir())) == 6
    found = store.query_by_key("all", max_num=1000)
    assert [decode_record(r).body for r in found] == [b"%d" % i for i in reversed(range(100))]
    assert decode_record(store.query_by_key("k42")[0]).body == b"42"


def test_concurrent_puts_keep_offsets_dense(make_store, read_queue) -> None:
    store = make_store(segment_size=256 * 1024)
    per_thread, threads = 1500, 8
    results: list[list[tuple[int, int, int, int]]] = [[] for _ in range(threads)]

    def work(t: int) -> None:
        for i in range(per_thread):
            qid = (t + i) % 4
            if i % 10 == 0:
                rs = store.put_batch(
                    [
                        {
                            "topic": "C",
                            "queue_id": qid,
                            "body": b"%d-%d" % (t, i),
                            "properties": {},
                            "born_timestamp": 0,
                        }
                    ]
                )
                r = rs[0]
            else:
                r = store.put(
                    topic="C",
                    queue_id=qid,
                    body=b"%d-%d" % (t, i),
                    properties={},
                    born_timestamp=0,
                )
            results[t].append((qid, r.queue_offset, r.commit_log_offset, i))

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    by_queue: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for t, rs in enumerate(results):
        # each thread's own messages keep their order within a queue
        last: dict[int, int] = {}
        for qid, qoff, phy, _i in rs:
            assert qoff > last.get(qid, -1)
            last[qid] = qoff
            by_queue[qid].append((qoff, phy))
        assert len(rs) == per_thread, t
    for qid, entries in by_queue.items():
        entries.sort()
        assert [q for q, _ in entries] == list(range(len(entries)))
        phys = [p for _, p in entries]
        assert phys == sorted(phys) and len(set(phys)) == len(phys)
        got = read_queue(store, "C", qid)
        assert [m.commit_log_offset for m in got] == phys
    assert sum(len(v) for v in by_queue.values()) == per_thread * threads


def test_store_directory_is_locked(make_store, tmp_path) -> None:
    make_store()
    other = MessageStore(StoreConfig(root=tmp_path / "store"))
    with pytest.raises(StoreError, match="in use"):
        other.start()


def test_put_after_shutdown(make_store) -> None:
    store = make_store()
    store.shutdown()
    store.shutdown()  # idempotent
    r = store.put(topic="T", queue_id=0, body=b"", properties={}, born_timestamp=0)
    assert r.status is PutStatus.SERVICE_NOT_AVAILABLE
    with pytest.raises(StoreError):
        store.start()


def test_decode_records_of_a_pull(make_store, put_msg) -> None:
    store = make_store()
    for i in range(5):
        put_msg(store, "T", 0, b"%d" % i)
    got = store.get_messages("T", 0, 0)
    assert [m.body for m in decode_records(b"".join(got.records))] == [b"0", b"1", b"2", b"3", b"4"]


def test_readers_never_see_partial_records(make_store) -> None:
    store = make_store(segment_size=128 * 1024)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen = [0, 0]

    def write(qid: int) -> None:
        for i in range(3000):
            store.put(
                topic="R", queue_id=qid, body=bytes([i % 256]) * (50 + i % 900),
                properties={Prop.KEYS: f"r{qid}-{i}"}, born_timestamp=0,
            )  # fmt: skip

    def read(qid: int) -> None:
        offset = 0
        try:
            while not stop.is_set() or offset < store.max_offset("R", qid):
                got = store.get_messages("R", qid, offset, max_count=64)
                for rec in got.records:
                    m = decode_record(rec, verify=True)
                    assert m.queue_offset == offset and m.body == bytes([offset % 256]) * (
                        50 + offset % 900
                    )
                    assert store.look_message_by_offset(m.commit_log_offset) == rec
                    offset += 1
                seen[qid] = offset
                if not got.records:
                    stop.wait(0.001)  # caught up: let the writers run
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(q,)) for q in (0, 1)]
    readers = [threading.Thread(target=read, args=(q,)) for q in (0, 1)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert errors == []
    assert seen == [3000, 3000]
