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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: where each name lives: imported when first used (SQLAlchemy and alembic are heavy, and
#: ``txmq.sqla.db`` serves commands that need neither)
_HOMES = {
    "SqlTransactionChecker": "checker",
    "TransactionLogListener": "checker",
    "idempotent": "inbox",
    "AsyncLocalTransaction": "local",
    "AsyncTransactionalProducer": "local",
    "LocalTransaction": "local",
    "TransactionalProducer": "local",
    "transaction": "local",
    "VERSION_TABLE": "migrate",
    "alembic_config": "migrate",
    "current": "migrate",
    "downgrade": "migrate",
    "include_name": "migrate",
    "upgrade": "migrate",
    "COMMITTED": "tables",
    "ROLLED_BACK": "tables",
    "metadata": "tables",
    "transaction_log": "tables",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'txmq.sqla' has no attribute {name!r}")
    module = importlib.import_module(f"txmq.sqla.{home}")
    value = getattr(module, "SqlTransactionChecker" if name == "TransactionLogListener" else name)
    globals()[name] = value
    return value
