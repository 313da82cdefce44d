"""Queue allocation strategies for consumer groups (RocketMQ's AllocateMessageQueue*)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from txmq.protocol.message import MessageQueue

__all__ = ["AllocateStrategy", "MessageQueue", "allocate_averagely", "allocate_by_circle"]

AllocateStrategy = Callable[[str, str, Sequence[MessageQueue], Sequence[str]], list[MessageQueue]]
"""``strategy(group, client_id, queues, client_ids) -> the queues of client_id``.

Every member calls it with the same sorted ``queues`` and ``client_ids`` and must get a
disjoint share, together covering every queue."""


def allocate_averagely(
    group: str, client_id: str, queues: Sequence[MessageQueue], client_ids: Sequence[str]
) -> list[MessageQueue]:
    """Contiguous blocks: 8 queues over 3 consumers -> 3, 3, 2."""
    if client_id not in client_ids or not queues:
        return []
    index = list(client_ids).index(client_id)
    n, c = len(queues), len(client_ids)
    mod = n % c
    if n <= c:
        size = 1
    elif mod > 0 and index < mod:
        size = n // c + 1
    else:
        size = n // c
    start = index * size if mod > 0 and index < mod else index * size + mod
    count = min(size, n - start)
    return [queues[(start + i) % n] for i in range(max(count, 0))]


def allocate_by_circle(
    group: str, client_id: str, queues: Sequence[MessageQueue], client_ids: Sequence[str]
) -> list[MessageQueue]:
    """Round robin: queue i goes to consumer i % consumers."""
    if client_id not in client_ids:
        return []
    index = list(client_ids).index(client_id)
    return [q for i, q in enumerate(queues) if i % len(client_ids) == index]
