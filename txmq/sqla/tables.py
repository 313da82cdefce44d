"""The tables txmq owns in an application database (created by ``migrations/``).

``metadata`` holds every one of them; the alembic revisions in ``migrations/`` create
exactly these tables (``tests/migration`` checks that the two never drift apart).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

__all__ = [
    "COMMITTED",
    "CONSUMING",
    "DONE",
    "OUTBOX_PARKED",
    "OUTBOX_PENDING",
    "OUTBOX_SENT",
    "ROLLED_BACK",
    "SAGA_STATES",
    "TABLE_PREFIX",
    "consumed_keys",
    "insert_if_absent",
    "inserted",
    "metadata",
    "outbox",
    "saga_barrier",
    "saga_steps",
    "sagas",
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


OUTBOX_PENDING = "pending"
"""An outbox row waiting for the relay (or backing off until ``next_attempt_at``)."""
OUTBOX_SENT = "sent"
"""An outbox row the broker acknowledged; deleted after the relay's retention time."""
OUTBOX_PARKED = "parked"
"""An outbox row that failed ``max_attempts`` times; left for an operator."""

_PENDING_ONLY = text(f"state = '{OUTBOX_PENDING}'")
_BACKING_OFF = text(f"state = '{OUTBOX_PENDING}' AND next_attempt_at IS NOT NULL")

outbox = Table(
    "txmq_outbox",
    metadata,
    # BIGINT on PostgreSQL (an identity-like serial), INTEGER PRIMARY KEY (the rowid) on SQLite
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), autoincrement=True),
    Column("msg_id", String(64), nullable=False),
    Column("topic", String(127), nullable=False),
    Column("sharding_key", String(255), nullable=True),
    Column("tags", String(255), nullable=True),
    Column("keys", Text, nullable=True),
    Column("properties", JSON, nullable=True),
    Column("body", LargeBinary, nullable=False),
    Column("state", String(16), nullable=False, server_default=OUTBOX_PENDING),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("last_error", Text, nullable=True),
    Column("next_attempt_at", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("sent_at", DateTime(timezone=True), nullable=True),
    PrimaryKeyConstraint("id", name="pk_txmq_outbox"),
    CheckConstraint(
        f"state IN ('{OUTBOX_PENDING}', '{OUTBOX_SENT}', '{OUTBOX_PARKED}')",
        name="ck_txmq_outbox_state",
    ),
    # the relay's scans: pending rows in id order, a key's pending rows, the keys backing
    # off — all partial, so sent rows kept for retention cost the relay nothing
    Index(
        "ix_txmq_outbox_pending",
        "id",
        postgresql_where=_PENDING_ONLY,
        sqlite_where=_PENDING_ONLY,
    ),
    Index(
        "ix_txmq_outbox_pending_key",
        "sharding_key",
        "id",
        postgresql_where=_PENDING_ONLY,
        sqlite_where=_PENDING_ONLY,
    ),
    Index(
        "ix_txmq_outbox_backoff",
        "sharding_key",
        postgresql_where=_BACKING_OFF,
        sqlite_where=_BACKING_OFF,
    ),
    Index("ix_txmq_outbox_state_sent_at", "state", "sent_at"),
)
"""The transactional outbox (``outbox.add`` inserts here through your session).

``id`` is the order: a sharding key's rows are sent in ``id`` order, one relay at a time.
``msg_id`` is the message id the broker and consumers see, the same on every re-send.
"""

CONSUMING = "consuming"
"""A consumed-key mark taken before a handler with outside effects runs (mark mode)."""
DONE = "done"
"""A consumed key whose handler finished: the message is never applied again."""

consumed_keys = Table(
    "txmq_consumed_keys",
    metadata,
    Column("consumer_group", String(255), nullable=False),
    Column("key", String(255), nullable=False),
    Column("state", String(16), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("consumer_group", "key", name="pk_txmq_consumed_keys"),
    CheckConstraint(f"state IN ('{CONSUMING}', '{DONE}')", name="ck_txmq_consumed_keys_state"),
    Index("ix_txmq_consumed_keys_created_at", "created_at"),
)
"""The consumed keys (inbox) of idempotent consumers: one row per (group, dedupe key).

Transaction mode inserts ``done`` in the handler's own database transaction; mark mode
inserts ``consuming`` with ``expires_at`` first, then sets ``done`` when the handler ends.
"""

# -- sagas and TCC (txmq.saga) ------------------------------------------------------------

SAGA_STATES = ("RUNNING", "CONFIRMING", "COMPENSATING", "PARKED", "COMPLETED", "COMPENSATED")
"""A saga runs its actions (``RUNNING``; a TCC then its confirms, ``CONFIRMING``), then ends
``COMPLETED``; a refusal or a step out of retries turns it back (``COMPENSATING``) to
``COMPENSATED``; a compensation or confirm out of retries ``PARKED`` it for an operator
(retry, or resolve by hand and go on)."""

sagas = Table(
    "txmq_sagas",
    metadata,
    Column("saga_id", String(64)),
    Column("name", String(255), nullable=False),
    #: its definition (steps, services, retries) as it started
    Column("definition", JSON, nullable=False),
    #: the coordinating service (its answers come on saga-<coordinator>-replies)
    Column("coordinator", String(64), nullable=False),
    Column("state", String(16), nullable=False),
    #: the step the saga waits on, and which of its operations (action, confirm,
    #: compensation)
    Column("step", Integer, nullable=False),
    Column("op", String(16), nullable=False),
    #: the command it waits an answer to (an answer to any other is stale)
    Column("command_id", String(64), nullable=True),
    #: the saga's data: the payload it started with, updated with each step's result
    Column("data", JSON, nullable=False),
    #: the steps whose actions took effect, in order (what a compensation undoes)
    Column("effected", JSON, nullable=False),
    Column("error", Text, nullable=True),
    #: the awaited action's deadline, and the id of its delayed message (recalled by the
    #: answer)
    Column("deadline_at", DateTime(timezone=True), nullable=True),
    Column("deadline_id", String(64), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("saga_id", name="pk_txmq_sagas"),
    CheckConstraint(
        "state IN (" + ", ".join(f"'{s}'" for s in SAGA_STATES) + ")", name="ck_txmq_sagas_state"
    ),
    Index("ix_txmq_sagas_state_updated_at", "state", "updated_at"),
)
"""The coordinator's sagas, in the database of the service that started them: a row is
inserted, and each of its changes made, in a local transaction with the command it causes."""

saga_steps = Table(
    "txmq_saga_steps",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), autoincrement=True),
    Column("saga_id", String(64), nullable=False),
    Column("step", Integer, nullable=False),
    Column("branch", String(255), nullable=False),
    #: action / compensation, or operator (an operator's retry or resolve)
    Column("op", String(16), nullable=False),
    #: sent, done, refused, failed; retried, resolved (an operator's)
    Column("event", String(16), nullable=False),
    Column("command_id", String(64), nullable=True),
    #: the participant's attempts (1 + its retries) for an answer
    Column("attempts", Integer, nullable=True),
    Column("detail", Text, nullable=True),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("id", name="pk_txmq_saga_steps"),
    Index("ix_txmq_saga_steps_saga_id", "saga_id", "id"),
)
"""The step log of each saga: every command sent, every answer taken, every operator's
action (with who and why), in order."""

saga_barrier = Table(
    "txmq_saga_barrier",
    metadata,
    Column("saga_id", String(64), nullable=False),
    Column("branch", String(255), nullable=False),
    #: the operation the row stands for: action (try in TCC) or compensation (cancel)
    Column("op", String(16), nullable=False),
    #: what inserted it: the operation itself (action, compensation), a compensation that
    #: came first (a "null compensation": the late action is then a no-op), or an action
    #: that was refused or ran out of retries (it had no effect)
    Column("reason", String(16), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    #: an action's answer, sent again to a repeat of its command: {"result": what it
    #: returned} (kept only when it returned something), or {"detail": why it had no effect}
    #: (last: added by revision 0005)
    Column("answer", JSON, nullable=True),
    PrimaryKeyConstraint("saga_id", "branch", "op", name="pk_txmq_saga_barrier"),
    Index("ix_txmq_saga_barrier_created_at", "created_at"),
)
"""The sub-transaction barrier (DTM's) in each participant's database: a row per (saga,
branch, operation), inserted in the same local transaction as the operation's effect."""


def insert_if_absent(table: Table, dialect: str) -> Any:
    """``INSERT … ON CONFLICT (primary key) DO NOTHING`` into ``table`` (PostgreSQL and
    SQLite): the dedupe of idempotent consumers and the saga barrier.  On PostgreSQL it
    returns the row's first key column when it inserted (its driver reports no row count
    for an INSERT); see :func:`inserted`."""
    if dialect not in ("postgresql", "sqlite"):
        raise ValueError(f"txmq's consumers and sagas support postgresql and sqlite, not {dialect}")
    keys = list(table.primary_key.columns)
    ins = pg_insert if dialect == "postgresql" else sqlite_insert
    stmt = ins(table).on_conflict_do_nothing(index_elements=keys)
    return stmt.returning(keys[0]) if dialect == "postgresql" else stmt


def inserted(result: Any) -> bool:
    """Whether an :func:`insert_if_absent` inserted its row."""
    if result.returns_rows:
        return result.first() is not None
    return bool(result.rowcount == 1)
