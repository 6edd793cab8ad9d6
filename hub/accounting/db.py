"""The ledger's tables (SQLAlchemy 2 typed declarative), engines for SQLite and PostgreSQL, and migrations.

The schema is owned by the Alembic migrations in `migrations/` (shipped in the package), run in code by
`migrate()`; the models here must match them (a test compares the two). Tables carry an `accounting_`
prefix and Alembic its own version table, so the ledger can share a database with JupyterHub, whose
migrations use the default `alembic_version` table.

Times are stored as whole seconds since the epoch (UTC) in BIGINT columns: both databases then add,
subtract and multiply them exactly in SQL, which is what lets a bill aggregate a million intervals in
one query without floating point (SQLite's own date functions work in floating-point Julian days).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from gpupool.policies.periods import from_epoch_seconds, to_epoch_seconds

MIGRATIONS = Path(__file__).parent / "migrations"
VERSION_TABLE = "accounting_alembic_version"
#: How a closed interval ended. `reconciled`: the ledger closed it itself because its server stopped
#: sending heartbeats (the end is then the last heartbeat). Intervals are never split in the table:
#: periods are cut at query time (see `ledger.py`), so there is no `split`.
HOW_ENDED = ("stopped", "culled", "failed", "preempted", "reconciled")
#: A holding's state: `reserved` from admission until the workload runs (held against quotas, not billed),
#: then `running` (billed). One that ends without having run stays `reserved`.
STATES = ("reserved", "running")
#: SQLite waits this long for another writer before giving up with "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: PostgreSQL only: the bill's group columns, with what it sums included, so that a bill reads the rows in
#: group order from the index alone and aggregates them as they come, instead of hashing five text
#: columns of every row of the period (see `ledger.Ledger._sum`).
BILL_INDEX = "ix_accounting_intervals_bill_groups"
#: Indexes that only PostgreSQL has.
POSTGRESQL_ONLY_INDEXES = (BILL_INDEX,)
#: A fixed key for PostgreSQL's advisory lock that serialises concurrent `migrate()` calls.
MIGRATION_LOCK_KEY = 0x67707570_6F6F6C  # "gpupool"


class UTCSeconds(sa.TypeDecorator[datetime]):
    """A timezone-aware UTC datetime stored as whole seconds since the epoch (rounded down)."""

    impl = sa.BigInteger
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> int | None:
        return None if value is None else to_epoch_seconds(value)

    def process_result_value(self, value: int | None, dialect: sa.Dialect) -> datetime | None:
        return None if value is None else from_epoch_seconds(value)


class Base(DeclarativeBase):
    metadata = sa.MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


class UsageInterval(Base):
    """One holding of a GPU share: from admission (`reserved`) or start (`running`) to its end; `end_at` NULL
    while open."""

    __tablename__ = "accounting_intervals"

    id: Mapped[int] = mapped_column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True)
    #: The caller's idempotency key (e.g. ``alice/:spawn-<uuid>``): writing the same event twice is a no-op.
    key: Mapped[str] = mapped_column(sa.String(255), unique=True)
    user: Mapped[str] = mapped_column(sa.String(255))
    team: Mapped[str] = mapped_column(sa.String(63))
    profile: Mapped[str] = mapped_column(sa.String(63))
    model: Mapped[str] = mapped_column(sa.String(63))
    #: The share of one card, exactly: 1/7 for a 1g MIG slice, 2/1 for two cards.
    share_num: Mapped[int] = mapped_column(sa.Integer)
    share_den: Mapped[int] = mapped_column(sa.Integer)
    start_at: Mapped[datetime] = mapped_column(UTCSeconds)
    end_at: Mapped[datetime | None] = mapped_column(UTCSeconds)
    how: Mapped[str | None] = mapped_column(sa.String(16))
    last_seen_at: Mapped[datetime] = mapped_column(UTCSeconds)
    #: Seconds of use committed at admission: while open, the interval counts against the budget as if
    #: it ran at least this long, so concurrent admissions cannot all spend the same last GPU-hour.
    reserve_s: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    #: The server run this interval belongs to (`ledger.run_key`); NULL for intervals of other writers.
    #: A run closed by reconciliation and continued later is several intervals with one run.
    run: Mapped[str | None] = mapped_column(sa.String(255))
    #: Seconds the request waited in the pool's queue before it was placed (first interval of a run).
    queue_wait_s: Mapped[int | None] = mapped_column(sa.BigInteger)
    #: `reserved` (admitted, not running yet: held, not billed) or `running` (see `STATES`).
    state: Mapped[str] = mapped_column(sa.String(16), default="running", server_default="running")
    #: `server` (a user's server) or `job` (a run of a training job; its run key starts with `job:`).
    kind: Mapped[str] = mapped_column(sa.String(16), default="server", server_default="server")

    __table_args__ = (
        sa.CheckConstraint("share_num > 0 AND share_den > 0", name="share_positive"),
        sa.CheckConstraint("end_at IS NULL OR end_at >= start_at", name="end_after_start"),
        sa.CheckConstraint("(end_at IS NULL) = (how IS NULL)", name="how_iff_ended"),
        sa.CheckConstraint(
            "how IS NULL OR how IN (" + ", ".join(f"'{h}'" for h in HOW_ENDED) + ")", name="how_known"
        ),
        sa.CheckConstraint("reserve_s >= 0", name="reserve_not_negative"),
        # Bills and budgets read one period: intervals overlapping it, by team.
        sa.Index(None, "team", "start_at"),
        sa.Index(None, "start_at"),
        # Open intervals (holdings, reconciliation) are few; find them without a scan.
        sa.Index(None, "end_at"),
        sa.Index(None, "run"),
        sa.Index(BILL_INDEX, "team", "user", "model", "profile", "share_den",
                 postgresql_include=["share_num", "start_at", "end_at", "state"]).ddl_if(dialect="postgresql"),
    )


class AlertRecord(Base):
    """A budget alert that was sent: once per team, period, scope and threshold."""

    __tablename__ = "accounting_alerts"

    id: Mapped[int] = mapped_column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True)
    team: Mapped[str] = mapped_column(sa.String(63))
    period: Mapped[str] = mapped_column(sa.String(7))
    #: The model whose per-model budget crossed the threshold, or "" for the team's budget of all models.
    scope: Mapped[str] = mapped_column(sa.String(63))
    #: The threshold as written in the policy (a decimal fraction of the budget, e.g. "0.8").
    threshold: Mapped[str] = mapped_column(sa.String(16))
    sent_at: Mapped[datetime] = mapped_column(UTCSeconds)

    __table_args__ = (sa.UniqueConstraint("team", "period", "scope", "threshold"),)


class AdmissionLock(Base):
    """One row per team, locked (SELECT … FOR UPDATE) while an admission for that team is decided."""

    __tablename__ = "accounting_admission_locks"

    team: Mapped[str] = mapped_column(sa.String(63), primary_key=True)


#: A training job's state: waiting in the queue (`queued`; `restarting` while its back-off runs), running,
#: held by its user (`suspended`), or ended.
JOB_STATES = ("queued", "restarting", "running", "suspended", "succeeded", "failed", "cancelled")
#: States a job does not leave.
JOB_ENDED = ("succeeded", "failed", "cancelled")
#: How a run of a job ended (`restarts.Event`).
RUN_EVENTS = ("succeeded", "failed", "preempted", "node-lost", "platform-restart", "suspended", "cancelled")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN (" + ", ".join(f"'{v}'" for v in values) + ")"


class Job(Base):
    """A training job: what to run, for whom, under which profile, and where it stands."""

    __tablename__ = "accounting_jobs"

    #: Short and URL-safe (`gpupool jobs show ID`); also the Volcano Job's name suffix.
    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    #: The submitter's idempotency key (`Idempotency-Key`): submitting twice with it makes one job.
    submit_key: Mapped[str | None] = mapped_column(sa.String(255), unique=True)
    user: Mapped[str] = mapped_column(sa.String(255))
    team: Mapped[str] = mapped_column(sa.String(63))
    profile: Mapped[str] = mapped_column(sa.String(63))
    priority: Mapped[str] = mapped_column(sa.String(8))
    preemptible: Mapped[bool] = mapped_column(sa.Boolean)
    #: The command and its arguments, a JSON list of strings; `env`, a JSON object of strings.
    command: Mapped[str] = mapped_column(sa.Text)
    env: Mapped[str] = mapped_column(sa.Text)
    workdir: Mapped[str | None] = mapped_column(sa.Text)
    checkpoint_dir: Mapped[str | None] = mapped_column(sa.Text)
    #: The profile's image choice it runs in (None: the profile offers none); migration 0010.
    image: Mapped[str | None] = mapped_column(sa.String(63))
    max_restarts: Mapped[int] = mapped_column(sa.Integer)
    state: Mapped[str] = mapped_column(sa.String(16))
    #: Why it is in its state, in words (the queue's reason, the restart's cause, the failure).
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    #: Restarts that counted against `max_restarts` (failures of the job's own program).
    restarts: Mapped[int] = mapped_column(sa.Integer, default=0)
    #: Runs started so far (every run is one attempt, whatever ended it).
    runs: Mapped[int] = mapped_column(sa.Integer, default=0)
    exit_code: Mapped[int | None] = mapped_column(sa.Integer)
    #: Its user asked to cancel it while it ran: the runner stops it (SIGTERM, grace, SIGKILL).
    cancel_requested: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    #: Its user asked to suspend it while it ran: the runner stops it, and it waits suspended until resumed.
    suspend_requested: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    submitted_at: Mapped[datetime] = mapped_column(UTCSeconds)
    #: Its place in the queue among jobs of its priority: when it was submitted, kept when it was
    #: preempted (it goes back to the head), now when it restarts after a failure.
    queued_at: Mapped[datetime] = mapped_column(UTCSeconds)
    #: A restarting job waits for its back-off until then.
    not_before: Mapped[datetime | None] = mapped_column(UTCSeconds)
    ended_at: Mapped[datetime | None] = mapped_column(UTCSeconds)

    __table_args__ = (
        sa.CheckConstraint(_one_of("state", JOB_STATES), name="state_known"),
        sa.CheckConstraint("priority IN ('low', 'normal', 'high')", name="priority_known"),
        sa.CheckConstraint("max_restarts >= 0 AND restarts >= 0 AND runs >= 0", name="counts_not_negative"),
        sa.CheckConstraint("(ended_at IS NULL) = (" + _one_of("state", JOB_ENDED).replace(" IN ", " NOT IN ") + ")",
                           name="ended_iff_final"),
        sa.Index(None, "user"),
        sa.Index(None, "team"),
        sa.Index(None, "state"),
    )


class JobRun(Base):
    """One run (attempt) of a job: from its start to its end, with the process it was."""

    __tablename__ = "accounting_job_runs"

    id: Mapped[int] = mapped_column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(sa.String(32), sa.ForeignKey("accounting_jobs.id", ondelete="CASCADE"))
    #: 1 for the first run, then one more for every start.
    attempt: Mapped[int] = mapped_column(sa.Integer)
    started_at: Mapped[datetime] = mapped_column(UTCSeconds)
    ended_at: Mapped[datetime | None] = mapped_column(UTCSeconds)
    event: Mapped[str | None] = mapped_column(sa.String(16))
    exit_code: Mapped[int | None] = mapped_column(sa.Integer)
    #: Whether this run's end counted against `max_restarts`.
    counted: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    #: What happened next, in words (`restarts.Next.reason`).
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    #: The process (embedded mode): its PID and start time (ms since the epoch), which together say whether
    #: a PID seen after a restart of the platform is still this run.
    pid: Mapped[int | None] = mapped_column(sa.Integer)
    pid_started_ms: Mapped[int | None] = mapped_column(sa.BigInteger)
    #: The ledger run of this attempt's holding (`ledger.run_key`).
    holding: Mapped[str | None] = mapped_column(sa.String(255))
    #: Kubernetes mode: Volcano's restart count of the job's Volcano Job when this run began (which pod it is).
    cluster_retry: Mapped[int | None] = mapped_column(sa.Integer)

    __table_args__ = (
        sa.UniqueConstraint("job_id", "attempt"),
        sa.CheckConstraint("event IS NULL OR " + _one_of("event", RUN_EVENTS), name="event_known"),
        sa.CheckConstraint("(ended_at IS NULL) = (event IS NULL)", name="event_iff_ended"),
        sa.CheckConstraint("ended_at IS NULL OR ended_at >= started_at", name="end_after_start"),
    )


class JobLog(Base):
    """Kubernetes mode: a piece of a job's output, read from its pods' logs by the hub's job runner before Volcano
    deletes them (the embedded mode writes a file instead). A job's log is its pieces in `start` order."""

    __tablename__ = "accounting_job_logs"

    id: Mapped[int] = mapped_column(sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True)
    job_id: Mapped[str] = mapped_column(sa.String(32), sa.ForeignKey("accounting_jobs.id", ondelete="CASCADE"))
    #: Where it came from: a pod's uid (so a restarted hub knows how much of that pod's log it has; `UID@SECONDS`
    #: once the kubelet rotated the log: counted from that time on), or `gpupool:`/`gpupool-end:` and the pod's
    #: uid for the lines gpupool writes before and after a pod's output.
    source: Mapped[str] = mapped_column(sa.String(80))
    #: Its first byte's offset in the job's log, and its bytes.
    start: Mapped[int] = mapped_column(sa.BigInteger)
    data: Mapped[bytes] = mapped_column(sa.LargeBinary)
    size: Mapped[int] = mapped_column(sa.Integer)
    #: When it was kept.
    at: Mapped[datetime] = mapped_column(UTCSeconds)

    __table_args__ = (
        sa.UniqueConstraint("job_id", "start"),
        sa.CheckConstraint("start >= 0 AND size > 0", name="piece_not_empty"),
        sa.Index(None, "job_id", "source"),
    )


class IdleServer(Base):
    """The idle culler's record of one server run that holds a GPU share (`idleness.IdleRecord`): since when it
    is idle, its warning, its user's "keep it", and the culler's stop. A stop asked for here makes the run's
    interval end `culled` (`Ledger.close_run`)."""

    __tablename__ = "accounting_idle_servers"

    #: The server run (`ledger.run_key`), as in the run's intervals.
    run: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    user: Mapped[str] = mapped_column(sa.String(255))
    #: The server's name ("" for the default server).
    server: Mapped[str] = mapped_column(sa.String(255))
    team: Mapped[str] = mapped_column(sa.String(63))
    profile: Mapped[str] = mapped_column(sa.String(63))
    started_at: Mapped[datetime] = mapped_column(UTCSeconds)
    last_active_at: Mapped[datetime] = mapped_column(UTCSeconds)
    #: When the culler last looked, and what it saw then (JSON: the signals and the decision, for the pages).
    seen_at: Mapped[datetime] = mapped_column(UTCSeconds)
    seen: Mapped[str] = mapped_column(sa.Text, default="{}")
    warned_at: Mapped[datetime | None] = mapped_column(UTCSeconds)
    #: The stop time the warning announced.
    warned_for: Mapped[datetime | None] = mapped_column(UTCSeconds)
    keep_until: Mapped[datetime | None] = mapped_column(UTCSeconds)
    #: Seconds of postponing granted so far ("keep it", bounded by the rule's `keep_max_hours`).
    kept_s: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    #: When the culler asked the hub to stop it (then its interval ends `culled`), and why in words.
    cull_requested_at: Mapped[datetime | None] = mapped_column(UTCSeconds)
    cull_reason: Mapped[str] = mapped_column(sa.Text, default="")

    __table_args__ = (
        sa.CheckConstraint("kept_s >= 0", name="kept_not_negative"),
        sa.Index(None, "user"),
        sa.Index(None, "team"),
    )


class IdleTime(Base):
    """Seconds a server or job run sat idle in a period (UTC month), as the culler saw it between its looks; with
    the run's share, for the share of held GPU-hours that were idle."""

    __tablename__ = "accounting_idle_time"

    run: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    period: Mapped[str] = mapped_column(sa.String(7), primary_key=True)
    #: `server` (a user's server) or `job` (a run of a training job: looked at for the reports, never culled).
    kind: Mapped[str] = mapped_column(sa.String(16))
    team: Mapped[str] = mapped_column(sa.String(63))
    model: Mapped[str] = mapped_column(sa.String(63))
    share_num: Mapped[int] = mapped_column(sa.Integer)
    share_den: Mapped[int] = mapped_column(sa.Integer)
    idle_s: Mapped[int] = mapped_column(sa.BigInteger, default=0)

    __table_args__ = (
        sa.CheckConstraint("idle_s >= 0", name="idle_not_negative"),
        sa.CheckConstraint("kind IN ('server', 'job')", name="kind_known"),
        sa.CheckConstraint("share_num > 0 AND share_den > 0", name="share_positive"),
        sa.Index(None, "period"),
    )


# --- engines ---------------------------------------------------------------------------------------------

ACCEPTED_URLS = "sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DATABASE"


def create_engine(url: str | sa.URL, **kwargs: Any) -> sa.Engine:
    """An engine for the ledger: SQLite (WAL, foreign keys, busy timeout) or PostgreSQL through psycopg 3.

    A plain ``postgresql://`` URL is taken to mean psycopg 3, the driver gpupool installs.
    """
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        raise ValueError(f"{url!r} is not a database URL (accepted: {ACCEPTED_URLS})") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername not in ("sqlite", "sqlite+pysqlite", "postgresql+psycopg"):
        raise ValueError(
            f"the ledger runs on SQLite or PostgreSQL with psycopg 3, not {parsed.drivername!r} "
            f"(accepted: {ACCEPTED_URLS})"
        )
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            # One in-memory database shared by every connection (each new connection would see an
            # empty one); for tests and experiments, the pool's state lives in a file.
            kwargs.setdefault("poolclass", sa.StaticPool)
            kwargs.setdefault("connect_args", {"check_same_thread": False})
        engine = sa.create_engine(parsed, **kwargs)
        _sqlite_setup(engine)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return sa.create_engine(parsed, **kwargs)


def _sqlite_setup(engine: sa.Engine) -> None:
    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        # pysqlite's own transaction handling would BEGIN lazily and in the wrong mode; we issue BEGIN.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(connection: sa.Connection) -> None:
        # A transaction that reads and then writes must hold the write lock from its start: a deferred
        # one that later upgrades fails with SQLITE_BUSY at once instead of waiting (WAL snapshots).
        mode = connection.get_execution_options().get("sqlite_begin", "DEFERRED")
        connection.exec_driver_sql(f"BEGIN {mode}")


def writer(engine: sa.Engine) -> sa.Engine:
    """The same engine, whose transactions take the write lock at once on SQLite (`BEGIN IMMEDIATE`)."""
    return engine.execution_options(sqlite_begin="IMMEDIATE")


# --- migrations -------------------------------------------------------------------------------------------


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """Alembic's configuration for the ledger, built in code (no alembic.ini to find or ship)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("version_table", VERSION_TABLE)
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(
            connection, opts={"version_table": VERSION_TABLE}
        ).get_current_revision()


def migrate(engine: sa.Engine, revision: str = "head") -> None:
    """Bring the ledger's schema to `revision` (default: the newest); safe to run at every start."""
    with writer(engine).begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        command.upgrade(alembic_config(connection), revision)


def downgrade(engine: sa.Engine, revision: str) -> None:
    with writer(engine).begin() as connection:
        command.downgrade(alembic_config(connection), revision)
