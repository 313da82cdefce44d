"""Consumer-group offsets kept by the broker (CLUSTERING), persisted every few seconds."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec

from txmq.broker.state.topics import TopicName
from txmq.server.jsonfile import load_json, write_json_atomic

__all__ = ["ConsumerOffsetManager", "OffsetsFile"]


NonNegative = Annotated[int, msgspec.Meta(ge=0)]
GroupName = Annotated[str, msgspec.Meta(min_length=1)]


class OffsetsFile(msgspec.Struct):
    """``offsets.json``: group -> topic -> queue id -> offset (the next offset the group
    consumes: every message below it was consumed, or sent back for a retry).  The
    reconciliation job reads this file (:mod:`txmq.spark.offsets`): keep the two in step."""

    offsets: dict[GroupName, dict[TopicName, dict[NonNegative, NonNegative]]] = {}


class ConsumerOffsetManager:
    """Offsets by ``group`` and ``topic`` and queue id, in ``<store>/config/offsets.json``.

    Only what the broker checked is committed (an existing topic, a queue id it has, an
    offset >= 0: :meth:`txmq.broker.consumption.pulling.PullService.update_offset`); a
    damaged file is salvaged on start (:func:`txmq.server.jsonfile.load_json`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._offsets: dict[str, dict[str, dict[int, int]]] = load_json(path, OffsetsFile).offsets
        self._dirty = False
        #: a slave's: offsets committed here while its master was away, not yet handed
        #: back to a master (group, topic, queue id) -> offset
        self._pending: dict[tuple[str, str, int], int] = {}

    def commit(
        self, group: str, topic: str, queue_id: int, offset: int, *, hand_back: bool = False
    ) -> None:
        """Commit an offset; ``hand_back``: on a slave (its master is away), kept until a
        master has it too."""
        with self._lock:
            self._offsets.setdefault(group, {}).setdefault(topic, {})[queue_id] = offset
            self._dirty = True
            if hand_back:
                self._pending[(group, topic, queue_id)] = offset

    def commit_larger(
        self,
        offsets: dict[str, dict[str, dict[int, int]]],
        valid: Callable[[str, str, int], bool],
    ) -> int:
        """A master takes offsets a slave kept while it was away, where they are further
        than its own and ``valid(group, topic, queue_id)``; returns how many it took."""
        taken = 0
        with self._lock:
            for group, topics in offsets.items():
                for topic, queues in topics.items():
                    for queue_id, offset in queues.items():
                        if not valid(group, topic, queue_id) or offset < 0:
                            continue
                        mine = self._offsets.setdefault(group, {}).setdefault(topic, {})
                        if offset > mine.get(queue_id, -1):
                            mine[queue_id] = offset
                            taken += 1
            self._dirty = self._dirty or taken > 0
        return taken

    def drop_pending(self, valid: Callable[[str, str, int], bool]) -> None:
        """Forget what is no longer ``valid(group, topic, queue_id)`` (its topic deleted or
        shrunk on the master meanwhile): the master would not take it back."""
        with self._lock:
            for key in [k for k in self._pending if not valid(*k)]:
                del self._pending[key]

    def pending(self) -> dict[str, dict[str, dict[int, int]]]:
        """The offsets this slave still has to hand back to a master."""
        out: dict[str, dict[str, dict[int, int]]] = {}
        with self._lock:
            for (group, topic, queue_id), offset in self._pending.items():
                out.setdefault(group, {}).setdefault(topic, {})[queue_id] = offset
        return out

    def query(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 if the group never committed one for that queue."""
        return self._offsets.get(group, {}).get(topic, {}).get(queue_id, -1)

    def snapshot(self) -> dict[str, dict[str, dict[int, int]]]:
        with self._lock:
            return {g: {t: dict(q) for t, q in ts.items()} for g, ts in self._offsets.items()}

    def adopt(self, offsets: dict[str, dict[str, dict[int, int]]]) -> None:
        """Take a master's offsets (each one it has replaces ours; ours it lacks stay, as
        RocketMQ's slaves do) — but not where this slave keeps one committed while the
        master was away and the master is not as far yet (it gets it handed back)."""
        with self._lock:
            pending = self._pending
            for group, topics in offsets.items():
                mine = self._offsets.setdefault(group, {})
                for topic, queues in topics.items():
                    kept = mine.setdefault(topic, {})
                    for queue_id, offset in queues.items():
                        key = (group, topic, queue_id)
                        if key in pending:
                            if offset < pending[key]:
                                continue
                            del pending[key]  # the master has it now
                        kept[queue_id] = offset
            self._dirty = True

    def remove_topic(self, topic: str) -> None:
        with self._lock:
            for topics in self._offsets.values():
                if topics.pop(topic, None) is not None:
                    self._dirty = True

    def persist(self, force: bool = False) -> None:
        with self._lock:
            if not (self._dirty or force):
                return
            data = OffsetsFile(
                {g: {t: dict(qs) for t, qs in ts.items()} for g, ts in self._offsets.items()}
            )
            self._dirty = False
        try:
            write_json_atomic(self.path, data)
        except BaseException:
            self._dirty = True  # the file keeps the older offsets: write again next time
            raise
