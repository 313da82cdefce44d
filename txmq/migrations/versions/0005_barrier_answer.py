"""txmq_saga_barrier.answer: an action's answer, kept to answer a repeat of its command
(participants send their reply after their transaction commits).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("txmq_saga_barrier") as batch:
        batch.add_column(sa.Column("answer", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("txmq_saga_barrier") as batch:
        batch.drop_column("answer")
