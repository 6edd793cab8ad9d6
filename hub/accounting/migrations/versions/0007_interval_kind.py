"""What kind of workload held each interval: a user's `server` or a training `job`.

Existing intervals are servers' (jobs did not run before this revision). Reconciliation with the hub's list
of servers closes only server intervals: a job is not in that list and its runner reports it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (both databases): a batch rebuild of the table on SQLite would drop its CHECKs.
    op.add_column("accounting_intervals",
                  sa.Column("kind", sa.String(16), nullable=False, server_default="server"))


def downgrade() -> None:
    with op.batch_alter_table("accounting_intervals") as batch:
        batch.drop_column("kind")
