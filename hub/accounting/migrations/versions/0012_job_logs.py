"""Kubernetes mode: jobs' output, kept from their pods' logs before Volcano deletes the pods (`gpupool jobs logs`,
the job's page). The embedded mode keeps writing a file per job.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "accounting_job_logs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("source", sa.String(80), nullable=False),
        sa.Column("start", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("at", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("start >= 0 AND size > 0", name="ck_accounting_job_logs_piece_not_empty"),
        sa.ForeignKeyConstraint(["job_id"], ["accounting_jobs.id"], ondelete="CASCADE",
                                name="fk_accounting_job_logs_job_id_accounting_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_accounting_job_logs"),
        sa.UniqueConstraint("job_id", "start", name="uq_accounting_job_logs_job_id_start"),
    )
    op.create_index("ix_accounting_job_logs_job_id_source", "accounting_job_logs", ["job_id", "source"])


def downgrade() -> None:
    op.drop_table("accounting_job_logs")
