"""The ledger: usage intervals, sent budget alerts, per-team admission locks.

Revision ID: 0001
Revises:
Create Date: 2026-05-20
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

HOW_ENDED = ("stopped", "culled", "failed", "preempted", "reconciled")
# Migrations keep their own copy of types and names: later changes to the models must not rewrite history.
ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "accounting_intervals",
        sa.Column("id", ID, primary_key=True),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("team", sa.String(63), nullable=False),
        sa.Column("profile", sa.String(63), nullable=False),
        sa.Column("model", sa.String(63), nullable=False),
        sa.Column("share_num", sa.Integer, nullable=False),
        sa.Column("share_den", sa.Integer, nullable=False),
        sa.Column("start_at", sa.BigInteger, nullable=False),
        sa.Column("end_at", sa.BigInteger, nullable=True),
        sa.Column("how", sa.String(16), nullable=True),
        sa.Column("last_seen_at", sa.BigInteger, nullable=False),
        sa.Column("reserve_s", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_accounting_intervals"),
        sa.UniqueConstraint("key", name="uq_accounting_intervals_key"),
        sa.CheckConstraint("share_num > 0 AND share_den > 0", name="ck_accounting_intervals_share_positive"),
        sa.CheckConstraint("end_at IS NULL OR end_at >= start_at", name="ck_accounting_intervals_end_after_start"),
        sa.CheckConstraint("(end_at IS NULL) = (how IS NULL)", name="ck_accounting_intervals_how_iff_ended"),
        sa.CheckConstraint(
            "how IS NULL OR how IN (" + ", ".join(f"'{h}'" for h in HOW_ENDED) + ")",
            name="ck_accounting_intervals_how_known",
        ),
        sa.CheckConstraint("reserve_s >= 0", name="ck_accounting_intervals_reserve_not_negative"),
    )
    op.create_index("ix_accounting_intervals_team_start_at", "accounting_intervals", ["team", "start_at"])
    op.create_index("ix_accounting_intervals_start_at", "accounting_intervals", ["start_at"])
    op.create_index("ix_accounting_intervals_end_at", "accounting_intervals", ["end_at"])

    op.create_table(
        "accounting_alerts",
        sa.Column("id", ID, primary_key=True),
        sa.Column("team", sa.String(63), nullable=False),
        sa.Column("period", sa.String(7), nullable=False),
        sa.Column("scope", sa.String(63), nullable=False),
        sa.Column("threshold", sa.String(16), nullable=False),
        sa.Column("sent_at", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_accounting_alerts"),
        sa.UniqueConstraint("team", "period", "scope", "threshold",
                            name="uq_accounting_alerts_team_period_scope_threshold"),
    )

    op.create_table(
        "accounting_admission_locks",
        sa.Column("team", sa.String(63), nullable=False),
        sa.PrimaryKeyConstraint("team", name="pk_accounting_admission_locks"),
    )


def downgrade() -> None:
    op.drop_table("accounting_admission_locks")
    op.drop_table("accounting_alerts")
    op.drop_index("ix_accounting_intervals_end_at", table_name="accounting_intervals")
    op.drop_index("ix_accounting_intervals_start_at", table_name="accounting_intervals")
    op.drop_index("ix_accounting_intervals_team_start_at", table_name="accounting_intervals")
    op.drop_table("accounting_intervals")
