"""The payment service's accounts and charges.

Revision ID: payment_0001
Revises:
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "payment_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("customer", sa.String(64), primary_key=True),
        sa.Column("initial", sa.Integer(), nullable=False),
        sa.Column("balance", sa.Integer(), nullable=False),
        sa.CheckConstraint("balance >= 0", name="ck_accounts_balance"),
    )
    op.create_table(
        "charges",
        sa.Column("order_id", sa.String(32), primary_key=True),
        sa.Column("customer", sa.String(64), nullable=False),
        sa.Column("amount", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("amount > 0", name="ck_charges_amount"),
        sa.CheckConstraint("state IN ('CHARGED', 'REFUNDED')", name="ck_charges_state"),
    )


def downgrade() -> None:
    op.drop_table("charges")
    op.drop_table("accounts")
