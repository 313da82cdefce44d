"""Topic configuration: name -> number of queues, persisted in ``<store>/config/topics.json``."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from txmq.protocol.message import TOPIC_NAME_PATTERN, is_system_topic, validate_topic_name
from txmq.protocol.wire.errors import (
    BadRequest,
    DiskFull,
    InvalidTopic,
    NoPermission,
    TopicNotFound,
)
from txmq.server.jsonfile import load_json, write_json_atomic

__all__ = [
    "MAX_QUEUE_NUMS",
    "TopicConfig",
    "TopicManager",
    "TopicName",
    "TopicsFile",
    "check_queue_id",
]

MAX_QUEUE_NUMS = 1024

#: a valid topic name (:func:`txmq.protocol.message.validate_topic_name`), for typed files
TopicName = Annotated[str, msgspec.Meta(pattern=TOPIC_NAME_PATTERN)]


@dataclass(frozen=True)
class TopicConfig:
    name: str
    queue_nums: int
    system: bool = False


def check_queue_id(cfg: TopicConfig, queue_id: int) -> None:
    """:class:`BadRequest` unless ``cfg``'s topic has queue ``queue_id``."""
    if not 0 <= queue_id < cfg.queue_nums:
        raise BadRequest(
            f"queue id {queue_id} is out of range for topic {cfg.name!r} ({cfg.queue_nums} queues)"
        )


def has_queue(topics: TopicManager, topic: str, queue_id: int) -> bool:
    """Whether ``topic`` exists and has queue ``queue_id`` (what a committed offset needs)."""
    cfg = topics.get(topic)
    return cfg is not None and 0 <= queue_id < cfg.queue_nums


class TopicEntry(msgspec.Struct):
    name: TopicName
    queue_nums: Annotated[int, msgspec.Meta(ge=1, le=MAX_QUEUE_NUMS)]
    system: bool = False


class TopicsFile(msgspec.Struct):
    """``topics.json``: name -> configuration."""

    topics: dict[TopicName, TopicEntry] = {}


class TopicManager:
    def __init__(self, path: Path, *, auto_create: bool, default_queue_nums: int) -> None:
        self.path = path
        self.auto_create = auto_create
        self.default_queue_nums = default_queue_nums
        self._lock = threading.Lock()
        self._topics: dict[str, TopicConfig] = {
            name: TopicConfig(e.name, e.queue_nums, e.system)
            for name, e in load_json(path, TopicsFile).topics.items()
            if e.name == name
        }
        self.on_change: list[Callable[[TopicConfig], None]] = []
        """Called (on the broker's loop) when a topic is created or its queue count changes:
        its consumers rebalance at once instead of at their next periodic rebalance, and
        the broker registers its topics with its name servers."""
        self.on_delete: list[Callable[[str], None]] = []
        """Called (on the broker's loop) with a topic's name when it is deleted."""

    def _persist(self, name: str, before: TopicConfig | None) -> None:
        """Save the table after topic ``name`` changed from ``before`` (None: it was not
        there); if that fails, undo the change: the table stays what the file says."""
        entries = {n: TopicEntry(c.name, c.queue_nums, c.system) for n, c in self._topics.items()}
        try:
            write_json_atomic(self.path, TopicsFile(entries))
        except OSError as exc:
            if before is None:
                self._topics.pop(name, None)
            else:
                self._topics[name] = before
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(
                    f"the broker's disk is full: topic {name!r} cannot be saved "
                    f"({exc.strerror}); try again once space is freed"
                ) from exc
            raise

    def all(self) -> list[TopicConfig]:
        return sorted(self._topics.values(), key=lambda c: c.name)

    def get(self, name: str) -> TopicConfig | None:
        return self._topics.get(name)

    @staticmethod
    def check_name(name: object, *, allow_system: bool = False) -> str:
        if not isinstance(name, str):
            raise InvalidTopic("topic name is missing or not a string")
        why = validate_topic_name(name)
        if why:
            raise InvalidTopic(why)
        if not allow_system and is_system_topic(name):
            raise NoPermission(f"topic {name!r} is a reserved system topic")
        return name

    def create_or_update(self, name: str, queue_nums: int, *, system: bool = False) -> TopicConfig:
        self.check_name(name, allow_system=system)
        if not isinstance(queue_nums, int) or not 1 <= queue_nums <= MAX_QUEUE_NUMS:
            raise InvalidTopic(f"queue count must be between 1 and {MAX_QUEUE_NUMS}")
        with self._lock:
            cfg = TopicConfig(name, queue_nums, system)
            before = self._topics.get(name)
            changed = before != cfg
            if changed:
                self._topics[name] = cfg
                self._persist(name, before)
        if changed:
            for hook in self.on_change:
                hook(cfg)
        return cfg

    def delete(self, name: str) -> bool:
        with self._lock:
            before = self._topics.pop(name, None)
            if before is None:
                return False
            self._persist(name, before)
        for hook in self.on_delete:
            hook(name)
        return True

    def adopt(self, entries: dict[str, TopicEntry]) -> None:
        """Make the table ``entries`` (a slave copying its master's topics)."""
        with self._lock:
            new = {n: TopicConfig(e.name, e.queue_nums, e.system) for n, e in entries.items()}
            if new == self._topics:
                return
            old, self._topics = self._topics, new
            write_json_atomic(self.path, TopicsFile(dict(entries)))
        for name, cfg in new.items():
            if old.get(name) != cfg:
                for hook in self.on_change:
                    hook(cfg)
        for name in old.keys() - new.keys():
            for delete_hook in self.on_delete:
                delete_hook(name)

    def for_send(
        self, name: str, *, create: bool = True, allow_system: bool = False
    ) -> TopicConfig:
        """The topic a message may be sent to, auto-created if that is switched on."""
        cfg = self._topics.get(name)
        if cfg is not None:
            if cfg.system and not allow_system:
                raise NoPermission(f"topic {name!r} is a reserved system topic")
            return cfg
        self.check_name(name, allow_system=allow_system)
        if not (create and self.auto_create) and not allow_system:
            raise TopicNotFound(f"topic {name!r} does not exist and auto-creation is off")
        return self.create_or_update(name, self.default_queue_nums, system=is_system_topic(name))
