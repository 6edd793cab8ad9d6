"""PostgreSQL: a covering index in the order bills group by.

With it a bill reads a month of a million intervals from the index alone, in group order, and adds them
up as they come (an index-only scan into a sorted aggregate) instead of hashing five text columns of
every row. SQLite gets none: its bills run from a table scan and gain nothing from it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

NAME = "ix_accounting_intervals_bill_groups"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_index(NAME, "accounting_intervals", ["team", "user", "model", "profile", "share_den"],
                        postgresql_include=["share_num", "start_at", "end_at"])


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index(NAME, table_name="accounting_intervals")
