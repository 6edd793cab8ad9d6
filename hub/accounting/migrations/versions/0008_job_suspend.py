"""A user's suspend of a running job: the runner stops its run (SIGTERM, grace, SIGKILL) and the job waits,
suspended, until its user resumes it; the suspend never counts against its restarts.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (both databases): a batch rebuild of the table on SQLite would drop its CHECKs.
    op.add_column("accounting_jobs",
                  sa.Column("suspend_requested", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("accounting_jobs") as batch:
        batch.drop_column("suspend_requested")
