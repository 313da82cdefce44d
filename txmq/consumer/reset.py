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

from txmq.consumer.offsets import LocalFileOffsetStore, OffsetStore
from txmq.consumer.pulling import PullMode
from txmq.protocol.message import MessageQueue
from txmq.protocol.wire import ResetConsumerClientOffset
from txmq.protocol.wire.errors import TxmqError

__all__ = ["reset_queues"]

log = logging.getLogger("txmq.consumer")


async def reset_queues(
    mode: PullMode, offsets: OffsetStore, request: ResetConsumerClientOffset
) -> None:
    """Apply a broker's reset of ``request.topic`` to the queues ``mode`` holds, whose
    offsets ``offsets`` keeps."""
    restarted: set[MessageQueue] = set()
    own_offsets = isinstance(offsets, LocalFileOffsetStore)
    async with mode.changes:  # no rebalance starts or stops queues meanwhile
        if mode.stopping:
            return
        for queue_id, offset in sorted(request.offsets.items()):
            mq = MessageQueue(request.topic, request.broker_name, queue_id)
            pq = mode.held.get(mq)
            if pq is None and not own_offsets:
                continue  # its holder resets it; a new holder reads it from the broker
            offsets.reset(mq, offset)
            if pq is not None:
                mode.drop(mq)
                mode.start_queue(mq, offset, (pq.locked, pq.last_lock_time))
                restarted.add(mq)
    if not restarted:
        return
    log.info(
        "%s/%s: offsets of %s reset by broker %s; consuming %s again from %s",
        mode.consumer.group,
        mode.consumer.client_id,
        request.topic,
        request.broker_name,
        ", ".join(str(mq.queue_id) for mq in sorted(restarted)),
        ", ".join(str(request.offsets[mq.queue_id]) for mq in sorted(restarted)),
    )
    try:
        await offsets.persist(restarted)
    except (TxmqError, OSError) as exc:
        log.warning("committing the reset offsets failed (retried every few s): %s", exc)
