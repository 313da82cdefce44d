"""The txmq-store data source on a store written by the broker's own MessageStore: what each
record becomes, segments and the window, a write in progress, and damage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from txmq.broker.store import MessageStore, StoreConfig
from txmq.broker.store.export import StoreUnreadable, export_path, export_store, scan_segment
from txmq.protocol.message import OP_TOPIC, Prop, SysFlag
from txmq.spark.sources import read_store
from txmq.spark.store_source import segments


def _fill(root: Path) -> dict[str, int]:
    """Every kind of record, in 4 KiB segments (so there are several); no export yet."""
    offsets: dict[str, int] = {}
    with MessageStore(StoreConfig(root, segment_size=4096, export_segments=False)) as store:

        def put(name: str, topic: str, body: bytes, props: dict[str, str], **kw: Any) -> None:
            r = store.put(
                topic=topic, queue_id=0, body=body, properties=props, born_timestamp=1, **kw
            )
            assert r.ok
            offsets[name] = r.commit_log_offset

        for i in range(40):  # filler: push the interesting records into later segments
            put(f"plain{i}", "orders", b"x" * 200, {Prop.UNIQ_KEY: f"P{i}", Prop.KEYS: f"k{i}"})
        put(
            "half",
            "RMQ_SYS_TRANS_HALF_TOPIC",
            b"{}",
            {
                Prop.UNIQ_KEY: "H1",
                Prop.KEYS: "order-1-created extra",
                Prop.REAL_TOPIC: "orders",
                Prop.PRODUCER_GROUP: "pg",
                Prop.TRANSACTION_ID: "tx-1",
                Prop.TRAN_MSG: "true",
            },
            sys_flag=SysFlag.TRANSACTION_PREPARED_TYPE,
        )
        put(
            "commit",
            "orders",
            b"{}",
            {Prop.UNIQ_KEY: "H1", Prop.KEYS: "order-1-created"},
            sys_flag=SysFlag.TRANSACTION_COMMIT_TYPE,
            prepared_transaction_offset=offsets["half"],
        )
        op = {"half_offset": offsets["half"], "resolution": "COMMIT", "msg_id": "H1"}
        put("op", "RMQ_SYS_TRANS_OP_HALF_TOPIC", json.dumps(op).replace(" ", "").encode(), {})
        put("schedule", "SCHEDULE_TOPIC_XXXX", b"{}", {Prop.UNIQ_KEY: "S1"})
        # a half whose op record comes segments later: the op record stays a row of its own
        put(
            "half2",
            "RMQ_SYS_TRANS_HALF_TOPIC",
            b"{}",
            {Prop.UNIQ_KEY: "H2", Prop.PRODUCER_GROUP: "pg", Prop.TRANSACTION_ID: "tx-2"},
            sys_flag=SysFlag.TRANSACTION_PREPARED_TYPE,
        )
        for i in range(20):
            put(f"late{i}", "orders", b"x" * 200, {Prop.UNIQ_KEY: f"L{i}"})
        op = {"half_offset": offsets["half2"], "resolution": "ROLLBACK", "msg_id": "H2"}
        put("op2", "RMQ_SYS_TRANS_OP_HALF_TOPIC", json.dumps(op).replace(" ", "").encode(), {})
        put(
            "retry",
            "%RETRY%cg",
            b"{}",
            {
                Prop.UNIQ_KEY: "R1",
                Prop.ORIGIN_MESSAGE_ID: "P3",
                Prop.RETRY_TOPIC: "orders",
                Prop.KEYS: "k3",
            },
            reconsume_times=2,
        )
        put(
            "dlq",
            "%DLQ%cg",
            b"{}",
            {Prop.UNIQ_KEY: "D1", Prop.ORIGIN_MESSAGE_ID: "P4", Prop.RETRY_TOPIC: "orders"},
            reconsume_times=17,
        )
    return offsets


def _rows(root: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for part in segments(root):
        for batch in scan_segment(part.path, part.last):
            out += batch.to_pylist()
    return out


def test_each_record_becomes_its_row(tmp_path: Path) -> None:
    offsets = _fill(tmp_path)
    assert len(segments(tmp_path)) > 2
    rows = _rows(tmp_path)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append(r)
    assert sorted(by_kind) == ["dlq", "half", "message", "op", "retry"]
    assert len(by_kind["message"]) == 61  # the schedule copy is skipped
    assert by_kind["message"][3]["msg_id"] == "P3" and by_kind["message"][3]["key"] == "k3"
    assert by_kind["message"][3]["transaction_id"] is None
    commit = by_kind["message"][40]  # a transaction's commit copy names its half
    assert (commit["msg_id"], commit["half_offset"]) == ("H1", offsets["half"])
    # each message is placed in its queue: what a group's committed offset is compared with
    assert [(m["queue_id"], m["queue_offset"]) for m in by_kind["message"]] == [
        (0, i) for i in range(61)
    ]
    half, half2 = by_kind["half"]
    assert (half["topic"], half["group"], half["msg_id"], half["transaction_id"]) == (
        "orders",
        "pg",
        "H1",
        "tx-1",
    )
    assert half["key"] == "order-1-created" and half["half_offset"] == offsets["half"]
    assert half["nkeys"] == 2
    # its op record came in the same segment: folded into the half's row
    assert half["resolution"] == "COMMIT" and half["op_ts"] >= half["store_ts"]
    assert (half2["msg_id"], half2["key"], half2["nkeys"]) == ("H2", "H2", 0)
    assert half2["resolution"] is None and half2["op_ts"] is None
    assert (half["queue_id"], half["queue_offset"]) == (None, None)
    (op,) = by_kind["op"]  # the second half's, segments later
    assert (op["half_offset"], op["resolution"]) == (offsets["half2"], "ROLLBACK")
    assert op["op_ts"] is None and op["queue_offset"] is None
    (retry,) = by_kind["retry"]
    assert (retry["group"], retry["msg_id"], retry["topic"], retry["reconsume_times"]) == (
        "cg",
        "P3",
        "orders",
        2,
    )
    # a retry copy's place is in its group's retry topic (the first there)
    assert (retry["queue_id"], retry["queue_offset"]) == (0, 0)
    (dlq,) = by_kind["dlq"]
    assert (dlq["group"], dlq["msg_id"], dlq["key"], dlq["reconsume_times"]) == (
        "cg",
        "P4",
        "P4",
        17,
    )


def test_halves_held_back_beyond_the_limit_still_come_out_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Halves wait for their op record to be folded in; past the limit the oldest goes out
    as it is and its op record stays a row: the same resolutions, just fewer rows."""
    _fill(tmp_path)

    def resolutions() -> tuple[list[int], list[tuple[int, str]]]:
        rows = _rows(tmp_path)
        halves = sorted(r["half_offset"] for r in rows if r["kind"] == "half")
        resolved = sorted(
            (r["half_offset"], r["resolution"])
            for r in rows
            if r["kind"] == "op" or (r["kind"] == "half" and r["resolution"] is not None)
        )
        return halves, resolved

    folded = resolutions()
    monkeypatch.setattr("txmq.broker.store.export._PENDING", 0)
    assert resolutions() == folded
    assert sum(r["kind"] == "op" for r in _rows(tmp_path)) == 2


def test_spark_reads_it_partitioned_by_segment(tmp_path: Path, spark: Any) -> None:
    _fill(tmp_path)
    df = read_store(spark, str(tmp_path))
    assert df.rdd.getNumPartitions() == len(segments(tmp_path))
    counts = {r["kind"]: r["count"] for r in df.groupBy("kind").count().collect()}
    assert counts == {"message": 61, "half": 2, "op": 1, "retry": 1, "dlq": 1}


def test_the_brokers_parquet_export_is_read_instead_of_decoding(tmp_path: Path, spark: Any) -> None:
    _fill(tmp_path)
    parts = segments(tmp_path)
    decoded = sorted(read_store(spark, str(tmp_path)).collect())
    written = export_store(tmp_path)
    assert written == [export_path(tmp_path, p.path) for p in parts[:-1]]  # not the newest
    df = read_store(spark, str(tmp_path))
    assert sorted(df.collect()) == decoded
    plan = df._jdf.queryExecution().executedPlan().toString()
    assert "parquet" in plan.lower()
    # an export that no longer matches its segment is ignored: the segment is decoded again
    Path(parts[0].path).write_bytes(Path(parts[0].path).read_bytes() + b"\0" * 8)
    assert sorted(read_store(spark, str(tmp_path)).collect()) == decoded
    assert export_store(tmp_path) == [export_path(tmp_path, parts[0].path)]


def test_the_op_records_the_broker_writes_name_their_transaction(tmp_path: Path) -> None:
    body = (
        b'{"half_offset":7,"half_queue_offset":0,"resolution":"ROLLBACK","msg_id":"M1",'
        b'"transaction_id":"tx-9","group":"pg","topic":"orders"}'
    )
    escaped = body.replace(b'"tx-9"', b'"tx-\\"9"')  # not for the fast path: read as JSON
    with MessageStore(StoreConfig(tmp_path, export_segments=False)) as store:
        for b in (body, escaped):
            r = store.put(topic=OP_TOPIC, queue_id=0, body=b, properties={}, born_timestamp=1)
            assert r.ok
    ops = [
        (
            r["half_offset"],
            r["resolution"],
            r["msg_id"],
            r["transaction_id"],
            r["group"],
            r["topic"],
        )
        for p in segments(tmp_path)
        for batch in scan_segment(p.path, p.last)
        for r in batch.to_pylist()
    ]
    assert ops == [
        (7, "ROLLBACK", "M1", "tx-9", "pg", "orders"),
        (7, "ROLLBACK", "M1", 'tx-"9', "pg", "orders"),
    ]


def test_a_torn_tail_is_left_for_later_and_damage_is_an_error(tmp_path: Path) -> None:
    _fill(tmp_path)
    parts = segments(tmp_path)
    whole = _rows(tmp_path)
    newest = Path(parts[-1].path)
    newest.write_bytes(newest.read_bytes()[:-7])  # a write in progress
    assert _rows(tmp_path) == whole[:-1]  # the dlq row waits for the next run
    sealed = Path(parts[0].path)
    data = bytearray(sealed.read_bytes())
    data[300] ^= 0xFF
    sealed.write_bytes(bytes(data))
    with pytest.raises(StoreUnreadable, match="CRC mismatch"):
        _rows(tmp_path)
    with pytest.raises(StoreUnreadable, match="not a txmq broker store"):
        segments(tmp_path / "elsewhere")
