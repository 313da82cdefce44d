"""The epoch history of a replica's commit log: from which offset each master wrote it.

RocketMQ 5's epoch file.  A master elected in epoch E records (E, its log's end) before it
writes; a slave keeps its master's history.  When a replica follows a (new) master, the
newest epoch both histories share tells how much of the replica's log the master also has:
the replica keeps its log up to the end of that epoch on the shorter side and cuts the
rest (bytes only a deposed master wrote, never acknowledged under epoch fencing).
"""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec

from txmq.protocol.wire import EpochEntry
from txmq.server.jsonfile import load_json, write_json_atomic

__all__ = ["FIRST_EPOCH", "EpochLog", "cut_point"]

#: the epoch of a store that never had an election (a master without a controller)
FIRST_EPOCH = 1


class EpochsFile(msgspec.Struct):
    entries: list[EpochEntry] = []


class EpochLog:
    """``<store>/config/epochs.json``: the epochs of this replica's commit log, oldest first."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._entries: list[EpochEntry] = list(load_json(path, EpochsFile).entries)

    @property
    def entries(self) -> list[EpochEntry]:
        """The history; a log written before any election counts as epoch 1 from 0."""
        return list(self._entries) or [EpochEntry(epoch=FIRST_EPOCH, start=0)]

    @property
    def last(self) -> EpochEntry:
        return self.entries[-1]

    def begin(self, epoch: int, start: int) -> None:
        """This replica, now master of ``epoch``, writes from ``start`` on."""
        with self._lock:
            if self._entries and self._entries[-1].epoch >= epoch:
                if self._entries[-1].epoch == epoch:
                    return
                raise ValueError(f"epoch {epoch} is older than {self._entries[-1].epoch}")
            self._entries = [e for e in self._entries if e.start < start or e.start == 0]
            self._entries.append(EpochEntry(epoch=epoch, start=start))
            self._save()

    def follow(self, entries: list[EpochEntry], end: int) -> None:
        """Take the master's history for a log that now ends at ``end`` (or later)."""
        with self._lock:
            if entries == self._entries:
                return
            self._entries = list(entries)
            self._save()

    def _save(self) -> None:
        write_json_atomic(self.path, EpochsFile(entries=self._entries))


def _end_of(entries: list[EpochEntry], i: int, end: int) -> int:
    return entries[i + 1].start if i + 1 < len(entries) else end


def cut_point(
    mine: list[EpochEntry], my_end: int, theirs: list[EpochEntry], their_end: int
) -> int | None:
    """Where a replica whose log (``mine``, ending at ``my_end``) must cut it to follow a
    master with ``theirs`` (ending at ``their_end``); None when it is a prefix already."""
    starts = {e.epoch: (i, e.start) for i, e in enumerate(theirs)}
    for i in range(len(mine) - 1, -1, -1):
        e = mine[i]
        found = starts.get(e.epoch)
        if found is None or found[1] != e.start:
            continue
        j = found[0]
        keep = min(_end_of(mine, i, my_end), _end_of(theirs, j, their_end))
        return keep if keep < my_end else None
    return 0 if my_end > 0 else None
