"""Reserved holdings: an admitted workload holds its share before it runs, and is billed only once it runs.

`state` is `reserved` from admission (`Ledger.admit`) until the workload runs (`Ledger.keep_run` turns it
`running`, from then on), or ends without running (closed, still `reserved`: never billed). Quotas count
both; bills and reports count `running` only; budgets count a reserved holding at its reservation.
Existing intervals were all opened when their servers ran: `running`. On PostgreSQL the bills' covering
index (0004) takes `state` in too, so that a bill still reads a month from the index alone.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


BILL_INDEX = "ix_accounting_intervals_bill_groups"
GROUPS = ["team", "user", "model", "profile", "share_den"]


def _bill_index(include: list[str]) -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index(BILL_INDEX, table_name="accounting_intervals")
        op.create_index(BILL_INDEX, "accounting_intervals", GROUPS, postgresql_include=include)


def upgrade() -> None:
    # Plain ADD COLUMN (both databases): a batch rebuild of the table on SQLite would drop its CHECKs.
    op.add_column("accounting_intervals",
                  sa.Column("state", sa.String(16), nullable=False, server_default="running"))
    _bill_index(["share_num", "start_at", "end_at", "state"])


def downgrade() -> None:
    # Reserved holdings never ran: they are not usage and would be billed as such without the column.
    op.execute("DELETE FROM accounting_intervals WHERE state = 'reserved'")
    _bill_index(["share_num", "start_at", "end_at"])
    with op.batch_alter_table("accounting_intervals") as batch:
        batch.drop_column("state")
