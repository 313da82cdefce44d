"""Where a push consumer keeps its offsets: on the broker (CLUSTERING) or in a file
(BROADCASTING, one file per consumer instance and group)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from txmq.allocate import MessageQueue
from txmq.pull import PullConsumer

__all__ = ["LocalFileOffsetStore", "OffsetStore", "RemoteOffsetStore"]


class OffsetStore(Protocol):
    def update(self, mq: MessageQueue, offset: int) -> None: ...
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

    def remove(self, mq: MessageQueue) -> None:
        self.table.pop(mq, None)


class RemoteOffsetStore(_Table):
    """The consumer group's offsets on the broker (the client's group)."""

    def __init__(self, client: PullConsumer) -> None:
        super().__init__()
        self.client = client

    async def read(self, mq: MessageQueue) -> int:
        offset = await self.client.fetch_offset(*mq)
        if offset >= 0:
            self.table[mq] = offset
        return offset

    async def persist(self, mqs: set[MessageQueue]) -> None:
        for mq in mqs:
            offset = self.table.get(mq)
            if offset is not None:
                await self.client.commit_offset(*mq, offset)


class LocalFileOffsetStore(_Table):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raw = {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"offset file {path} is unreadable: {exc}") from None
        for key, offset in raw.get("offsets", {}).items():
            topic, _, qid = key.rpartition("@")
            self.table[(topic, int(qid))] = int(offset)

    async def read(self, mq: MessageQueue) -> int:
        return self.table.get(mq, -1)

    async def persist(self, mqs: set[MessageQueue]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"offsets": {f"{t}@{q}": o for (t, q), o in sorted(self.table.items())}}
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w") as fh:
            json.dump(data, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
