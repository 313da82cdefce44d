"""Consumer-group offsets kept by the broker (CLUSTERING), persisted every few seconds."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Annotated

import msgspec

from txmq.broker.topics import TopicName
from txmq.jsonfile import load_json, write_json_atomic

__all__ = ["ConsumerOffsetManager", "OffsetsFile"]


NonNegative = Annotated[int, msgspec.Meta(ge=0)]
GroupName = Annotated[str, msgspec.Meta(min_length=1)]


class OffsetsFile(msgspec.Struct):
    """``offsets.json``: group -> topic -> queue id -> offset."""

    offsets: dict[GroupName, dict[TopicName, dict[NonNegative, NonNegative]]] = {}


class ConsumerOffsetManager:
    """Offsets by ``group`` and ``topic`` and queue id, in ``<store>/config/offsets.json``.

    Only what the broker checked is committed (an existing topic, a queue id it has, an
    offset >= 0: :meth:`txmq.broker.pulling.PullService.update_offset`); a damaged file is
    salvaged on start (:func:`txmq.jsonfile.load_json`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._offsets: dict[str, dict[str, dict[int, int]]] = load_json(path, OffsetsFile).offsets
        self._dirty = False

    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        with self._lock:
            self._offsets.setdefault(group, {}).setdefault(topic, {})[queue_id] = offset
            self._dirty = True

    def query(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 if the group never committed one for that queue."""
        return self._offsets.get(group, {}).get(topic, {}).get(queue_id, -1)

    def snapshot(self) -> dict[str, dict[str, dict[int, int]]]:
        with self._lock:
            return {g: {t: dict(q) for t, q in ts.items()} for g, ts in self._offsets.items()}

    def adopt(self, offsets: dict[str, dict[str, dict[int, int]]]) -> None:
        """Take a master's offsets (each one it has replaces ours; ours it lacks stay, as
        RocketMQ's slaves do)."""
        with self._lock:
            for group, topics in offsets.items():
                mine = self._offsets.setdefault(group, {})
                for topic, queues in topics.items():
                    mine.setdefault(topic, {}).update(queues)
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
