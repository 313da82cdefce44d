"""The message store: RocketMQ's DefaultMessageStore in miniature.

One commit log holds every record; per-queue consume queues and a key index are
dispatched synchronously by ``put`` (so a message is readable the moment ``put``
returns); background threads flush the commit log (ASYNC: periodically, SYNC: group
commit), flush consume queues and index and write the checkpoint, and delete expired
segments; a child process exports each sealed segment as Parquet (``exporting.py``).
``put``/``put_batch`` are serialised by one lock; reads take no lock.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from txmq.protocol.codec import HEADER, PREFIX, encode_record
from txmq.protocol.message import Prop, tag_hash, validate_topic_name
from txmq.protocol.wire.errors import MessageTooLarge

from .checkpoint import Checkpoint, write_checkpoint
from .commitlog import CommitLog, fsync_dir
from .consumequeue import ConsumeQueue
from .damage import DamageLedger
from .disk import DiskFullError, DiskGuard, is_disk_full
from .exporting import SegmentExporter, export_file, pyarrow_installed
from .flush import CommitLogFlusher, PeriodicThread
from .index import IndexService
from .reader import StoreReads
from .recovery import CQ_TAG_PROPERTY, Recovery, index_keys
from .replica import ReplicaWrites
from .types import (
    PutResult,
    PutStatus,
    RecoveryStats,
    StoreConfig,
    StoreError,
)

__all__ = ["MessageStore"]

log = logging.getLogger("txmq.broker.store")

MAX_PROPERTIES_SIZE = 32767  # RocketMQ's limit on the encoded properties
_MAX_QUEUE_ID = 1 << 31
_I64 = 1 << 63
_U16 = struct.Struct("<H")
_NOT_AVAILABLE = PutResult(PutStatus.SERVICE_NOT_AVAILABLE, -1, -1, 0, 0)
_NOT_MASTER = PutResult(PutStatus.NOT_MASTER, -1, -1, 0, 0)
_ILLEGAL = PutResult(PutStatus.MESSAGE_ILLEGAL, -1, -1, 0, 0)
_PROPS_TOO_BIG = PutResult(PutStatus.PROPERTIES_SIZE_EXCEEDED, -1, -1, 0, 0)
_TAGS = Prop.TAGS
_KEYS = Prop.KEYS

# (topic, queue id, body, properties, born ts, sys flag, flag, reconsume times,
#  prepared transaction offset, consume-queue tag code)
_Prepared = tuple[str, int, bytes, dict[str, str], int, int, int, int, int, int]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _encode(p: _Prepared, queue_offset: int, commit_log_offset: int, store_ts: int) -> bytes:
    topic, queue_id, body, props, born, sys_flag, flag, reconsume, prepared, _code = p
    return encode_record(
        topic=topic,
        queue_id=queue_id,
        body=body,
        properties=props,
        queue_offset=queue_offset,
        commit_log_offset=commit_log_offset,
        born_timestamp=born,
        store_timestamp=store_ts,
        sys_flag=sys_flag,
        flag=flag,
        reconsume_times=reconsume,
        prepared_transaction_offset=prepared,
    )


def _index_entries(props: dict[str, str]) -> int:
    """At most how many key-index entries a record with ``props`` adds."""
    keys = props.get(_KEYS)
    return 1 + (keys.count(" ") + 1 if keys else 0)


def _props_size(record: bytes, body_len: int) -> int:
    p = HEADER.size + body_len
    topic_len: int = _U16.unpack_from(record, p)[0]
    return len(record) - p - 2 - topic_len - 4


class MessageStore(StoreReads, ReplicaWrites):
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        root = config.root
        self._root = root
        self._lock = threading.Lock()
        self._ckpt_lock = threading.Lock()
        self._retention_lock = threading.Lock()
        self._cl = CommitLog(root / "commitlog", config.segment_size)
        self._index = IndexService(
            root / "index", config.index_slots, config.index_entries_per_file
        )
        self._cq_root = root / "consumequeue"
        self._cqs: dict[tuple[str, int], ConsumeQueue] = {}
        self._flusher = CommitLogFlusher(self._cl, config.flush_mode, config.flush_interval_ms)
        self._threads: list[PeriodicThread] = []
        self._exporter: SegmentExporter | None = None
        self._running = False
        self._closed = False
        self._lock_fd = -1
        self._tag_cache: dict[str | None, int] = {}
        self._last_ckpt = -1
        self._max_body = config.max_message_size
        #: refuses writes while the disk is full (checked by the broker, and on ENOSPC)
        self.disk = DiskGuard(root, config.disk_max_used_ratio)
        self.last_recovery = RecoveryStats(0, 0, 0, True, 0.0)
        #: what was found damaged (and skipped) since the store opened, recovery included
        self.damage = DamageLedger()
        #: called after each put / put_batch that stored something (replication wakes
        #: its waiting transfers); from whichever thread wrote
        self.on_append: Callable[[], None] | None = None
        #: False on a slave: put and put_batch refuse (NOT_MASTER)
        self.writable = True

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._running or self._closed:
            raise StoreError("a MessageStore can be started once; create a new one")
        root = self._root
        root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise StoreError(
                f"store {root} is in use by another process (a broker already running on "
                "it?): stop that one, or give another --store"
            ) from None
        abort = root / "abort"
        clean = not abort.exists()
        abort.write_text(f"{os.getpid()}\n")
        fsync_dir(root)
        rec = Recovery(
            root,
            self._cl,
            self._index,
            self._cq_root,
            self.config.cq_entries_per_file,
            self._cqs,
            self.damage,
        )
        try:
            self.last_recovery = rec.run(clean)
        except BaseException:
            self._close()
            raise
        if not self.last_recovery.clean or self.last_recovery.truncated_bytes:
            log.info("store recovered: %s", self.last_recovery)
        # what recovery read may have lived only in the page cache of a killed process
        self._flusher.flushed = self.last_recovery.scanned_from
        self._flusher.flush_now()
        self._running = True
        self._checkpoint()
        self._flusher.start(self._flusher.flushed)
        cfg = self.config
        self._threads = [
            PeriodicThread(
                "txmq-store-checkpoint",
                cfg.cq_flush_interval_ms / 1000,
                self._checkpoint,
                quiet=self.disk.absorb,  # a full disk: the old checkpoint stays, one line
            ),
            PeriodicThread(
                "txmq-store-retention", cfg.retention_check_interval_s, self.delete_expired
            ),
        ]
        for t in self._threads:
            t.start()
        if cfg.export_segments:
            if pyarrow_installed():
                self._exporter = SegmentExporter(root, paused=lambda: self.disk.full)
                self._exporter.start()
                self._exporter.request()  # segments sealed before this start
            else:
                log.info("the Parquet export of sealed segments is off: pyarrow is not installed")

    def shutdown(self) -> None:
        with self._lock:
            if not self._running:
                return
            self._running = False
        for t in self._threads:
            t.stop()
        if self._exporter is not None:
            self._exporter.stop()
        self._flusher.stop()
        try:
            self._checkpoint()
        except (OSError, StoreError) as exc:
            if not is_disk_full(exc):
                raise
            log.warning(  # the abort file stays: the next start checks the log's tail
                "the disk is full: no checkpoint at shutdown; the next start recovers "
                "from the previous one"
            )
        else:
            (self._root / "abort").unlink(missing_ok=True)
            fsync_dir(self._root)
        self._close()

    def _close(self) -> None:
        self._closed = True
        for cq in self._cqs.values():
            cq.close()
        self._index.close()
        self._cl.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> MessageStore:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- writing ---------------------------------------------------------------------------

    def _new_tag_code(self, tags: str | None) -> int:
        if len(self._tag_cache) > 65536:
            self._tag_cache.clear()
        code = self._tag_cache[tags] = tag_hash(tags)
        return code

    def _props_and_code(
        self, body: bytes, properties: dict[str, str], cq_tag_code: int | None
    ) -> tuple[dict[str, str], int] | None:
        """Check the body size; the properties to store and the consume-queue tag code."""
        if len(body) > self._max_body:
            raise MessageTooLarge(
                f"message body is {len(body)} bytes, more than max_message_size "
                f"({self._max_body} bytes)"
            )
        tags = properties.get(_TAGS)
        tag_code = self._tag_cache.get(tags)
        if tag_code is None:
            tag_code = self._new_tag_code(tags)
        if cq_tag_code is None:
            if CQ_TAG_PROPERTY in properties:
                properties = {k: v for k, v in properties.items() if k != CQ_TAG_PROPERTY}
            return properties, tag_code
        if not -_I64 <= cq_tag_code < _I64:
            return None
        if cq_tag_code != tag_code or CQ_TAG_PROPERTY in properties:
            properties = {**properties, CQ_TAG_PROPERTY: str(cq_tag_code)}
        return properties, cq_tag_code

    def _prepare(
        self,
        *,
        topic: str,
        queue_id: int,
        body: bytes,
        properties: dict[str, str],
        born_timestamp: int,
        sys_flag: int = 0,
        flag: int = 0,
        reconsume_times: int = 0,
        prepared_transaction_offset: int = 0,
        cq_tag_code: int | None = None,
    ) -> _Prepared | None:
        pc = self._props_and_code(body, properties, cq_tag_code)
        if pc is None:
            return None
        properties, code = pc
        return (
            topic,
            queue_id,
            body,
            properties,
            born_timestamp,
            sys_flag,
            flag,
            reconsume_times,
            prepared_transaction_offset,
            code,
        )

    def _queue_for_put(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        """The queue to append to, created on first use; None for an illegal name/id."""
        cq = self._cqs.get((topic, queue_id))
        if cq is None:
            if (
                validate_topic_name(topic) is not None
                or topic in (".", "..")
                or not isinstance(queue_id, int)
                or not 0 <= queue_id < _MAX_QUEUE_ID
            ):
                return None
            cq = ConsumeQueue(self._cq_root, topic, queue_id, self.config.cq_entries_per_file)
            self._cqs[(topic, queue_id)] = cq
        return cq

    def put(
        self,
        *,
        topic: str,
        queue_id: int,
        body: bytes,
        properties: dict[str, str],
        born_timestamp: int,
        sys_flag: int = 0,
        flag: int = 0,
        reconsume_times: int = 0,
        prepared_transaction_offset: int = 0,
        cq_tag_code: int | None = None,
    ) -> PutResult:
        """Append one message and dispatch it; thread-safe."""
        pc = self._props_and_code(body, properties, cq_tag_code)
        if pc is None:
            return _ILLEGAL
        props, code = pc
        cl = self._cl
        with self._lock:
            if not self._running:
                return _NOT_AVAILABLE
            if not self.writable:
                return _NOT_MASTER
            cq = self._cqs.get((topic, queue_id)) or self._queue_for_put(topic, queue_id)
            if cq is None:
                return _ILLEGAL
            qoff = cq.max_offset
            phy = cl.write_pos
            ts = time.time_ns() // 1_000_000
            p = (
                topic,
                queue_id,
                body,
                props,
                born_timestamp,
                sys_flag,
                flag,
                reconsume_times,
                prepared_transaction_offset,
                code,
            )
            rec = _encode(p, qoff, phy, ts)
            size = len(rec)
            if props and _props_size(rec, len(body)) > MAX_PROPERTIES_SIZE:
                return _PROPS_TOO_BIG
            if self.disk.full:
                return self.disk.refusal()
            try:  # room for the queue and index entries first: then nothing fails after
                cq.reserve(qoff)
                if props:
                    self._index.reserve(_index_entries(props))
                if not cl.fits(size):
                    self._check_size(rec, len(body))
                    cl.roll()
                    self._sealed()
                    phy = cl.write_pos
                    rec = _encode(p, qoff, phy, ts)
                cl.append(rec, ts)
            except (OSError, StoreError) as exc:
                if not is_disk_full(exc):
                    raise
                return self.disk.failed(exc)
            cq.put(qoff, phy, size, code)
            if props:
                self._index_keys(props, phy, ts)
        if self.on_append is not None:
            self.on_append()
        return PutResult(PutStatus.PUT_OK, phy, qoff, ts, size)

    def _index_keys(self, props: dict[str, str], phy: int, ts: int) -> None:
        """Index a stored record; a full disk leaves its keys out (the record is stored and
        in its queue; only a lookup by key misses it)."""
        try:
            index_keys(self._index, props, phy, ts)
        except DiskFullError as exc:
            self.disk.failed(exc)

    def _sealed(self) -> None:
        """A segment was sealed (the commit log rolled): have it exported."""
        if self._exporter is not None:
            self._exporter.request()

    def _check_size(self, record: bytes, body_len: int) -> None:
        if len(record) + PREFIX.size > self._cl.segment_size:
            raise MessageTooLarge(
                f"record of {len(record)} bytes (body {body_len}) does not fit in a "
                f"commit-log segment of {self._cl.segment_size} bytes"
            )

    def put_batch(self, items: list[dict[str, Any]]) -> list[PutResult]:
        """Append several messages under one lock with one write per segment touched."""
        prepared = [self._prepare(**item) for item in items]
        results: list[PutResult | None] = [None] * len(prepared)
        with self._lock:
            if not self._running:
                return [_NOT_AVAILABLE] * len(prepared)
            if not self.writable:
                return [_NOT_MASTER] * len(prepared)
            if self.disk.full:
                return [self.disk.refusal()] * len(prepared)
            try:
                self._put_batch(prepared, results)
            except (OSError, StoreError) as exc:
                if not is_disk_full(exc):
                    raise
                refused = self.disk.failed(exc)  # what was written before stays written
                results = [refused if r is None else r for r in results]
        if self.on_append is not None:
            self.on_append()
        return [_ILLEGAL if r is None else r for r in results]

    def _put_batch(self, prepared: list[_Prepared | None], results: list[PutResult | None]) -> None:
        cl = self._cl
        ts = time.time_ns() // 1_000_000
        bufs: list[bytes] = []
        todo: list[tuple[int, ConsumeQueue, int, int, int, int, dict[str, str]]] = []
        pos = cl.write_pos
        next_off: dict[ConsumeQueue, int] = {}
        keys = 0  # index entries of the records in bufs, reserved before they are written
        for i, p in enumerate(prepared):
            if p is None:
                results[i] = _ILLEGAL
                continue
            topic, qid, body, props, _born, _sf, _fl, _rt, _prep, code = p
            cq = self._queue_for_put(topic, qid)
            if cq is None:
                results[i] = _ILLEGAL
                continue
            qoff = next_off.get(cq, cq.max_offset)
            rec = _encode(p, qoff, pos, ts)
            if props and _props_size(rec, len(body)) > MAX_PROPERTIES_SIZE:
                results[i] = _PROPS_TOO_BIG
                continue
            if not cl.fits(pos - cl.write_pos + len(rec)):
                self._check_size(rec, len(body))
                self._write_batch(bufs, todo, results, ts)
                keys = 0
                cl.roll()
                self._sealed()
                pos = cl.write_pos
                rec = _encode(p, qoff, pos, ts)
            cq.reserve(qoff)
            if props:
                keys += _index_entries(props)
                self._index.reserve(keys)
            bufs.append(rec)
            todo.append((i, cq, qoff, pos, len(rec), code, props))
            next_off[cq] = qoff + 1
            pos += len(rec)
        self._write_batch(bufs, todo, results, ts)

    def _write_batch(
        self,
        bufs: list[bytes],
        todo: list[tuple[int, ConsumeQueue, int, int, int, int, dict[str, str]]],
        results: list[PutResult | None],
        ts: int,
    ) -> None:
        if not bufs:
            return
        self._cl.append(bufs[0] if len(bufs) == 1 else b"".join(bufs), ts)
        for i, cq, qoff, phy, size, code, props in todo:
            cq.put(qoff, phy, size, code)
            if props:
                self._index_keys(props, phy, ts)
            results[i] = PutResult(PutStatus.PUT_OK, phy, qoff, ts, size)
        bufs.clear()
        todo.clear()

    # -- flushing --------------------------------------------------------------------------

    async def wait_flushed(self, end_offset: int) -> None:
        """Return once the commit log is fsynced through ``end_offset`` (group commit)."""
        await self._flusher.wait(end_offset)

    def flush_future(self, end_offset: int) -> asyncio.Future[None] | None:
        """Like :meth:`wait_flushed` without a coroutine: a future, or None if flushed."""
        return self._flusher.future(end_offset)

    def flush_wait(self, end_offset: int, timeout: float | None = None) -> bool:
        """Blocking :meth:`wait_flushed`; False if ``timeout`` passed first."""
        return self._flusher.wait_blocking(end_offset, timeout)

    def _checkpoint(self) -> None:
        """Flush consume queues and index, make sure the log is flushed, write the checkpoint."""
        with self._ckpt_lock:
            with self._lock:
                upto = self._cl.write_pos
                if upto == self._last_ckpt:
                    return
                cqs = list(self._cqs.values())
                queues = {(cq.topic, cq.queue_id): cq.max_offset for cq in cqs}
            for cq in cqs:
                cq.flush()
            self._index.flush()
            if self._flusher.flushed < upto:
                self._flusher.flush_now()
            write_checkpoint(self._root / "checkpoint", Checkpoint(upto, _now_ms(), queues))
            self._last_ckpt = upto

    @property
    def commit_log_min_offset(self) -> int:
        return self._cl.min_offset

    @property
    def commit_log_max_offset(self) -> int:
        return self._cl.write_pos

    @property
    def flushed_offset(self) -> int:
        return self._flusher.flushed

    @property
    def root(self) -> Path:
        return self._root

    @property
    def commit_log(self) -> CommitLog:
        """The commit log itself (for readers that scan it, and for timing its flushes)."""
        return self._cl

    def consume_queue(self, topic: str, queue_id: int) -> ConsumeQueue | None:
        """The consume queue of ``topic``/``queue_id``, if it has one."""
        return self._cqs.get((topic, queue_id))

    # -- retention -------------------------------------------------------------------------

    def delete_expired(self, now_ms: int | None = None) -> int:
        """Delete commit-log segments older than the retention time; return how many."""
        now = _now_ms() if now_ms is None else now_ms
        cutoff = now - int(self.config.retention_hours * 3_600_000)
        with self._retention_lock:
            if self._closed:
                return 0
            victims = self._cl.expired_segments(cutoff)
            if not victims:
                return 0
            # the consume queues' minimums move first, then the commit log's: a reader
            # never sees a queue entry that points below the commit log's minimum
            gone_starts = {seg.start for seg in victims}
            cl_min = min(s.start for s in self._cl.segments() if s.start not in gone_starts)
            for cq in list(self._cqs.values()):
                with self._lock:
                    cq.correct_min(cl_min)
            self._cl.drop_segments(victims, self._lock)
            for seg in victims:  # an export never outlives its segment
                export_file(self._root, seg.path).unlink(missing_ok=True)
            if self._exporter is not None:
                self._exporter.request()  # also removes one a running export just wrote
            gone = 0
            for cq in list(self._cqs.values()):
                with self._lock:
                    files = cq.expired_files(cl_min)
                    cq.forget(files)
                for f in files:
                    f.path.unlink(missing_ok=True)
                gone += len(files)
            with self._lock:
                index_files = self._index.expired_files(cl_min)
                self._index.forget(index_files)
            log.info(
                "retention: deleted %d commit-log segments, %d consume-queue files and "
                "%d index files; commit log now starts at %d",
                len(victims),
                gone,
                len(index_files),
                cl_min,
            )
            return len(victims)
