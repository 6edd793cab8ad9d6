"""A job's image: one of its profile's image choices (`gpupool jobs submit --image`), whose environment its runs
start from in the embedded mode (and whose container in the Kubernetes mode). Jobs from before have none: they
run as before, from the servers' environment.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (both databases): a batch rebuild of the table on SQLite would drop its CHECKs.
    op.add_column("accounting_jobs", sa.Column("image", sa.String(63), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("accounting_jobs") as batch:
        batch.drop_column("image")
