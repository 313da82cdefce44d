"""The transaction records of commit-log segments as Arrow rows, and their Parquet export.

Reconciliation (``spark/``) needs, for every transaction, the half message, its op records,
the committed message, and the retry and dead-letter copies.  :func:`scan_segment` decodes
one segment file into rows of :func:`arrow_schema` (one pass of Python per record, every CRC
checked).  Since a sealed segment never changes, the broker exports each one once, after it
rolls to the next, as ``<store>/export/<segment name>.parquet`` (:func:`export_store`, run in
a child process, ``python -m broker.store.export STORE``); the job then reads Parquet for the
sealed segments and decodes only the newest one itself.

========  ==================================================================================
kind      what the row is
========  ==================================================================================
half      a half (prepared) message: ``topic`` is its real topic, ``group`` its producer
          group, ``half_offset`` its commit-log offset (the transaction's broker identity).
          The first op record of a half in the same segment is folded into the half's row
          (``resolution``, and its store time as ``op_ts``) instead of a row of its own
op        an op record: ``half_offset`` names the half, ``resolution`` is COMMIT, ROLLBACK,
          PARKED or RECHECKED (the last one for a half wins); ``group``, ``msg_id``, ``topic`` and
          ``transaction_id`` are the half's, from the op record's body
message   a message in a user topic: plain sends, the outbox relay's, and the commit copies
          of transactional messages (those with ``transaction_id`` and ``half_offset`` set)
retry     a copy in ``%RETRY%<group>``: ``group`` is the consumer group, ``msg_id`` the
          original message id, ``topic`` the original topic
dlq       a copy in ``%DLQ%<group>``, the same columns as ``retry``
========  ==================================================================================

``key`` is a message's first key, else its id (the event a consumer deduplicates on);
``nkeys`` how many keys it has.  ``queue_id`` and ``queue_offset`` place a ``message``,
``retry`` or ``dlq`` row in the queue it is stored in (a retry copy's in ``%RETRY%<group>``,
a dead letter's in ``%DLQ%<group>``): a consumer group's committed offset for that queue
passed it or not (null for halves and op records).  An export holds a row group per kind,
so a reader that wants some kinds skips the others by the row groups' statistics.
Schedule copies and parked copies (their op record says PARKED) are skipped.  A torn tail of
the newest segment is a write in progress and is left for the next run; damage anywhere else
is :class:`StoreUnreadable`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import struct
import sys
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack

from txmq.broker.store.commitlog import segment_paths
from txmq.broker.store.exporting import EXPORT_DIR, export_file
from txmq.protocol.codec import BLANK_MAGIC, HEADER, MESSAGE_MAGIC, PREFIX
from txmq.protocol.message import (
    HALF_TOPIC,
    OP_TOPIC,
    Prop,
    SysFlag,
    dlq_topic,
    is_system_topic,
    retry_topic,
)

try:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.compute as pc  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]
except ImportError:  # the broker runs without it; only the export and Spark need it
    pa = pc = pq = None

__all__ = [
    "EXPORT_DIR",
    "FIELDS",
    "StoreUnreadable",
    "arrow_schema",
    "available",
    "export_path",
    "export_segment",
    "export_store",
    "scan_segment",
    "segment_files",
    "valid_export",
]

log = logging.getLogger("txmq.broker.store")

#: bumped when the rows change; an export of another version is ignored (the job decodes
#: its segment instead) and redone by the broker's next export (4: queue_id, queue_offset)
VERSION = "4"
#: (name, type) of each row column; types are Arrow type names
FIELDS = (
    ("kind", "string"),
    ("topic", "string"),
    ("group", "string"),
    ("msg_id", "string"),
    ("transaction_id", "string"),
    ("key", "string"),
    ("keys", "string"),
    ("half_offset", "int64"),
    ("resolution", "string"),
    ("store_ts", "int64"),
    ("reconsume_times", "int32"),
    ("nkeys", "int32"),
    ("op_ts", "int64"),
    ("queue_id", "int32"),
    ("queue_offset", "int64"),
)
_RETRY, _DLQ = retry_topic(""), dlq_topic("")
_CHUNK = 8 * 1024 * 1024
_BATCH = 65536
#: halves held back while their op record may still come (the oldest goes out beyond)
_PENDING = 65536
_HALF_OFFSET, _RESOLUTION, _OP_TS = (
    [name for name, _ in FIELDS].index(f) for f in ("half_offset", "resolution", "op_ts")
)
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
#: the fields of an op record's body (the broker writes it compactly, in this order); a body
#: that does not match (escaped characters, an older layout) is parsed as JSON
_OP = re.compile(
    rb'"half_offset":(\d+),.*?"resolution":"([A-Z_]+)","msg_id":"([^"\\]*)",'
    rb'"transaction_id":(?:"([^"\\]*)"|null),"group":"([^"\\]*)","topic":"([^"\\]*)"'
)


class StoreUnreadable(RuntimeError):
    """The store folder is missing, or a sealed segment is damaged."""


def available() -> bool:
    """Whether pyarrow is installed (the export and the Spark job need it)."""
    return pa is not None


def arrow_schema() -> Any:
    return pa.schema([(name, getattr(pa, t)()) for name, t in FIELDS])


def segment_files(root: str | Path) -> list[Path]:
    """The commit-log segment files of the store at ``root``, oldest first."""
    folder = Path(root) / "commitlog"
    if not folder.is_dir():
        raise StoreUnreadable(f"{root} is not a txmq broker store (no commitlog folder)")
    return segment_paths(folder)


def export_path(root: str | Path, segment: str | Path) -> Path:
    return export_file(Path(root), Path(segment))


def _op_row(body: bytes | memoryview, store_ts: int, reconsume: int) -> tuple[Any, ...] | None:
    m = _OP.search(body)
    if m is not None:
        tx = m[4].decode() if m[4] is not None else None
        return (
            "op",
            m[6].decode(),
            m[5].decode(),
            m[3].decode(),
            tx,
            None,
            None,
            int(m[1]),
            m[2].decode(),
            store_ts,
            reconsume,
            None,
            None,
            None,
            None,
        )
    try:
        d = json.loads(bytes(body))
        half, resolution = int(d["half_offset"]), str(d["resolution"])
    except (ValueError, KeyError, TypeError):
        return None  # not an op record the job can use
    return (
        "op",
        d.get("topic"),
        d.get("group"),
        d.get("msg_id"),
        d.get("transaction_id"),
        None,
        None,
        half,
        resolution,
        store_ts,
        reconsume,
        None,
        None,
        None,
        None,
    )


def scan_segment(path: str | Path, last: bool, since_ms: int = 0) -> Iterator[Any]:
    """The rows of one segment file, as Arrow record batches (see the module docstring).

    ``last``: the segment is the newest one, so a torn tail is a write in progress.  The
    loop is the hot path: rows are kept as tuples and turned into columns once per batch.
    """
    schema = arrow_schema()
    rows: list[tuple[Any, ...]] = []
    append = rows.append
    pending: dict[int, list[Any]] = {}  # half offset -> its row, until its op record comes
    header = HEADER.unpack_from
    crc32 = zlib.crc32
    unpack = msgpack.unpackb
    commit_type = SysFlag.TRANSACTION_COMMIT_TYPE
    mask = SysFlag.TRANSACTION_MASK
    uniq, keys_p, tx_p = Prop.UNIQ_KEY, Prop.KEYS, Prop.TRANSACTION_ID
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        off = 0  # position in the file of buf[0]
        buf = f.read(_CHUNK)
        view = memoryview(buf)
        pos = 0
        while off + pos < size:
            avail = len(buf) - pos
            total, magic = PREFIX.unpack_from(buf, pos) if avail >= PREFIX.size else (0, 0)
            if magic == BLANK_MAGIC:
                break  # the filler at a sealed segment's end
            if avail < HEADER.size or avail < total:  # refill: keep the partial record
                more = f.read(max(_CHUNK, total))
                if not more:
                    if last:
                        break  # a write in progress (or torn by a crash)
                    raise StoreUnreadable(f"{path}: partial record at {off + pos}")
                buf = buf[pos:] + more
                view = memoryview(buf)
                off += pos
                pos = 0
                continue
            h = header(buf, pos)
            if (
                magic != MESSAGE_MAGIC
                or total < HEADER.size + 6
                or crc32(view[pos + 12 : pos + total]) != h[2]
            ):
                if last:
                    break  # a write in progress (or torn by a crash): the broker's to repair
                why = f"bad magic {magic:#010x}" if magic != MESSAGE_MAGIC else "CRC mismatch"
                raise StoreUnreadable(f"{path}: record at {off + pos}: {why}")
            at = pos
            pos += total
            store_ts = h[9]
            if store_ts < since_ms:
                continue
            body_at = at + HEADER.size
            p = body_at + h[12]
            (tlen,) = _U16.unpack_from(buf, p)
            topic = buf[p + 2 : p + 2 + tlen].decode()
            if topic == OP_TOPIC:
                row = _op_row(view[body_at:p], store_ts, h[10])
                if row is not None:
                    half = pending.pop(row[_HALF_OFFSET], None)
                    if half is None:  # its half is elsewhere, or already has an op record
                        append(row)
                    else:
                        half[_RESOLUTION], half[_OP_TS] = row[_RESOLUTION], store_ts
                        append(tuple(half))
                continue
            q = p + 2 + tlen
            (plen,) = _U32.unpack_from(buf, q)
            props: dict[str, str] = unpack(buf[q + 4 : q + 4 + plen]) if plen else {}
            mid = props.get(uniq)
            keys = props.get(keys_p)
            nkeys = keys.count(" ") + 1 if keys else 0
            if topic == HALF_TOPIC:
                pending[h[6]] = [
                    "half",
                    props.get(Prop.REAL_TOPIC, ""),
                    props.get(Prop.PRODUCER_GROUP),
                    mid,
                    props.get(tx_p),
                    keys.split(" ", 1)[0] if keys else mid,
                    keys,
                    h[6],
                    None,
                    store_ts,
                    h[10],
                    nkeys,
                    None,
                    None,
                    None,
                ]
                if len(pending) > _PENDING:
                    append(tuple(pending.pop(next(iter(pending)))))
            elif topic.startswith(_RETRY) or topic.startswith(_DLQ):
                is_retry = topic.startswith(_RETRY)
                kind, group = (
                    ("retry", topic[len(_RETRY) :]) if is_retry else ("dlq", topic[len(_DLQ) :])
                )
                origin = props.get(Prop.ORIGIN_MESSAGE_ID) or mid
                append(
                    (
                        kind,
                        props.get(Prop.RETRY_TOPIC, ""),
                        group,
                        origin,
                        None,
                        keys.split(" ", 1)[0] if keys else origin,
                        keys,
                        None,
                        None,
                        store_ts,
                        h[10],
                        nkeys,
                        None,
                        h[3],
                        h[5],
                    )
                )
            elif not is_system_topic(topic):  # schedule and parked copies are skipped
                commit = h[7] & mask == commit_type
                append(
                    (
                        "message",
                        topic,
                        None,
                        mid,
                        props.get(tx_p) if commit else None,
                        keys.split(" ", 1)[0] if keys else mid,
                        keys,
                        h[11] if commit else None,
                        None,
                        store_ts,
                        h[10],
                        nkeys,
                        None,
                        h[3],
                        h[5],
                    )
                )
            if len(rows) >= _BATCH:
                yield _batch(rows, schema)
                rows.clear()
    rows += [tuple(half) for half in pending.values()]  # never resolved in this segment
    if rows:
        yield _batch(rows, schema)


def _batch(rows: list[tuple[Any, ...]], schema: Any) -> Any:
    columns = list(zip(*rows, strict=True))
    return pa.RecordBatch.from_arrays(
        [pa.array(c, type=t) for c, t in zip(columns, schema.types, strict=True)],
        schema=schema,
    )


def _metadata(segment: Path) -> dict[bytes, bytes]:
    return {
        b"txmq.export": VERSION.encode(),
        b"txmq.segment_bytes": str(segment.stat().st_size).encode(),
    }


def valid_export(root: str | Path, segment: str | Path) -> Path | None:
    """The export of ``segment`` if there is one made from it as it is now, by this version."""
    path = export_path(root, segment)
    try:
        meta = pq.read_schema(path).metadata or {}
        ok = meta == {**meta, **_metadata(Path(segment))}
    except (OSError, pa.ArrowException):
        return None
    return path if ok else None


def export_segment(segment: str | Path, dest: str | Path) -> int:
    """Write the rows of the sealed ``segment`` to the Parquet file ``dest`` (atomically);
    the number of rows."""
    segment, dest = Path(segment), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    schema = arrow_schema().with_metadata(_metadata(segment))
    table = pa.Table.from_batches(list(scan_segment(segment, last=False)), arrow_schema())
    with pq.ParquetWriter(tmp, schema, compression="zstd") as w:
        # a row group per kind (in the segment's order within it): a reader that wants some
        # kinds skips the other row groups by their statistics
        for kind in sorted(set(table.column("kind").unique().to_pylist())):
            part = table.filter(pc.equal(table.column("kind"), kind))
            w.write_table(part.replace_schema_metadata(schema.metadata))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    return int(table.num_rows)


def export_store(root: str | Path) -> list[Path]:
    """Export every sealed segment of the store at ``root`` that has no valid export yet and
    remove the exports (and leftovers) of segments that are gone; the files written."""
    files = segment_files(root)
    written = []
    for seg in files[:-1]:  # the newest segment is still being written
        if valid_export(root, seg) is None:
            dest = export_path(root, seg)
            n = export_segment(seg, dest)
            log.info("exported %s: %d rows", seg.name, n)
            written.append(dest)
    keep = {export_path(root, seg).name for seg in files}
    folder = Path(root) / EXPORT_DIR
    if folder.is_dir():
        for p in folder.iterdir():
            if p.name not in keep:
                p.unlink(missing_ok=True)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m broker.store.export",
        description="Export the sealed commit-log segments of a txmq store as Parquet.",
    )
    p.add_argument("store", help="the broker's store folder")
    args = p.parse_args(argv)
    if not available():
        print("the export needs pyarrow: pip install 'txmq[spark]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        written = export_store(args.store)
    except (StoreUnreadable, OSError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 1
    print(f"exported {len(written)} segments of {args.store}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
