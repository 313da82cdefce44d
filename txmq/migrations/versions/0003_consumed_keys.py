"""txmq_consumed_keys: the dedupe keys of idempotent consumers.

Revision ID: 0003
Revises: 0002
Create Date: 2025-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "txmq_consumed_keys",
        sa.Column("consumer_group", sa.String(255), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.func.now(),
            nullable=False,
        ),
        sa.CheckConstraint("state IN ('consuming', 'done')", name="ck_txmq_consumed_keys_state"),
        sa.PrimaryKeyConstraint("consumer_group", "key", name="pk_txmq_consumed_keys"),
    )
    op.create_index("ix_txmq_consumed_keys_created_at", "txmq_consumed_keys", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_txmq_consumed_keys_created_at", table_name="txmq_consumed_keys")
    op.drop_table("txmq_consumed_keys")
