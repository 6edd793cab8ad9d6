"""PostgreSQL: n-distinct statistics over the columns bills group by.

Without them the planner multiplies the columns' distinct counts (team × user × model × profile), expects
about a hundred times more groups than there are, and sorts the whole period on disk instead of hashing
it; with them a month of a million intervals aggregates several times faster. SQLite has no such
statistics and needs none (its GROUP BY does not choose between plans this way).

Revision ID: 0002
Revises: 0001
Create Date: 2026-05-20
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute('CREATE STATISTICS accounting_intervals_bill_groups (ndistinct) '
                   'ON team, "user", model, profile, share_den FROM accounting_intervals')


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP STATISTICS IF EXISTS accounting_intervals_bill_groups")
