"""An operator's retry or resolve of a parked saga from outside its service (``txmq admin
sagas``, the console): the coordinator's database by URL, its own transaction producer."""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import pool, select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from txmq.client.transaction import TransactionProducer
from txmq.saga.coordinator import Coordinator
from txmq.saga.model import OPERATOR_GROUP
from txmq.sqla.checker import SqlTransactionChecker
from txmq.sqla.db import async_url
from txmq.sqla.tables import sagas

__all__ = ["operate"]


async def operate(
    db: str,
    saga_id: str,
    action: Literal["retry", "resolve"],
    *,
    operator: str,
    reason: str,
    group: str = OPERATOR_GROUP,
    **client: Any,
) -> str:
    """``retry`` (send its failing operation again) or ``resolve`` (it was done by hand: go
    on) the PARKED saga ``saga_id`` in the database ``db``; its state afterwards.
    ``client``: where the broker is (``address=`` or ``namesrv=``, as for a producer).
    LookupError: no such saga; ValueError: it is not parked, or no reason was given."""
    engine = create_async_engine(async_url(db), poolclass=pool.NullPool)
    try:
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        async with sessions() as session:
            q = select(sagas.c.coordinator).where(sagas.c.saga_id == saga_id)
            service = (await session.execute(q)).scalar()
        if service is None:
            raise LookupError(f"no saga {saga_id} in {engine.url.render_as_string()}")
        checker = SqlTransactionChecker(engine)
        async with TransactionProducer(group=group, listener=checker, **client) as producer:
            # the service's name names the topic of the answers to the command it sends:
            # the one the saga's own coordinator takes them from
            coordinator = Coordinator(str(service), producer, sessions)
            act = coordinator.retry if action == "retry" else coordinator.resolve
            await act(saga_id, operator=operator, reason=reason)
            return str(await coordinator.state(saga_id))
    finally:
        await engine.dispose()
