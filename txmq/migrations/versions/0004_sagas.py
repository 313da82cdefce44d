"""txmq_sagas, txmq_saga_steps, txmq_saga_barrier: sagas' coordinator state and step log,
and the participants' sub-transaction barrier.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATES = "'RUNNING', 'CONFIRMING', 'COMPENSATING', 'PARKED', 'COMPLETED', 'COMPENSATED'"


def _created_at(name: str = "created_at") -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "txmq_sagas",
        sa.Column("saga_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("definition", sa.JSON(), nullable=False),
        sa.Column("coordinator", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("op", sa.String(16), nullable=False),
        sa.Column("command_id", sa.String(64), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("effected", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deadline_id", sa.String(64), nullable=True),
        _created_at(),
        _created_at("updated_at"),
        sa.CheckConstraint(f"state IN ({STATES})", name="ck_txmq_sagas_state"),
        sa.PrimaryKeyConstraint("saga_id", name="pk_txmq_sagas"),
    )
    op.create_index("ix_txmq_sagas_state_updated_at", "txmq_sagas", ["state", "updated_at"])
    op.create_table(
        "txmq_saga_steps",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True),
        sa.Column("saga_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("branch", sa.String(255), nullable=False),
        sa.Column("op", sa.String(16), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("command_id", sa.String(64), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        _created_at("at"),
        sa.PrimaryKeyConstraint("id", name="pk_txmq_saga_steps"),
    )
    op.create_index("ix_txmq_saga_steps_saga_id", "txmq_saga_steps", ["saga_id", "id"])
    op.create_table(
        "txmq_saga_barrier",
        sa.Column("saga_id", sa.String(64), nullable=False),
        sa.Column("branch", sa.String(255), nullable=False),
        sa.Column("op", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(16), nullable=False),
        _created_at(),
        sa.PrimaryKeyConstraint("saga_id", "branch", "op", name="pk_txmq_saga_barrier"),
    )
    op.create_index("ix_txmq_saga_barrier_created_at", "txmq_saga_barrier", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_txmq_saga_barrier_created_at", table_name="txmq_saga_barrier")
    op.drop_table("txmq_saga_barrier")
    op.drop_index("ix_txmq_saga_steps_saga_id", table_name="txmq_saga_steps")
    op.drop_table("txmq_saga_steps")
    op.drop_index("ix_txmq_sagas_state_updated_at", table_name="txmq_sagas")
    op.drop_table("txmq_sagas")
