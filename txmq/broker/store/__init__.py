"""The broker's storage engine: commit log, consume queues, key index, checkpoint.

See :class:`MessageStore`; the layout and recovery rules follow Apache RocketMQ's
``DefaultMessageStore`` (the README's broker section says what it keeps and how it
recovers).
"""

from .recovery import CQ_TAG_PROPERTY
from .replica import ReplicaError
from .store import MAX_PROPERTIES_SIZE, MessageStore
from .types import (
    FlushMode,
    GetResult,
    GetStatus,
    PutResult,
    PutStatus,
    RecoveryStats,
    StoreConfig,
    StoreError,
)

__all__ = [
    "CQ_TAG_PROPERTY",
    "MAX_PROPERTIES_SIZE",
    "FlushMode",
    "GetResult",
    "GetStatus",
    "MessageStore",
    "PutResult",
    "PutStatus",
    "RecoveryStats",
    "ReplicaError",
    "StoreConfig",
    "StoreError",
]
