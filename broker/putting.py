"""Storing a message on behalf of a request: the store's refusals as protocol errors."""

from __future__ import annotations

from typing import Any

from txmq.broker.store import MessageStore, MessageTooLarge, PutResult, PutStatus
from txmq.errors import BadRequest, BrokerBusy
from txmq.errors import MessageTooLarge as MessageTooLargeError

__all__ = ["MAX_PROPERTIES_SIZE", "check_put", "put_or_raise"]

MAX_PROPERTIES_SIZE = 32767


def check_put(r: PutResult) -> PutResult:
    """``r`` if the store took the message, else the error to answer with."""
    if r.status is PutStatus.PUT_OK:
        return r
    if r.status is PutStatus.PROPERTIES_SIZE_EXCEEDED:
        raise BadRequest(f"message properties are over {MAX_PROPERTIES_SIZE} bytes encoded")
    if r.status is PutStatus.SERVICE_NOT_AVAILABLE:
        raise BrokerBusy("the broker's store is not available (starting or shutting down)")
    raise BadRequest(f"message refused by the store: {r.status.value}")


def put_or_raise(store: MessageStore, **put: Any) -> PutResult:
    """``store.put(**put)``, raising the protocol error for a refused message."""
    try:
        r = store.put(**put)
    except MessageTooLarge as exc:
        raise MessageTooLargeError(str(exc)) from None
    return check_put(r)
