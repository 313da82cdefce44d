"""Orders become sagas: who pays, and how much.

Revision ID: orders_0002
Revises: orders_0001
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "orders_0002"
down_revision = "orders_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("orders") as batch:
        batch.add_column(sa.Column("customer", sa.String(64), nullable=True))
        batch.add_column(sa.Column("amount", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("orders") as batch:
        batch.drop_column("amount")
        batch.drop_column("customer")
