"""The idle culler's record of each server run holding a GPU share (idle since, warning, keeps, the stop it asked),
and the idle time it saw, per server or job run and period (for the reports: the share of held GPU-hours that
were idle).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "accounting_idle_servers",
        sa.Column("run", sa.String(255), nullable=False),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("server", sa.String(255), nullable=False),
        sa.Column("team", sa.String(63), nullable=False),
        sa.Column("profile", sa.String(63), nullable=False),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("last_active_at", sa.BigInteger(), nullable=False),
        sa.Column("seen_at", sa.BigInteger(), nullable=False),
        sa.Column("seen", sa.Text(), nullable=False),
        sa.Column("warned_at", sa.BigInteger(), nullable=True),
        sa.Column("warned_for", sa.BigInteger(), nullable=True),
        sa.Column("keep_until", sa.BigInteger(), nullable=True),
        sa.Column("kept_s", sa.BigInteger(), nullable=False),
        sa.Column("cull_requested_at", sa.BigInteger(), nullable=True),
        sa.Column("cull_reason", sa.Text(), nullable=False),
        sa.CheckConstraint("kept_s >= 0", name=op.f("ck_accounting_idle_servers_kept_not_negative")),
        sa.PrimaryKeyConstraint("run", name=op.f("pk_accounting_idle_servers")),
    )
    op.create_index(op.f("ix_accounting_idle_servers_user"), "accounting_idle_servers", ["user"])
    op.create_index(op.f("ix_accounting_idle_servers_team"), "accounting_idle_servers", ["team"])
    op.create_table(
        "accounting_idle_time",
        sa.Column("run", sa.String(255), nullable=False),
        sa.Column("period", sa.String(7), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("team", sa.String(63), nullable=False),
        sa.Column("model", sa.String(63), nullable=False),
        sa.Column("share_num", sa.Integer(), nullable=False),
        sa.Column("share_den", sa.Integer(), nullable=False),
        sa.Column("idle_s", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("idle_s >= 0", name=op.f("ck_accounting_idle_time_idle_not_negative")),
        sa.CheckConstraint("kind IN ('server', 'job')", name=op.f("ck_accounting_idle_time_kind_known")),
        sa.CheckConstraint("share_num > 0 AND share_den > 0", name=op.f("ck_accounting_idle_time_share_positive")),
        sa.PrimaryKeyConstraint("run", "period", name=op.f("pk_accounting_idle_time")),
    )
    op.create_index(op.f("ix_accounting_idle_time_period"), "accounting_idle_time", ["period"])


def downgrade() -> None:
    op.drop_table("accounting_idle_time")
    op.drop_table("accounting_idle_servers")
