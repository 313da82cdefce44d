"""Reservations of a saga: RESERVED, then RELEASED when its saga compensates.

Revision ID: inventory_0002
Revises: inventory_0001
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

revision = "inventory_0002"
down_revision = "inventory_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("reservations") as batch:
        batch.drop_constraint("ck_reservations_state", type_="check")
        batch.create_check_constraint(
            "ck_reservations_state", "state IN ('RESERVED', 'RELEASED', 'REJECTED')"
        )


def downgrade() -> None:
    with op.batch_alter_table("reservations") as batch:
        batch.drop_constraint("ck_reservations_state", type_="check")
        batch.create_check_constraint("ck_reservations_state", "state IN ('RESERVED', 'REJECTED')")
