"""The store's background Parquet export of sealed segments (a child process per run)."""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from txmq.broker.state.config import BrokerConfig
from txmq.broker.store import MessageStore, PutResult, StoreConfig, export, exporting
from txmq.broker.store.exporting import SegmentExporter
from txmq.protocol.message import HALF_TOPIC, Prop, SysFlag

HOUR_MS = 3_600_000
needs_pyarrow = pytest.mark.skipif(not export.available(), reason="pyarrow is not installed")


def _wait(what: str, cond: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _fill(store: MessageStore, put_msg: Callable[..., PutResult], n: int = 60) -> None:
    """``n`` records of ~300 bytes (about 4 KiB segments hold a dozen): user messages and
    half messages."""
    for i in range(n):
        if i % 3:
            put_msg(store, "orders", i % 2, b"o" * 200, keys=[f"order-{i}"])
        else:
            put_msg(
                store,
                HALF_TOPIC,
                0,
                b"h" * 200,
                props={
                    Prop.REAL_TOPIC: "orders",
                    Prop.PRODUCER_GROUP: "pg",
                    Prop.TRANSACTION_ID: f"tx-{i}",
                },
                sys_flag=SysFlag.TRANSACTION_PREPARED_TYPE,
            )


def _segments(root: Path) -> list[Path]:
    return export.segment_files(root)


def _all_exported(root: Path) -> bool:
    segs = _segments(root)
    return all(export.valid_export(root, s) is not None for s in segs[:-1])


@needs_pyarrow
def test_sealed_segments_are_exported(make_store, put_msg, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "store"
    store = make_store(segment_size=4096)
    _fill(store, put_msg)
    segs = _segments(root)
    assert len(segs) >= 4
    _wait("every sealed segment is exported", lambda: _all_exported(root))
    assert not export.export_path(root, segs[-1]).exists()  # the newest is still written
    assert sorted(p.name for p in (root / export.EXPORT_DIR).iterdir()) == sorted(
        export.export_path(root, s).name for s in segs[:-1]
    )

    seg = segs[1]
    expected = pa.Table.from_batches(
        list(export.scan_segment(seg, last=False)), schema=export.arrow_schema()
    )
    path = export.valid_export(root, seg)
    got = pq.read_table(path)
    assert expected.num_rows > 0

    def ordered(t: pa.Table) -> pa.Table:
        t = t.replace_schema_metadata(None)
        return t.sort_by([(name, "ascending") for name in t.column_names])

    assert ordered(got).equals(ordered(expected))  # the same rows, grouped by kind
    assert {"half", "message"} <= set(got.column("kind").to_pylist())
    meta = pq.ParquetFile(path).metadata
    kinds = [
        (meta.row_group(i).column(0).statistics.min, meta.row_group(i).column(0).statistics.max)
        for i in range(meta.num_row_groups)
    ]
    assert all(lo == hi for lo, hi in kinds)  # a row group per kind
    assert sorted(lo for lo, _ in kinds) == sorted(set(got.column("kind").to_pylist()))

    _fill(store, put_msg, 30)  # later rolls are exported too
    assert len(_segments(root)) > len(segs)
    _wait("the new sealed segments are exported", lambda: _all_exported(root))


@needs_pyarrow
def test_export_off_and_catching_up_on_start(make_store, put_msg, tmp_path) -> None:
    root = tmp_path / "store"
    store = make_store(segment_size=4096, export_segments=False)
    _fill(store, put_msg)
    assert store._exporter is None
    store.shutdown()
    assert len(_segments(root)) >= 4
    assert not (root / export.EXPORT_DIR).exists()

    make_store(segment_size=4096)  # segments sealed before the start are exported
    _wait("every sealed segment is exported", lambda: _all_exported(root))


@needs_pyarrow
def test_retention_deletes_exports_with_their_segments(make_store, put_msg, tmp_path) -> None:
    root = tmp_path / "store"
    store = make_store(segment_size=4096)
    _fill(store, put_msg)
    segs = _segments(root)
    _wait("every sealed segment is exported", lambda: _all_exported(root))
    now = time.time_ns() // 1_000_000
    assert store.delete_expired(now_ms=now + 73 * HOUR_MS) == len(segs) - 1
    assert _segments(root) == segs[-1:]
    for seg in segs[:-1]:
        assert not export.export_path(root, seg).exists()
    assert [p.name for p in (root / export.EXPORT_DIR).iterdir()] == []


def test_no_pyarrow_logs_once_and_exports_nothing(
    make_store, put_msg, tmp_path, monkeypatch, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="txmq.broker.store")
    monkeypatch.setattr("txmq.broker.store.store.pyarrow_installed", lambda: False)
    store = make_store(segment_size=4096)
    _fill(store, put_msg)
    store.shutdown()
    assert store._exporter is None
    assert not (tmp_path / "store" / export.EXPORT_DIR).exists()
    off = [r for r in caplog.records if "pyarrow is not installed" in r.getMessage()]
    assert len(off) == 1 and off[0].levelno == logging.INFO


def test_export_setting() -> None:
    assert BrokerConfig().store_config().export_segments is True
    c = BrokerConfig.load(env={"TXMQ_BROKER_EXPORT_SEGMENTS": "false"})
    assert c.store_config().export_segments is False
    assert StoreConfig(Path("s")).export_segments is True


# -- the exporter thread, with a stand-in for the export command -------------------------


def _fake_store(root: Path) -> None:
    """A store folder with one sealed segment (so the exporter has work)."""
    (root / "commitlog").mkdir(parents=True)
    for start in (0, 4096):
        (root / "commitlog" / f"{start:020d}").write_bytes(b"")


def _exporter(root: Path, script: str, **kw: float) -> SegmentExporter:
    """An exporter whose child runs ``script`` (``ROOT`` is the store folder) instead."""
    ex = SegmentExporter(root, **kw)
    ex._command = lambda: [sys.executable, "-c", script, str(root)]  # type: ignore[method-assign]
    return ex


#: logs "start <pid>" to ROOT/runs, then waits (at most 60 s) for ROOT/go
_BLOCKING = """
import os, sys, time
root = sys.argv[1]
with open(os.path.join(root, "runs"), "a") as f:
    f.write(f"start {os.getpid()}\\n")
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(root, "go")) and time.monotonic() < deadline:
    time.sleep(0.01)
"""


def _starts(root: Path) -> list[str]:
    runs = root / "runs"
    return runs.read_text().splitlines() if runs.exists() else []


def test_requests_during_a_run_lead_to_one_more_run(tmp_path) -> None:
    _fake_store(tmp_path)
    ex = _exporter(tmp_path, _BLOCKING)
    ex.start()
    try:
        ex.request()
        _wait("the first run started", lambda: len(_starts(tmp_path)) == 1)
        for _ in range(5):
            ex.request()
        (tmp_path / "go").touch()
        _wait("the second run finished", lambda: ex.runs == 2)
        ex.request()
        _wait("the third run finished", lambda: ex.runs == 3)
    finally:
        ex.stop()
    assert len(_starts(tmp_path)) == 3


def test_stop_terminates_a_running_child(tmp_path) -> None:
    _fake_store(tmp_path)
    ex = _exporter(tmp_path, _BLOCKING)
    ex.start()
    ex.request()
    _wait("the run started", lambda: len(_starts(tmp_path)) == 1)
    pid = int(_starts(tmp_path)[0].split()[1])
    began = time.monotonic()
    ex.stop()
    assert time.monotonic() - began < 5
    assert ex.runs == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # terminated and reaped


def test_a_failed_run_is_logged_and_the_next_one_runs(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="txmq.broker.store")
    _fake_store(tmp_path)
    ex = _exporter(tmp_path, "import sys; sys.stderr.write('boom: disk on fire'); sys.exit(1)")
    ex.start()
    try:
        ex.request()
        _wait("the run finished", lambda: ex.runs == 1)
        ex.request()
        _wait("the next run finished", lambda: ex.runs == 2)
    finally:
        ex.stop()
    failed = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(failed) == 2
    assert "exit status 1" in failed[0].getMessage()
    assert "boom: disk on fire" in failed[0].getMessage()


def test_nothing_to_do_spawns_no_child(tmp_path) -> None:
    (tmp_path / "commitlog").mkdir()
    (tmp_path / "commitlog" / f"{0:020d}").write_bytes(b"")  # only the segment being written
    ex = _exporter(tmp_path, _BLOCKING)
    ex.start()
    ex.request()
    ex.stop()  # the request was served (or dropped by stop): either way no child
    assert ex.runs == 0 and _starts(tmp_path) == []


def test_waits_for_an_export_still_running(tmp_path, caplog) -> None:
    """The child of a killed broker still holds the export lock: the next one waits."""
    caplog.set_level(logging.INFO, logger="txmq.broker.store")
    _fake_store(tmp_path)
    (tmp_path / "go").touch()
    held = os.open(tmp_path / exporting.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)
    ex = _exporter(tmp_path, _BLOCKING, retry_s=0.05)
    ex.start()
    try:
        ex.request()
        _wait(
            "the exporter found the lock taken",
            lambda: any("still running" in r.getMessage() for r in caplog.records),
        )
        assert _starts(tmp_path) == []
        os.close(held)
        _wait("the run finished", lambda: ex.runs == 1)
    finally:
        ex.stop()
    assert len(_starts(tmp_path)) == 1
