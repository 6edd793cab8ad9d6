"""Kubernetes mode: the Volcano restart a job's run is (`status.retryCount` of its Volcano Job when the run
began), so the job watcher tells a new run from the one it follows across restarts of the hub. Runs of the
embedded mode, and runs from before, have none.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (both databases): a batch rebuild of the table on SQLite would drop its CHECKs.
    op.add_column("accounting_job_runs", sa.Column("cluster_retry", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("accounting_job_runs") as batch:
        batch.drop_column("cluster_retry")
