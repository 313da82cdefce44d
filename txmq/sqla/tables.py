"""The tables txmq owns in an application database (created by ``migrations/``).

``metadata`` holds every one of them; the alembic revisions in ``migrations/`` create
exactly these tables (``tests/migration`` checks that the two never drift apart).
"""

from __future__ import annotations

from sqlalchemy import (
    CheckConstraint,
    Column,
    DateTime,
    Index,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    func,
)

__all__ = [
    "COMMITTED",
    "ROLLED_BACK",
    "TABLE_PREFIX",
    "metadata",
    "transaction_log",
]

TABLE_PREFIX = "txmq_"
"""Every table txmq owns starts with this prefix (and so does its alembic version table)."""

COMMITTED = "COMMITTED"
"""Log state written inside the local transaction: the row exists only if it committed."""
ROLLED_BACK = "ROLLED_BACK"
"""Log state written by a check-back that found no committed row: the id is now dead."""

metadata = MetaData()

transaction_log = Table(
    "txmq_transaction_log",
    metadata,
    Column("transaction_id", String(64)),
    Column("producer_group", String(255), nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("transaction_id", name="pk_txmq_transaction_log"),
    CheckConstraint(
        f"state IN ('{COMMITTED}', '{ROLLED_BACK}')", name="ck_txmq_transaction_log_state"
    ),
    Index("ix_txmq_transaction_log_created_at", "created_at"),
)
"""The local-transaction log.

A ``COMMITTED`` row is inserted in the same database transaction as the business rows, so
it exists exactly when they do. A check-back that finds no row inserts ``ROLLED_BACK``
(waiting first for any transaction still holding that primary key), after which the late
transaction can no longer commit.
"""
