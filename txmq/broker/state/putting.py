"""Storing a message on behalf of a request: the store's refusals as protocol errors; and
where a message waiting in a system topic (a delay level's, the timer's) is delivered."""

from __future__ import annotations

import logging
from typing import Any

from txmq.broker.state.topics import TopicManager
from txmq.broker.store import (
    CQ_TAG_PROPERTY,
    MAX_PROPERTIES_SIZE,
    MessageStore,
    PutResult,
    PutStatus,
)
from txmq.protocol.message import MessageExt, Prop, is_system_topic
from txmq.protocol.wire.errors import BadRequest, BrokerBusy, DiskFull, NotMaster, TxmqError

__all__ = ["WAITING_PROPS", "check_put", "put_or_raise", "real_destination"]

log = logging.getLogger("txmq.broker")

#: what a waiting copy carries and its delivered message does not
WAITING_PROPS = frozenset({Prop.DELAY, Prop.REAL_TOPIC, Prop.REAL_QID, CQ_TAG_PROPERTY})


def real_destination(topics: TopicManager, msg: MessageExt, what: str) -> tuple[str, int] | None:
    """The topic and queue a waiting copy (``what``: "delay level 3", "timer") is delivered
    to, its queue id within the topic's queues now; None (logged) if it names none or its
    topic takes no message any more."""
    props = msg.all_properties
    topic = props.get(Prop.REAL_TOPIC)
    try:
        queue_id = int(props.get(Prop.REAL_QID, ""))
    except ValueError:
        queue_id = -1
    if not topic or queue_id < 0:
        log.warning(
            "%s: message %s at offset %d has no real topic/queue; skipped",
            what,
            msg.msg_id,
            msg.commit_log_offset,
        )
        return None
    try:
        cfg = topics.for_send(topic, allow_system=is_system_topic(topic))
    except TxmqError as exc:
        log.warning("%s: message %s for %s dropped: %s", what, msg.msg_id, topic, exc)
        return None
    return topic, queue_id % cfg.queue_nums


def check_put(r: PutResult) -> PutResult:
    """``r`` if the store took the message, else the error to answer with."""
    if r.status is PutStatus.PUT_OK:
        return r
    if r.status is PutStatus.PROPERTIES_SIZE_EXCEEDED:
        raise BadRequest(f"message properties are over {MAX_PROPERTIES_SIZE} bytes encoded")
    if r.status is PutStatus.DISK_FULL:
        raise DiskFull(r.detail or "the broker's disk is full; try another broker, or later")
    if r.status is PutStatus.NOT_MASTER:
        raise NotMaster("this broker is a slave: send to its broker set's master")
    if r.status is PutStatus.SERVICE_NOT_AVAILABLE:
        raise BrokerBusy("the broker's store is not available (starting or shutting down)")
    raise BadRequest(f"message refused by the store: {r.status.value}")


def put_or_raise(store: MessageStore, **put: Any) -> PutResult:
    """``store.put(**put)``, raising the protocol error for a refused message (a message
    over the size limits raises :class:`txmq.protocol.wire.errors.MessageTooLarge` from the
    store)."""
    return check_put(store.put(**put))
