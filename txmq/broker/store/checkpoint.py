"""The checkpoint: how far the commit log is safely flushed and dispatched.

``offset`` is the commit-log offset below which every record is fsynced and its
consume-queue and index entries are flushed too; ``queues`` is each consume queue's max
offset at that moment, which lets a start detect consume-queue files that were lost or
truncated.  The file is written to a temporary name, fsynced and renamed over the old one;
its CRC guards against anything else.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from .commitlog import fsync_dir

__all__ = ["Checkpoint", "read_checkpoint", "write_checkpoint"]

log = logging.getLogger("txmq.broker.store")

_HEAD = struct.Struct("<4sIII")  # magic, version, payload length, CRC-32 of the payload
_MAGIC = b"TXCK"
_VERSION = 1


@dataclass(frozen=True)
class Checkpoint:
    offset: int
    timestamp: int
    queues: dict[tuple[str, int], int] = field(default_factory=dict)


def write_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    payload = json.dumps(
        {
            "offset": ckpt.offset,
            "timestamp": ckpt.timestamp,
            "queues": [[t, q, m] for (t, q), m in ckpt.queues.items()],
        },
        separators=(",", ":"),
    ).encode()
    data = _HEAD.pack(_MAGIC, _VERSION, len(payload), zlib.crc32(payload)) + payload
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):  # a short write (a full disk) is an error, not a checkpoint
            n = os.write(fd, data[done:])
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            done += n
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)  # the old checkpoint stays
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_checkpoint(path: Path) -> Checkpoint | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        magic, version, length, crc = _HEAD.unpack_from(data)
        payload = data[_HEAD.size : _HEAD.size + length]
        if magic != _MAGIC or version != _VERSION or len(payload) != length:
            raise ValueError("bad header")
        if zlib.crc32(payload) != crc:
            raise ValueError("CRC mismatch")
        doc = json.loads(payload)
        return Checkpoint(
            offset=int(doc["offset"]),
            timestamp=int(doc["timestamp"]),
            queues={(str(t), int(q)): int(m) for t, q, m in doc["queues"]},
        )
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        log.warning(
            "checkpoint %s is unreadable (%s); recovering from the first segment", path, exc
        )
        return None
