"""A push consumer's part of an operator's offset reset (RocketMQ's
RESET_CONSUMER_CLIENT_OFFSET, sent by a broker after ``resetOffsetByTime``).

The broker has already written the new offsets of the topic's queues on it.  For each of
those queues this member holds, the consumer

- drops the queue's process queue: messages pulled but not consumed yet are discarded, the
  pull in flight is cancelled; a listener call already running finishes, but its offset
  commit is ignored (the process queue is marked dropped), so it cannot move the offset
  past the reset;
- sets its offset store to the new offset (also backwards) and pulls from there with a
  new process queue (orderly: the queue lock it holds is kept);
- commits the new offsets at once: a commit of the old offsets sent just before the reset
  arrived is overwritten again.

Queues of the table this member does not hold are left to their holders (a broadcasting
consumer, whose offsets are its own, takes them all into its offset file).  An orderly
queue's listener call still running when the reset arrives may overlap the first message
consumed after it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from txmq.errors import TxmqError
from txmq.offset_store import LocalFileOffsetStore
from txmq.route import MessageQueue
from txmq.wire import ResetConsumerClientOffset

if TYPE_CHECKING:
    from txmq.push import PushConsumer

__all__ = ["reset_queues"]

log = logging.getLogger("txmq.consumer")


async def reset_queues(consumer: PushConsumer, request: ResetConsumerClientOffset) -> None:
    """Apply a broker's reset of ``request.topic`` to the queues ``consumer`` holds."""
    restarted: set[MessageQueue] = set()
    own_offsets = isinstance(consumer.offsets, LocalFileOffsetStore)
    async with consumer._rebalance_lock:  # no rebalance starts or stops queues meanwhile
        if consumer._stopping:
            return
        for queue_id, offset in sorted(request.offsets.items()):
            mq = MessageQueue(request.topic, request.broker_name, queue_id)
            pq = consumer.queues_held.get(mq)
            if pq is None and not own_offsets:
                continue  # its holder resets it; a new holder reads it from the broker
            consumer.offsets.reset(mq, offset)
            if pq is not None:
                consumer._drop(mq)
                consumer._start_queue(mq, offset, (pq.locked, pq.last_lock_time))
                restarted.add(mq)
    if not restarted:
        return
    log.info(
        "%s/%s: offsets of %s reset by broker %s; consuming %s again from %s",
        consumer.group,
        consumer.client_id,
        request.topic,
        request.broker_name,
        ", ".join(str(mq.queue_id) for mq in sorted(restarted)),
        ", ".join(str(request.offsets[mq.queue_id]) for mq in sorted(restarted)),
    )
    try:
        await consumer.offsets.persist(restarted)
    except (TxmqError, OSError) as exc:
        log.warning("committing the reset offsets failed (retried every few s): %s", exc)
