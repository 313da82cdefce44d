"""The inventory service's stock and reservations tables.

Revision ID: inventory_0001
Revises:
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "inventory_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stock",
        sa.Column("product", sa.String(64), primary_key=True),
        sa.Column("initial", sa.Integer(), nullable=False),
        sa.Column("available", sa.Integer(), nullable=False),
        sa.Column("reserved", sa.Integer(), nullable=False),
        sa.CheckConstraint("available >= 0", name="ck_stock_available"),
        sa.CheckConstraint("reserved >= 0", name="ck_stock_reserved"),
    )
    op.create_table(
        "reservations",
        sa.Column("order_id", sa.String(32), primary_key=True),
        sa.Column("product", sa.String(64), nullable=False),
        sa.Column("quantity", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(255), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint("state IN ('RESERVED', 'REJECTED')", name="ck_reservations_state"),
    )


def downgrade() -> None:
    op.drop_table("reservations")
    op.drop_table("stock")
