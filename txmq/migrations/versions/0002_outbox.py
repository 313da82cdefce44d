"""txmq_outbox: the transactional outbox the relay sends to the broker.

Revision ID: 0002
Revises: 0001
Create Date: 2025-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PENDING_ONLY = sa.text("state = 'pending'")
_BACKING_OFF = sa.text("state = 'pending' AND next_attempt_at IS NOT NULL")


def upgrade() -> None:
    op.create_table(
        "txmq_outbox",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("msg_id", sa.String(64), nullable=False),
        sa.Column("topic", sa.String(127), nullable=False),
        sa.Column("sharding_key", sa.String(255), nullable=True),
        sa.Column("tags", sa.String(255), nullable=True),
        sa.Column("keys", sa.Text(), nullable=True),
        sa.Column("properties", sa.JSON(), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("state", sa.String(16), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.now(),
            nullable=False,
        ),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("state IN ('pending', 'sent', 'parked')", name="ck_txmq_outbox_state"),
        sa.PrimaryKeyConstraint("id", name="pk_txmq_outbox"),
    )
    op.create_index(
        "ix_txmq_outbox_pending",
        "txmq_outbox",
        ["id"],
        postgresql_where=_PENDING_ONLY,
        sqlite_where=_PENDING_ONLY,
    )
    op.create_index(
        "ix_txmq_outbox_pending_key",
        "txmq_outbox",
        ["sharding_key", "id"],
        postgresql_where=_PENDING_ONLY,
        sqlite_where=_PENDING_ONLY,
    )
    op.create_index(
        "ix_txmq_outbox_backoff",
        "txmq_outbox",
        ["sharding_key"],
        postgresql_where=_BACKING_OFF,
        sqlite_where=_BACKING_OFF,
    )
    op.create_index("ix_txmq_outbox_state_sent_at", "txmq_outbox", ["state", "sent_at"])


def downgrade() -> None:
    op.drop_index("ix_txmq_outbox_state_sent_at", table_name="txmq_outbox")
    op.drop_index("ix_txmq_outbox_backoff", table_name="txmq_outbox")
    op.drop_index("ix_txmq_outbox_pending_key", table_name="txmq_outbox")
    op.drop_index("ix_txmq_outbox_pending", table_name="txmq_outbox")
    op.drop_table("txmq_outbox")
