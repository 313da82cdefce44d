"""SQLAlchemy integration: local transactions with transactional messages, the
local-transaction log, its exact check-back, and txmq's table migrations.

::

    from txmq.sqla import SqlTransactionChecker, transaction

    checker = SqlTransactionChecker(engine)
    producer = TransactionProducer(address, group="orders", listener=checker)
    async with transaction(producer, session) as tx:
        session.add(Order(...))
        await tx.send(Message("orders", body, keys=[order_id]), sharding_key=order_id)
"""

from txmq.sqla.checker import SqlTransactionChecker
from txmq.sqla.inbox import idempotent
from txmq.sqla.local import (
    AsyncLocalTransaction,
    AsyncTransactionalProducer,
    LocalTransaction,
    TransactionalProducer,
    transaction,
)
from txmq.sqla.migrate import (
    VERSION_TABLE,
    alembic_config,
    current,
    downgrade,
    include_name,
    upgrade,
)
from txmq.sqla.tables import COMMITTED, ROLLED_BACK, metadata, transaction_log

TransactionLogListener = SqlTransactionChecker
"""The checker is the producer's listener; this name says so."""

__all__ = [
    "COMMITTED",
    "ROLLED_BACK",
    "VERSION_TABLE",
    "AsyncLocalTransaction",
    "AsyncTransactionalProducer",
    "LocalTransaction",
    "SqlTransactionChecker",
    "TransactionLogListener",
    "TransactionalProducer",
    "alembic_config",
    "current",
    "downgrade",
    "idempotent",
    "include_name",
    "metadata",
    "transaction",
    "transaction_log",
    "upgrade",
]
