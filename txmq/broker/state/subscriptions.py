"""Consumer-group configuration (RocketMQ's SubscriptionGroupConfig): whether a group is
FIFO (``consumeMessageOrderly``: the broker hands a queue's messages out one batch at a
time, in order) and how often a failed message is retried before it becomes a dead letter
(``retryMaxTimes``, 16 by default).  Persisted in ``<store>/config/groups.json``.

Groups are created in effect (RocketMQ's ``autoCreateSubscriptionGroup=true``): a group
nobody configured gets the defaults (:meth:`SubscriptionGroupManager.policy`); a config is
stored only once an operator sets one (:meth:`SubscriptionGroupManager.update`).  A
damaged file is salvaged on start (:func:`txmq.server.jsonfile.load_json`): each group whose entry
still fits is kept.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Annotated

import msgspec

from txmq.protocol.wire.base import Name
from txmq.protocol.wire.errors import BadRequest, DiskFull
from txmq.server.jsonfile import load_json, write_json_atomic

__all__ = [
    "DEFAULT_RETRY_MAX_TIMES",
    "MAX_GROUP_NAME",
    "MAX_RETRY_MAX_TIMES",
    "GroupConfig",
    "GroupName",
    "GroupsFile",
    "SubscriptionGroupManager",
    "check_group_name",
    "check_retry_max_times",
]

#: RocketMQ's ``retryMaxTimes`` default
DEFAULT_RETRY_MAX_TIMES = 16
MAX_RETRY_MAX_TIMES = 64
#: the wire protocol's limit for group names (:data:`txmq.protocol.wire.base.Name`)
MAX_GROUP_NAME = 255

#: a consumer group's name, as the wire protocol takes it (1 to 255 characters)
GroupName = Name
RetryMaxTimes = Annotated[int, msgspec.Meta(ge=0, le=MAX_RETRY_MAX_TIMES)]


class GroupConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One consumer group's configuration."""

    #: the broker delivers a queue's messages one batch at a time, in order
    fifo: bool = False
    #: failed deliveries retried before the message goes to ``%DLQ%<group>``
    retry_max_times: RetryMaxTimes = DEFAULT_RETRY_MAX_TIMES


class GroupsFile(msgspec.Struct):
    """``groups.json``: group name -> configuration."""

    groups: dict[GroupName, GroupConfig] = {}


def check_group_name(group: object) -> str:
    """``group`` if it is a valid consumer-group name, else :class:`BadRequest`."""
    if not isinstance(group, str):
        raise BadRequest("consumer group name is missing or not a string")
    if not group:
        raise BadRequest("consumer group name is empty")
    if len(group) > MAX_GROUP_NAME:
        raise BadRequest(
            f"consumer group name is {len(group)} characters long; at most {MAX_GROUP_NAME}"
        )
    return group


def check_retry_max_times(value: object) -> int:
    """``value`` if it is a valid ``retry_max_times`` (0 to 64), else :class:`BadRequest`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"retry_max_times must be a whole number, not {value!r}")
    if not 0 <= value <= MAX_RETRY_MAX_TIMES:
        raise BadRequest(f"retry_max_times must be 0 to {MAX_RETRY_MAX_TIMES} (got {value})")
    return value


class SubscriptionGroupManager:
    """Consumer-group configs by name, in the file ``path`` (None: in memory only, for
    tests and contexts without a store: :meth:`in_memory`)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._groups: dict[str, GroupConfig] = (
            dict(load_json(path, GroupsFile).groups) if path is not None else {}
        )

    @classmethod
    def in_memory(cls) -> SubscriptionGroupManager:
        """A manager that keeps its configs in memory only."""
        return cls(None)

    # -- reading ----------------------------------------------------------------------------

    def get(self, group: str) -> GroupConfig | None:
        """The group's stored config; None if nobody configured it."""
        return self._groups.get(group)

    def policy(self, group: str) -> tuple[bool, int]:
        """(fifo, retry_max_times) of ``group``: the defaults for a group not configured."""
        cfg = self._groups.get(group)
        if cfg is None:
            return False, DEFAULT_RETRY_MAX_TIMES
        return cfg.fifo, cfg.retry_max_times

    def all(self) -> list[tuple[str, GroupConfig]]:
        """Every configured group, by name."""
        return sorted(self._groups.items())

    def snapshot(self) -> dict[str, GroupConfig]:
        """The table now (a master's, for its slaves)."""
        with self._lock:
            return dict(self._groups)

    # -- changing ---------------------------------------------------------------------------

    def update(
        self, group: str, *, fifo: bool | None = None, retry_max_times: int | None = None
    ) -> GroupConfig:
        """Create ``group``'s config (defaults for what is not given) or change what is
        given; saved before it returns."""
        check_group_name(group)
        if fifo is not None and not isinstance(fifo, bool):
            raise BadRequest(f"fifo must be true or false, not {fifo!r}")
        if retry_max_times is not None:
            check_retry_max_times(retry_max_times)
        with self._lock:
            before = self._groups.get(group)
            cfg = before or GroupConfig()
            if fifo is not None:
                cfg = msgspec.structs.replace(cfg, fifo=fifo)
            if retry_max_times is not None:
                cfg = msgspec.structs.replace(cfg, retry_max_times=retry_max_times)
            if cfg != before:
                self._groups[group] = cfg
                self._persist(group, before)
        return cfg

    def delete(self, group: str) -> bool:
        """Forget ``group``'s config (it gets the defaults again); False if it had none."""
        with self._lock:
            before = self._groups.pop(group, None)
            if before is None:
                return False
            self._persist(group, before)
        return True

    def adopt(self, groups: dict[str, GroupConfig]) -> None:
        """Make the table ``groups`` (a slave copying its master's configs)."""
        with self._lock:
            if groups == self._groups:
                return
            self._groups = dict(groups)
            if self.path is not None:
                write_json_atomic(self.path, GroupsFile(dict(groups)))

    def _persist(self, group: str, before: GroupConfig | None) -> None:
        """Save the table after ``group`` changed from ``before`` (None: it was not
        there); if that fails, undo the change: the table stays what the file says."""
        if self.path is None:
            return
        try:
            write_json_atomic(self.path, GroupsFile(dict(self._groups)))
        except OSError as exc:
            if before is None:
                self._groups.pop(group, None)
            else:
                self._groups[group] = before
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(
                    f"the broker's disk is full: consumer group {group!r} cannot be saved "
                    f"({exc.strerror}); try again once space is freed"
                ) from exc
            raise
