"""Training jobs: what to run and where each job stands, and one row per run (attempt) of a job.

A job's runs are its attempts: started by the runner (embedded) or seen started (Kubernetes), each ended by
an event (`restarts.Event`) and followed by what the restart rules decided. Both tables are new: nothing to
carry over, and the downgrade drops them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# As in gpupool.hub.accounting.db when this revision was written (a migration never imports the models).
JOB_STATES = ("queued", "restarting", "running", "suspended", "succeeded", "failed", "cancelled")
JOB_ENDED = ("succeeded", "failed", "cancelled")
RUN_EVENTS = ("succeeded", "failed", "preempted", "node-lost", "platform-restart", "suspended", "cancelled")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def upgrade() -> None:
    op.create_table(
        "accounting_jobs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("submit_key", sa.String(255), nullable=True),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("team", sa.String(63), nullable=False),
        sa.Column("profile", sa.String(63), nullable=False),
        sa.Column("priority", sa.String(8), nullable=False),
        sa.Column("preemptible", sa.Boolean(), nullable=False),
        sa.Column("command", sa.Text(), nullable=False),
        sa.Column("env", sa.Text(), nullable=False),
        sa.Column("workdir", sa.Text(), nullable=True),
        sa.Column("checkpoint_dir", sa.Text(), nullable=True),
        sa.Column("max_restarts", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("submitted_at", sa.BigInteger(), nullable=False),
        sa.Column("queued_at", sa.BigInteger(), nullable=False),
        sa.Column("not_before", sa.BigInteger(), nullable=True),
        sa.Column("ended_at", sa.BigInteger(), nullable=True),
        sa.CheckConstraint(_one_of("state", JOB_STATES), name="ck_accounting_jobs_state_known"),
        sa.CheckConstraint("priority IN ('low', 'normal', 'high')", name="ck_accounting_jobs_priority_known"),
        sa.CheckConstraint("max_restarts >= 0 AND restarts >= 0 AND runs >= 0",
                           name="ck_accounting_jobs_counts_not_negative"),
        sa.CheckConstraint("(ended_at IS NULL) = (" + _one_of("state", JOB_ENDED).replace(" IN ", " NOT IN ") + ")",
                           name="ck_accounting_jobs_ended_iff_final"),
        sa.PrimaryKeyConstraint("id", name="pk_accounting_jobs"),
        sa.UniqueConstraint("submit_key", name="uq_accounting_jobs_submit_key"),
    )
    op.create_index("ix_accounting_jobs_user", "accounting_jobs", ["user"])
    op.create_index("ix_accounting_jobs_team", "accounting_jobs", ["team"])
    op.create_index("ix_accounting_jobs_state", "accounting_jobs", ["state"])
    op.create_table(
        "accounting_job_runs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("ended_at", sa.BigInteger(), nullable=True),
        sa.Column("event", sa.String(16), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("counted", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("pid_started_ms", sa.BigInteger(), nullable=True),
        sa.Column("holding", sa.String(255), nullable=True),
        sa.CheckConstraint("event IS NULL OR " + _one_of("event", RUN_EVENTS), name="ck_accounting_job_runs_event_known"),
        sa.CheckConstraint("(ended_at IS NULL) = (event IS NULL)", name="ck_accounting_job_runs_event_iff_ended"),
        sa.CheckConstraint("ended_at IS NULL OR ended_at >= started_at", name="ck_accounting_job_runs_end_after_start"),
        sa.ForeignKeyConstraint(["job_id"], ["accounting_jobs.id"], ondelete="CASCADE",
                                name="fk_accounting_job_runs_job_id_accounting_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_accounting_job_runs"),
        sa.UniqueConstraint("job_id", "attempt", name="uq_accounting_job_runs_job_id_attempt"),
    )


def downgrade() -> None:
    op.drop_table("accounting_job_runs")
    op.drop_index("ix_accounting_jobs_state", table_name="accounting_jobs")
    op.drop_index("ix_accounting_jobs_team", table_name="accounting_jobs")
    op.drop_index("ix_accounting_jobs_user", table_name="accounting_jobs")
    op.drop_table("accounting_jobs")
