"""Where a push consumer keeps its offsets: on the broker (CLUSTERING) or in a file
(BROADCASTING, one file per consumer instance and group)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from txmq.consumer.pull import Puller
from txmq.protocol.message import MessageQueue

__all__ = ["LocalFileOffsetStore", "OffsetStore", "RemoteOffsetStore"]


class OffsetStore(Protocol):
    def update(self, mq: MessageQueue, offset: int) -> None: ...
    def reset(self, mq: MessageQueue, offset: int) -> None: ...
    async def read(self, mq: MessageQueue) -> int: ...
    async def persist(self, mqs: set[MessageQueue]) -> None: ...
    def remove(self, mq: MessageQueue) -> None: ...


class _Table:
    def __init__(self) -> None:
        self.table: dict[MessageQueue, int] = {}

    def update(self, mq: MessageQueue, offset: int) -> None:
        """Only forward: an older commit never moves an offset back."""
        if offset > self.table.get(mq, -1):
            self.table[mq] = offset

    def reset(self, mq: MessageQueue, offset: int) -> None:
        """Set the offset, also backwards (an operator's reset)."""
        self.table[mq] = offset

    def remove(self, mq: MessageQueue) -> None:
        self.table.pop(mq, None)


class RemoteOffsetStore(_Table):
    """The consumer group's offsets on the broker (the puller's group)."""

    def __init__(self, puller: Puller) -> None:
        super().__init__()
        self.puller = puller

    async def read(self, mq: MessageQueue) -> int:
        offset = await self.puller.fetch_offset(mq.topic, mq.queue_id, broker_name=mq.broker_name)
        if offset >= 0:
            self.table[mq] = offset
        return offset

    async def persist(self, mqs: set[MessageQueue]) -> None:
        """Commit each queue's offset on the queue's own broker."""
        for mq in mqs:
            offset = self.table.get(mq)
            if offset is not None:
                await self.puller.commit_offset(
                    mq.topic, mq.queue_id, offset, broker_name=mq.broker_name
                )


class LocalFileOffsetStore(_Table):
    """Offsets in a JSON file, keyed ``topic@broker@queue`` (a file written before broker
    sets, keyed ``topic@queue``, is read as the offsets of whichever broker set has the
    queue)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._legacy: dict[tuple[str, int], int] = {}
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raw = {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"offset file {path} is unreadable: {exc}") from None
        for key, offset in raw.get("offsets", {}).items():
            rest, _, qid = key.rpartition("@")
            topic, at, broker = rest.rpartition("@")
            if at:
                self.table[MessageQueue(topic, broker, int(qid))] = int(offset)
            else:
                self._legacy[(rest, int(qid))] = int(offset)

    async def read(self, mq: MessageQueue) -> int:
        offset = self.table.get(mq)
        if offset is None:
            offset = self._legacy.pop((mq.topic, mq.queue_id), -1)
            if offset >= 0:
                self.table[mq] = offset
        return offset

    async def persist(self, mqs: set[MessageQueue]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "offsets": {
                f"{mq.topic}@{mq.broker_name}@{mq.queue_id}": o
                for mq, o in sorted(self.table.items())
            }
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w") as fh:
            json.dump(data, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
