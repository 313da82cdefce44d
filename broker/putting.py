"""Storing a message on behalf of a request: the store's refusals as protocol errors."""

from __future__ import annotations

from typing import Any

from txmq.broker.store import MAX_PROPERTIES_SIZE, MessageStore, PutResult, PutStatus
from txmq.errors import BadRequest, BrokerBusy, DiskFull, NotMaster

__all__ = ["check_put", "put_or_raise"]


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
    over the size limits raises :class:`txmq.errors.MessageTooLarge` from the store)."""
    return check_put(store.put(**put))
