"""txmq_transaction_log: the local-transaction log behind the exact check-back.

Revision ID: 0001
Revises:
Create Date: 2025-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "txmq_transaction_log",
        sa.Column("transaction_id", sa.String(64), nullable=False),
        sa.Column("producer_group", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.now(),
            nullable=False,
        ),
        sa.CheckConstraint(
            "state IN ('COMMITTED', 'ROLLED_BACK')", name="ck_txmq_transaction_log_state"
        ),
        sa.PrimaryKeyConstraint("transaction_id", name="pk_txmq_transaction_log"),
    )
    op.create_index("ix_txmq_transaction_log_created_at", "txmq_transaction_log", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_txmq_transaction_log_created_at", table_name="txmq_transaction_log")
    op.drop_table("txmq_transaction_log")
