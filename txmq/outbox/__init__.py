"""The transactional outbox: add messages in your database transaction; a relay sends
them to the broker, at least once and in order per sharding key.

::

    from txmq.outbox import OutboxRelay, add, add_async

    with Session(engine) as session, session.begin():
        session.add(Order(id=order_id, amount=42))
        add(session, Message("orders", body, keys=[f"order-{order_id}"]), sharding_key=order_id)

    async with OutboxRelay(database_url, broker_address) as relay:
        ...

Or run ``txmq outbox relay --db URL --broker HOST:PORT``; blocking applications embed
``outbox.sync.OutboxRelay``. The table, ``txmq_outbox``, is
created by ``txmq db upgrade`` (revision 0002).
"""

from txmq.outbox import sync
from txmq.outbox.claim import Outcome, Row
from txmq.outbox.relay import OUTAGE_ERRORS, OutboxNotReady, OutboxRelay
from txmq.outbox.store import (
    CHANNEL,
    OutboxStats,
    add,
    add_async,
    add_many,
    add_many_async,
    cleanup,
    parked,
    requeue,
    stats,
)
from txmq.sqla.db import async_url
from txmq.sqla.tables import OUTBOX_PARKED, OUTBOX_PENDING, OUTBOX_SENT
from txmq.sqla.tables import outbox as outbox_table

__all__ = [
    "CHANNEL",
    "OUTAGE_ERRORS",
    "OUTBOX_PARKED",
    "OUTBOX_PENDING",
    "OUTBOX_SENT",
    "OutboxNotReady",
    "OutboxRelay",
    "OutboxStats",
    "Outcome",
    "Row",
    "add",
    "add_async",
    "add_many",
    "add_many_async",
    "async_url",
    "cleanup",
    "outbox_table",
    "parked",
    "requeue",
    "stats",
    "sync",
]
