"""Server runs and queue waits: the run an interval belongs to, and how long its request queued.

`run` names one run of one hub server (`ledger.run_key`); an interval closed by reconciliation and
continued later is several intervals of one run. `queue_wait_s` is how long the request waited in the
pool's queue before it was placed (the first interval of a run only; NULL when nobody measured it).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (both databases): a batch rebuild of the table on SQLite would drop its CHECKs.
    op.add_column("accounting_intervals", sa.Column("run", sa.String(255), nullable=True))
    op.add_column("accounting_intervals", sa.Column("queue_wait_s", sa.BigInteger, nullable=True))
    op.create_index("ix_accounting_intervals_run", "accounting_intervals", ["run"])


def downgrade() -> None:
    op.drop_index("ix_accounting_intervals_run", table_name="accounting_intervals")
    with op.batch_alter_table("accounting_intervals") as batch:
        batch.drop_column("queue_wait_s")
        batch.drop_column("run")
