"""The usage ledger: every interval a user's team held a GPU share, written idempotently, summed exactly.

Writes are keyed by the caller's idempotency key: opening or closing the same interval twice changes
nothing, and each write is one transaction (`INSERT … ON CONFLICT DO NOTHING` on SQLite and PostgreSQL,
conditional `UPDATE`s), so concurrent writers — two hub processes, a retried event — never leave a
half-written or duplicated record.

Periods are cut at **query time**, not at write time. An interval is stored once, as it happened; every
sum clips it to the period asked for (`[max(start, period start), min(end or now, period end))`). This
keeps each event a single idempotent write (an interval open across a month boundary needs no
"split" bookkeeping that a repeated or late close would have to undo), an open interval is counted
up to "now" in the current period without being rewritten, and the clipping is exactly
`periods.split_by_month` done in SQL (the tests check one against the other).

Sums are exact: times are whole seconds, shares a numerator and denominator, and SQL adds
`seconds × numerator` per denominator in integers; the result becomes a `Fraction` of GPU-hours.

`admit()` is the door every workload comes through: it decides (with the pure `admission.decide`) and
records the holding in one transaction holding the team's admission lock (`BEGIN IMMEDIATE` on SQLite,
`SELECT … FOR UPDATE` on the team's lock row on PostgreSQL), so concurrent requests for the last share or
the last GPU-hour cannot all be admitted. The holding is `reserved`: it counts against the quotas (and
against budgets at its reservation) but is not billed; `keep_run` turns it `running` when the workload runs,
and from then on it is billed. One that ends without running (a failed start, a cancelled wait) stays
`reserved` and never costs anything. The Kubernetes spawner admits through it (a pod admitted by gpupool and
waiting in Volcano's queue is held, not billed); the embedded pool decides against its cards and records the
holding it placed through `reserve()`, under the same rules.

Decisions that arrive together share one transaction (**group commit**): the first caller to find the door free
leads, takes every request waiting (up to `MAX_BATCH`), locks their teams (in name order, so two processes never
deadlock), decides them one after another in arrival order — each seeing the holdings and usage the ones before it
left — commits once and wakes each caller with its own answer; whoever arrived meanwhile is led by the next
leader. One fsync'd commit per batch instead of one per decision; the answers are the ones deciding the same
requests one at a time, in that order, would give (tests/unit/accounting/test_admission_group_commit.py checks
it on both databases). A batch that fails (a request with bad facts, a database error) is rolled back whole and
its requests decided again one per transaction, so each caller gets the answer or the error it would have had
alone.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from fractions import Fraction
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from gpupool.hub.accounting import db
from gpupool.policies import periods
from gpupool.policies.admission import (
    Alert,
    AdmissionRequest,
    Decision,
    Holdings,
    Reason,
    Resolved,
    Usage,
    decide,
    resolve,
)
from gpupool.policies.model import Policy

INTERVALS = db.UsageInterval.__table__
IDLE_SERVERS = db.IdleServer.__table__
ALERTS = db.AlertRecord.__table__
LOCKS = db.AdmissionLock.__table__
#: What sums can be grouped by.
GROUPINGS = ("team", "user", "model", "profile")
#: Shares are stored as 32-bit numerator and denominator (both databases' INTEGER).
MAX_SHARE_TERM = 2**31 - 1


class HowEnded(StrEnum):
    """How an interval ended (see `db.HOW_ENDED`)."""

    STOPPED = "stopped"  # the user or an admin stopped the server, or the job finished
    CULLED = "culled"  # the idle culler stopped it
    FAILED = "failed"  # the spawn failed or the server died
    PREEMPTED = "preempted"  # evicted for higher-priority work (deprioritized or preemptible profiles)
    RECONCILED = "reconciled"  # the ledger closed it at its last heartbeat: nobody reported its end


assert tuple(HowEnded) == db.HOW_ENDED


class State(StrEnum):
    """A holding's state (see `db.STATES`)."""

    RESERVED = "reserved"  # admitted, not running yet: held against quotas, not billed
    RUNNING = "running"  # running: billed


assert tuple(State) == db.STATES


class OpenResult(StrEnum):
    OPENED = "opened"
    EXISTS = "exists"  # the same interval was opened before: nothing changed


class RunResult(StrEnum):
    """What `Ledger.keep_run` did for a server that is running."""

    OPENED = "opened"  # the run's first interval (or its reserved holding, which now runs)
    CONTINUED = "continued"  # a new interval from where reconciliation had closed the last one
    RUNNING = "running"  # its interval is open: noted as seen
    ENDED = "ended"  # the run was stopped (not merely reconciled): nothing changed


class CloseResult(StrEnum):
    CLOSED = "closed"
    ALREADY_CLOSED = "already_closed"  # closed before (that first end stands): nothing changed
    UNKNOWN = "unknown"  # no interval has this key: nothing changed


@dataclass(frozen=True)
class Interval:
    """One row of the ledger."""

    key: str
    user: str
    team: str
    profile: str
    model: str
    share: Fraction
    start: datetime
    end: datetime | None
    how: str | None
    last_seen: datetime
    reserve: timedelta
    run: str | None = None
    queue_wait: timedelta | None = None
    state: State = State.RUNNING
    kind: str = "server"  # or "job" (see `run_kind`)

    @property
    def is_open(self) -> bool:
        return self.end is None

    @property
    def is_reserved(self) -> bool:
        """Admitted, not (or never) running: held while open, never billed."""
        return self.state is State.RESERVED

    def gpu_hours(self, period: str, now: datetime | None = None) -> Fraction:
        """This interval's GPU-hours in `period` (an open one counted up to `now`), in Python."""
        if self.is_reserved:
            return Fraction(0)
        end = self.end if self.end is not None else max(self.start, now or periods.utcnow())
        return sum(
            (periods.gpu_hours(self.share, piece.duration // timedelta(seconds=1))
             for piece in periods.split_by_month(self.start, end) if piece.period == period),
            Fraction(0),
        )


@dataclass(frozen=True)
class UsageRow:
    """GPU-hours of one user of one team on one model under one profile, in one period."""

    team: str
    user: str
    model: str
    profile: str
    gpu_hours: Fraction


@dataclass(frozen=True)
class QueueWaits:
    """Queue waits of one team's runs: how many were measured, their total and the longest, in seconds."""

    count: int
    total_s: int
    longest_s: int

    @property
    def mean_s(self) -> Fraction:
        return Fraction(self.total_s, self.count) if self.count else Fraction(0)


@dataclass(frozen=True)
class AdmissionResult:
    """What `Ledger.admit` did: the decision, whether it opened the interval, and which alerts to send now."""

    decision: Decision
    opened: bool
    alerts: tuple[Alert, ...]


#: Room left in the ledger's 255-character key for a continuation suffix (`~2`).
MAX_RUN_KEY = 240
#: The most admission requests decided in one transaction (group commit); more wait for the next batch.
MAX_BATCH = 256


@dataclass(eq=False)
class _Asked:
    """One caller's admission request waiting at the door, and its answer once decided."""

    policy: Policy
    request: AdmissionRequest
    resolved: Resolved
    key: str
    period: str
    woken: threading.Event = field(default_factory=threading.Event)
    answered: bool = False
    result: AdmissionResult | None = None
    error: BaseException | None = None

    def answer(self, result: AdmissionResult | None = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.answered = result, error, True
        self.woken.set()


class _TeamView:
    """One team's holdings and budget usage inside a batch: read once under its lock, then kept up to date with
    each holding the batch opens (in memory, by the same rules as `Ledger._sum`)."""

    def __init__(self, team: str, open_rows: Iterable[Interval]):
        held = Holdings.of(open_rows)
        self.team = team
        self.held = (dict(held.team), dict(held.team_model), dict(held.team_user))
        self.usage: dict[tuple[str, int], Usage] = {}  # (period, now in seconds) → usage read for it

    def holdings(self) -> Holdings:
        team, team_model, team_user = self.held
        return Holdings(dict(team), dict(team_model), dict(team_user))

    def opened(self, user: str, model: str, share: Fraction, start_s: int, reserve_s: int) -> None:
        """A reserved holding opened at `start_s` (whole seconds) for `reserve_s`: held now, and counted against
        budgets for its reservation (clipped to each period, as `Ledger._sum(reserving=True)` counts it)."""
        team, team_model, team_user = self.held
        team[self.team] = team.get(self.team, Fraction(0)) + share
        team_model[self.team, model] = team_model.get((self.team, model), Fraction(0)) + share
        team_user[self.team, user] = team_user.get((self.team, user), Fraction(0)) + share
        until = start_s + reserve_s
        for (period, _now_s), usage in self.usage.items():
            period_start, period_end = (_seconds(t, "period") for t in periods.period_bounds(period))
            if not (start_s < period_end and until > period_start and until > start_s):
                continue
            seconds = min(until, period_end) - max(start_s, period_start)
            hours = Fraction(seconds * share.numerator, share.denominator * periods.SECONDS_PER_HOUR)
            per_team, per_model = usage.team, usage.team_model
            assert isinstance(per_team, dict) and isinstance(per_model, dict)
            per_team[self.team] = per_team.get(self.team, Fraction(0)) + hours
            per_model[self.team, model] = per_model.get((self.team, model), Fraction(0)) + hours


def run_key(user: str, server: str, started: datetime) -> str:
    """The ledger's key of one run of `user`'s server `server` that the hub started at `started`.

    `started` is the hub's `orm_spawner.started`: set before `Spawner.start()` is called and shown as
    `started` by the REST API, to the microsecond. Naive datetimes are the hub's UTC.
    """
    if started.tzinfo is None:
        started = started.replace(tzinfo=UTC)
    key = f"{user}/{server}@{periods.ensure_utc(started):%Y-%m-%dT%H:%M:%S.%fZ}"
    if len(key) > MAX_RUN_KEY:  # the hub allows names up to 255 characters each
        key = "run-sha256:" + hashlib.sha256(key.encode()).hexdigest()
    return key


#: What the run keys of training jobs begin with: `job:ID@STARTED` (no `/`, so no server's key looks like it).
JOB_RUN_PREFIX = "job:"


def job_run_key(job_id: str, started: datetime) -> str:
    """The ledger's key of the run of training job `job_id` admitted at `started` (one per attempt)."""
    return f"{JOB_RUN_PREFIX}{job_id}@{periods.ensure_utc(started):%Y-%m-%dT%H:%M:%S.%fZ}"


def run_kind(key: str) -> str:
    """`job` for a training job's run key (and its continuations), `server` for anything else."""
    return "job" if key.startswith(JOB_RUN_PREFIX) else "server"


def run_server(run: str) -> str | None:
    """The server a run key (`run_key`) names: `""` for the default server; None for a hashed key (whose user
    and server names were too long to keep)."""
    _user, slash, rest = run.partition("/")
    server, at, _started = rest.rpartition("@")
    return server if slash and at else None


# --- checking what callers write ---------------------------------------------------------------------------


def _text(value: Any, what: str, max_length: int) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, not {value!r}")
    if len(value) > max_length:
        raise ValueError(f"{what} {value[:40]!r}… is longer than {max_length} characters")
    if "\x00" in value:
        raise ValueError(f"{what} {value!r} contains a NUL character")
    return value


def _share(value: Any) -> Fraction:
    """An exact share: Fraction, int or decimal text ("0.25", "1/7"); floats are refused as inexact."""
    if isinstance(value, bool) or not isinstance(value, Fraction | int | str | Decimal):
        raise ValueError(
            f"share must be exact: a Fraction, an int, a Decimal or text such as '1/7' or '0.25', not {value!r}"
        )
    try:
        share = Fraction(value)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{value!r} is not a share (accepted: e.g. Fraction(1, 7), '0.25', 2)") from None
    if share <= 0:
        raise ValueError(f"share must be above 0, not {share}")
    if share.numerator > MAX_SHARE_TERM or share.denominator > MAX_SHARE_TERM:
        raise ValueError(f"share {share} has terms beyond 2^31 - 1; use a simpler fraction")
    return share


def _how(value: Any) -> HowEnded:
    try:
        return HowEnded(value)
    except ValueError:
        raise ValueError(
            f"{value!r} is not how an interval ends (accepted: {', '.join(h.value for h in HowEnded)})"
        ) from None


def _seconds(moment: datetime, what: str) -> int:
    return periods.to_epoch_seconds(moment, what)


def _interval(row: Any) -> Interval:
    wait = getattr(row, "queue_wait_s", None)
    return Interval(
        row.key, row.user, row.team, row.profile, row.model, Fraction(row.share_num, row.share_den),
        row.start_at, row.end_at, row.how, row.last_seen_at, timedelta(seconds=row.reserve_s),
        getattr(row, "run", None), None if wait is None else timedelta(seconds=wait),
        State(getattr(row, "state", None) or State.RUNNING), getattr(row, "kind", None) or "server",
    )


def _as_int(column: sa.ColumnElement[Any]) -> sa.ColumnElement[int]:
    # Arithmetic on the stored seconds: bypass the datetime conversion of `UTCSeconds`.
    return sa.type_coerce(column, sa.BigInteger)


class Ledger:
    """The ledger on one database. Thread-safe: share one per process."""

    def __init__(self, url: str | sa.URL | sa.Engine, *, migrate: bool = True):
        """Open the ledger at `url` (``sqlite:///PATH`` or ``postgresql+psycopg://…``).

        `migrate=True` creates or upgrades the schema; with False the schema must already be current
        (for read-only commands such as `gpupool bill`).
        """
        self.engine = url if isinstance(url, sa.Engine) else db.create_engine(url)
        self.dialect = self.engine.dialect.name
        path = self.engine.url.database
        if not migrate and self.dialect == "sqlite" and path not in (None, "", ":memory:") and not Path(path).exists():
            # Connecting would create an empty file where the caller expected a ledger.
            raise ValueError(f"no ledger at {path} (the file does not exist); start the hub to create it, "
                             "or give the URL of the hub's ledger")
        if migrate:
            db.migrate(self.engine)
        else:
            current, head = db.current_revision(self.engine), db.head_revision()
            if current != head:
                raise ValueError(
                    f"the ledger at {self.engine.url.render_as_string(hide_password=True)} is at schema revision "
                    f"{current or 'none (no ledger there)'}, this gpupool needs {head}; start the hub "
                    "(or run Ledger(url, migrate=True)) to create or upgrade it"
                )
        self._writer = db.writer(self.engine)
        self._insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        #: False: every admission decided in its own transaction (the path before group commit; for benchmarks).
        self.group_commit = True
        self._door = threading.Lock()  # guards the two below
        self._waiting: list[_Asked] = []
        self._leading = False  # a caller is deciding a batch (the others wait to be answered or to lead next)

    def dispose(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *_: object) -> None:
        self.dispose()

    # --- writing -------------------------------------------------------------------------------------

    def open_interval(self, key: str, user: str, team: str, profile: str, model: str, share: Fraction,
                      start: datetime, *, reserve: timedelta = timedelta(0)) -> OpenResult:
        """Record that `user` of `team` holds `share` of a `model` card from `start` on.

        Opening the same key again with the same facts is a no-op (`EXISTS`); with different facts it is
        a ValueError (a key names one interval) and nothing is written.
        """
        values = self._interval_values(key, user, team, profile, model, share, start, reserve)
        with self._writer.begin() as connection:
            return self._open(connection, values)

    def keep_run(self, run: str, user: str, team: str, profile: str, model: str, share: Fraction,
                 start: datetime, seen_at: datetime, *, queue_wait: timedelta | None = None) -> RunResult:
        """Make the ledger say that server run `run` is running at `seen_at`, whoever saw it.

        The spawner (at start and on every poll) and the accounting service (from the hub's REST API)
        both call this with the run's key (`run_key`), so it is idempotent and safe under
        concurrent callers: no interval yet → the run's first one opens at `start`; its holding reserved at
        admission (`admit`) → it runs from `start` (not before its admission) and is billed from then on; its
        last interval open → noted as seen; closed by reconciliation (nobody reported while the hub or the service
        was down) → a new interval continues exactly where that one ended, so no second is lost or
        counted twice; stopped for real → nothing (a late report of a stopped run changes nothing).
        """
        run = _text(run, "run", MAX_RUN_KEY)
        seen_s = _seconds(seen_at, "seen_at")
        wait_s = None
        if queue_wait is not None:
            if not isinstance(queue_wait, timedelta) or queue_wait < timedelta(0):
                raise ValueError(f"queue_wait must be a timedelta of 0 or more, not {queue_wait!r}")
            wait_s = queue_wait // timedelta(seconds=1)
        c = INTERVALS.c
        with self._writer.begin() as connection:
            pieces = [_interval(row) for row in connection.execute(
                sa.select(INTERVALS).where(c.run == run).order_by(c.start_at, c.id))]
            if not pieces:
                values = self._interval_values(run, user, team, profile, model, share, start, timedelta(0))
                values.update(run=run, queue_wait_s=wait_s,
                              last_seen_at=max(values["start_at"], periods.from_epoch_seconds(seen_s)))
                # A concurrent caller may have opened it first (at its own idea of the start): that stands.
                return RunResult.OPENED if self._insert_piece(connection, values) else RunResult.RUNNING
            last = pieces[-1]
            if last.is_open and last.is_reserved:
                start_s = max(_seconds(start, "start"), _seconds(last.start, "start"))
                connection.execute(
                    INTERVALS.update().where(c.key == last.key, c.end_at.is_(None), c.state == State.RESERVED.value)
                    .values(state=State.RUNNING.value, start_at=periods.from_epoch_seconds(start_s),
                            last_seen_at=periods.from_epoch_seconds(max(start_s, seen_s)), queue_wait_s=wait_s))
                return RunResult.OPENED
            if last.is_open:
                connection.execute(
                    INTERVALS.update().where(c.key == last.key, c.end_at.is_(None))
                    .values(last_seen_at=sa.case((_as_int(c.last_seen_at) < seen_s, seen_s),
                                                 else_=_as_int(c.last_seen_at))))
                return RunResult.RUNNING
            if last.how != HowEnded.RECONCILED.value:
                return RunResult.ENDED
            # The same key for every caller that continues the same piece: concurrent callers meet. A holding
            # closed while still reserved (not seen while it waited) runs from `start`, not from where it ended.
            since = max(last.end, periods.ensure_utc(start, "start")) if last.is_reserved else last.end
            values = self._interval_values(f"{run}~{len(pieces)}", last.user, last.team, last.profile,
                                           last.model, last.share, since, timedelta(0))
            values.update(run=run, last_seen_at=max(last.end, periods.from_epoch_seconds(seen_s)))
            self._insert_piece(connection, values)
            return RunResult.CONTINUED

    def _insert_piece(self, connection: sa.Connection, values: dict[str, Any]) -> bool:
        return connection.execute(
            self._insert(INTERVALS).values(**values).on_conflict_do_nothing(index_elements=["key"])
            .returning(INTERVALS.c.id)
        ).first() is not None

    def heartbeat_run(self, run: str, seen_at: datetime) -> bool:
        """Note that run `run` was seen at `seen_at` if its interval is open (nothing opens); whether it was."""
        run, seen_s = _text(run, "run", MAX_RUN_KEY), _seconds(seen_at, "seen_at")
        c = INTERVALS.c
        with self._writer.begin() as connection:
            return connection.execute(
                INTERVALS.update().where(c.run == run, c.end_at.is_(None))
                .values(last_seen_at=sa.case((_as_int(c.last_seen_at) < seen_s, seen_s),
                                             else_=_as_int(c.last_seen_at)))
            ).rowcount > 0

    def close_run(self, run: str, end: datetime | None, how: HowEnded | str) -> CloseResult:
        """Close the open interval of server run `run` at `end` (None: at its last-seen time), and how."""
        run, ended = _text(run, "run", MAX_RUN_KEY), _how(how)
        c = INTERVALS.c
        with self._writer.begin() as connection:
            if ended is HowEnded.STOPPED and connection.execute(
                    sa.select(IDLE_SERVERS.c.run).where(IDLE_SERVERS.c.run == run,
                                                        IDLE_SERVERS.c.cull_requested_at.is_not(None))).first():
                ended = HowEnded.CULLED  # the idle culler asked the hub for this stop
            if end is None:
                new_end: Any = c.last_seen_at
            else:
                end_s = _seconds(end, "end")
                new_end = sa.case((_as_int(c.start_at) > end_s, _as_int(c.start_at)), else_=end_s)
            closed = connection.execute(
                INTERVALS.update().where(c.run == run, c.end_at.is_(None))
                .values(end_at=new_end, how=ended.value,
                        last_seen_at=sa.case((_as_int(c.last_seen_at) < _as_int(new_end), _as_int(new_end)),
                                             else_=_as_int(c.last_seen_at)))
            ).rowcount
            if closed:
                return CloseResult.CLOSED
            known = connection.execute(sa.select(c.id).where(c.run == run).limit(1)).first()
        return CloseResult.ALREADY_CLOSED if known is not None else CloseResult.UNKNOWN

    def close_runs_except(self, running: Iterable[str], started_before: datetime) -> list[str]:
        """Close, at their last-seen time, the open intervals of server runs not in `running`; their runs.

        For the hub's view of what runs: a run the hub no longer lists has ended, and nobody reported
        it. Only intervals that started before `started_before` (when the hub was asked) are closed: a
        server that started since is not in the answer, yet runs. Training jobs are not the hub's servers:
        their runner reports them, so their intervals are left alone here.
        """
        keep = set(running)
        before_s = _seconds(started_before, "started_before")
        c = INTERVALS.c
        with self._writer.begin() as connection:
            candidates = connection.execute(
                sa.select(c.id, c.run).where(c.end_at.is_(None), c.run.is_not(None), c.kind == "server",
                                             _as_int(c.start_at) < before_s)
            ).all()
            gone = [row for row in candidates if row.run not in keep]
            for row in gone:
                connection.execute(
                    INTERVALS.update().where(c.id == row.id, c.end_at.is_(None))
                    .values(end_at=c.last_seen_at, how=HowEnded.RECONCILED.value))
        return sorted(row.run for row in gone)

    @staticmethod
    def _interval_values(key: str, user: str, team: str, profile: str, model: str, share: Any,
                         start: datetime, reserve: timedelta) -> dict[str, Any]:
        exact = _share(share)
        if not isinstance(reserve, timedelta) or reserve < timedelta(0):
            raise ValueError(f"reserve must be a timedelta of 0 or more, not {reserve!r}")
        start = periods.ensure_utc(start, "start")
        return {
            "key": _text(key, "key", 255), "user": _text(user, "user", 255), "team": _text(team, "team", 63),
            "profile": _text(profile, "profile", 63), "model": _text(model, "model", 63),
            "share_num": exact.numerator, "share_den": exact.denominator,
            "start_at": start, "end_at": None, "how": None, "last_seen_at": start,
            "reserve_s": reserve // timedelta(seconds=1), "run": None, "queue_wait_s": None,
            "state": State.RUNNING.value, "kind": run_kind(key),
        }

    def _open(self, connection: sa.Connection, values: dict[str, Any]) -> OpenResult:
        # RETURNING says whether this statement inserted the row (rowcount is unreliable with psycopg here).
        inserted = connection.execute(
            self._insert(INTERVALS).values(**values).on_conflict_do_nothing(index_elements=["key"])
            .returning(INTERVALS.c.id)
        ).first()
        if inserted is not None:
            return OpenResult.OPENED
        existing = connection.execute(sa.select(INTERVALS).where(INTERVALS.c.key == values["key"])).one()
        stored, asked = _interval(existing), _interval(_Values(values))
        differ = [name for name in ("user", "team", "profile", "model", "share", "start")
                  if getattr(stored, name) != getattr(asked, name)]
        if differ:
            raise ValueError(
                f"key {values['key']!r} already names another interval (it differs in "
                f"{', '.join(differ)}); use a new key for a new interval"
            )
        return OpenResult.EXISTS

    def close_interval(self, key: str, end: datetime, how: HowEnded | str) -> CloseResult:
        """Record that the interval `key` ended at `end`, and how. Idempotent: the first close stands."""
        key, ended, end_s = _text(key, "key", 255), _how(how), _seconds(end, "end")
        with self._writer.begin() as connection:
            c = INTERVALS.c
            updated = connection.execute(
                INTERVALS.update()
                .where(c.key == key, c.end_at.is_(None), _as_int(c.start_at) <= end_s)
                .values(end_at=end, how=ended.value,
                        last_seen_at=sa.case((_as_int(c.last_seen_at) < end_s, end_s),
                                             else_=_as_int(c.last_seen_at)))
            ).rowcount
            if updated == 1:
                return CloseResult.CLOSED
            row = connection.execute(sa.select(c.start_at, c.end_at).where(c.key == key)).first()
        if row is None:
            return CloseResult.UNKNOWN
        if row.end_at is not None:
            return CloseResult.ALREADY_CLOSED
        raise ValueError(f"end {end.isoformat()} of {key!r} is before its start {row.start_at.isoformat()}")

    def heartbeat(self, key: str, seen_at: datetime) -> bool:
        """Note that the holder of `key` was alive at `seen_at`; False when no open interval has that key."""
        key, seen_s = _text(key, "key", 255), _seconds(seen_at, "seen_at")
        c = INTERVALS.c
        with self._writer.begin() as connection:
            return connection.execute(
                INTERVALS.update().where(c.key == key, c.end_at.is_(None))
                .values(last_seen_at=sa.case((_as_int(c.last_seen_at) < seen_s, seen_s),
                                             else_=_as_int(c.last_seen_at)))
            ).rowcount == 1

    def reconcile(self, stale_after: timedelta, now: datetime | None = None) -> list[str]:
        """Close, at their last heartbeat, the open intervals not seen for `stale_after`; their keys.

        For holders that vanished without a close event (a hub crash, a lost node).
        """
        if not isinstance(stale_after, timedelta) or stale_after <= timedelta(0):
            raise ValueError(f"stale_after must be a positive timedelta, not {stale_after!r}")
        cutoff = _seconds(now or periods.utcnow(), "now") - stale_after // timedelta(seconds=1)
        c = INTERVALS.c
        with self._writer.begin() as connection:
            keys = connection.execute(
                INTERVALS.update().where(c.end_at.is_(None), _as_int(c.last_seen_at) < cutoff)
                .values(end_at=c.last_seen_at, how=HowEnded.RECONCILED.value)
                .returning(c.key)
            ).scalars().all()
        return sorted(keys)

    def claim_alerts(self, alerts: Iterable[Alert], now: datetime | None = None) -> list[Alert]:
        """Record `alerts` as sent; the ones not recorded before, which the caller should now send.

        At most once: concurrent callers claiming the same alert get it exactly once between them.
        """
        with self._writer.begin() as connection:
            return self._claim(connection, alerts, now or periods.utcnow())

    def _claim(self, connection: sa.Connection, alerts: Iterable[Alert], now: datetime) -> list[Alert]:
        claimed = []
        for alert in alerts:
            inserted = connection.execute(
                self._insert(ALERTS).values(team=alert.team, period=alert.period, scope=alert.scope,
                                            threshold=alert.threshold_text, sent_at=now)
                .on_conflict_do_nothing(index_elements=["team", "period", "scope", "threshold"])
                .returning(ALERTS.c.id)
            ).first()
            if inserted is not None:
                claimed.append(alert)
        return claimed

    def admit(self, policy: Policy, request: AdmissionRequest, key: str) -> AdmissionResult:
        """Decide `request` and, when admitted, hold its share as `key` from `request.at`, atomically.

        The holding is `reserved` (held against the quotas, not billed) with `key` as its run: `keep_run(key,
        …)` makes it `running` when the workload runs, `close_run(key, …)` ends it (never billed if it never
        ran). Holdings are the team's open intervals, reserved or running, and usage the period's GPU-hours
        so far (open intervals counting at least their reservation), both read under the team's admission
        lock. Asking again with the key of an open holding changes nothing and answers `admit`. The alerts in
        the result are the ones not sent before (claimed in the same transaction); send them.

        Blocking; safe from any number of threads at once: requests that arrive together are decided in one
        transaction (group commit, see the module's description), each answered as if decided alone in turn.
        """
        resolved = resolve(policy, request)
        key = _text(key, "key", 255)
        period = periods.period_of(request.at)
        asked = _Asked(policy, request, resolved, key, period)
        if not self.group_commit:
            self._decide_alone(asked)
        else:
            with self._door:
                self._waiting.append(asked)
                lead = not self._leading
                self._leading = True
            while lead or not asked.answered:
                if not lead:
                    asked.woken.wait()
                    asked.woken.clear()
                    if asked.answered:
                        break
                    # Woken unanswered: the last leader passed the door on to us, the first still waiting.
                self._lead()
                lead = False
        if asked.error is not None:
            raise asked.error
        assert asked.result is not None
        return asked.result

    def _lead(self) -> None:
        """Decide one batch of the waiting requests, then pass the door on to the first still waiting, if any."""
        with self._door:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
        try:
            self._decide_batch(batch)
        finally:
            for asked in batch:
                if not asked.answered:  # only if deciding itself broke (say, KeyboardInterrupt in the leader)
                    asked.answer(error=RuntimeError("the admission batch was interrupted before this request "
                                                    "was decided; nothing was written for it"))
            with self._door:
                if self._waiting:
                    self._waiting[0].woken.set()  # it leads next (woken, not answered)
                else:
                    self._leading = False

    def _decide_batch(self, batch: list[_Asked]) -> None:
        """Decide `batch` in one transaction; if it fails, roll it back and decide each request alone."""
        if len(batch) == 1:
            self._decide_alone(batch[0])
            return
        try:
            with self._writer.begin() as connection:
                results = self._decide_together(connection, batch)
        except Exception:  # noqa: BLE001 - nothing of the batch was written: each is decided again on its own
            for asked in batch:
                self._decide_alone(asked)
            return
        for asked, result in zip(batch, results, strict=True):
            asked.answer(result)

    def _decide_alone(self, asked: _Asked) -> None:
        try:
            with self._writer.begin() as connection:
                self._lock_teams(connection, [asked.resolved.team])
                result = self._decide_together(connection, [asked])[0]
        except Exception as error:  # noqa: BLE001 - the caller's to handle, raised in its thread
            asked.answer(error=error)
        else:
            asked.answer(result)

    def _lock_teams(self, connection: sa.Connection, teams: Iterable[str]) -> None:
        # In name order: two processes locking the same teams never wait for each other in a cycle.
        for team in sorted(set(teams)):
            connection.execute(self._insert(LOCKS).values(team=team).on_conflict_do_nothing())
            # SQLite has no row locks (SQLAlchemy leaves FOR UPDATE out): BEGIN IMMEDIATE serialised us.
            connection.execute(sa.select(LOCKS.c.team).where(LOCKS.c.team == team).with_for_update())

    def _decide_together(self, connection: sa.Connection, batch: list[_Asked]) -> list[AdmissionResult]:
        """Decide `batch` in order inside `connection`'s transaction; raises on the first request that fails."""
        if len(batch) > 1:
            self._lock_teams(connection, (asked.resolved.team for asked in batch))
        c = INTERVALS.c
        keys = sorted({asked.key for asked in batch})
        known: dict[str, Any] = {row.key: row for row in connection.execute(
            sa.select(c.key, c.end_at).where(c.key.in_(keys)))}
        views: dict[str, _TeamView] = {}
        results = []
        for asked in batch:
            resolved, request, key, period = asked.resolved, asked.request, asked.key, asked.period
            existing = known.get(key)
            if existing is not None:
                if existing.end_at is not None:
                    raise ValueError(f"key {key!r} names an interval that has ended; use a new key")
                again = Decision("admit", f"already admitted: interval {key!r} is open", resolved.priority,
                                 resolved.preemptible, (), period, code=Reason.ALREADY_ADMITTED)
                results.append(AdmissionResult(again, False, ()))
                continue
            view = views.get(resolved.team)
            if view is None:
                view = views[resolved.team] = _TeamView(resolved.team, (_interval(row) for row in connection.execute(
                    sa.select(INTERVALS).where(c.team == resolved.team, c.end_at.is_(None)))))
            now_s = _seconds(request.at, "now")
            usage = view.usage.get((period, now_s))
            if usage is None:
                usage = view.usage[period, now_s] = self._usage(connection, period, request.at, team=resolved.team)
            decision = decide(asked.policy, request, view.holdings(),
                              Usage(usage.period, dict(usage.team), dict(usage.team_model)))
            opened = False
            if decision.admitted and resolved.model is not None and resolved.share > 0:
                values = self._interval_values(key, resolved.user, resolved.team, resolved.profile,
                                               resolved.model, resolved.share, request.at, request.reserve)
                values.update(run=_text(key, "key", MAX_RUN_KEY), state=State.RESERVED.value)
                opened = self._open(connection, values) is OpenResult.OPENED
                if opened:
                    view.opened(resolved.user, resolved.model, Fraction(values["share_num"], values["share_den"]),
                                now_s, values["reserve_s"])
                    known[key] = _Values({"key": key, "end_at": None})
                else:  # written by another process meanwhile (it takes no admission lock): read everything again
                    views.pop(resolved.team, None)
                    known[key] = connection.execute(sa.select(c.key, c.end_at).where(c.key == key)).one()
            alerts = self._claim(connection, decision.alerts, request.at)
            results.append(AdmissionResult(decision, opened, tuple(alerts)))
        return results

    # --- reading ---------------------------------------------------------------------------------------------

    def interval(self, key: str) -> Interval | None:
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(INTERVALS).where(INTERVALS.c.key == key)).first()
        return None if row is None else _interval(row)

    def run_intervals(self, run: str) -> list[Interval]:
        """The intervals of server run `run`, in order (more than one when it was continued after a crash)."""
        c = INTERVALS.c
        with self.engine.connect() as connection:
            return [_interval(row) for row in connection.execute(
                sa.select(INTERVALS).where(c.run == run).order_by(c.start_at, c.id))]

    def open_intervals(self, team: str | None = None) -> list[Interval]:
        query = sa.select(INTERVALS).where(INTERVALS.c.end_at.is_(None)).order_by(INTERVALS.c.start_at,
                                                                                   INTERVALS.c.key)
        if team is not None:
            query = query.where(INTERVALS.c.team == team)
        with self.engine.connect() as connection:
            return [_interval(row) for row in connection.execute(query)]

    def intervals_overlapping(self, start: datetime, end: datetime, *, user: str | None = None,
                              team: str | None = None) -> list[Interval]:
        """The intervals (of `user`, charged to `team`, when given) that overlap [start, end), open ones included:
        what was billed, so reserved holdings (admitted, not running) are left out."""
        query = (sa.select(INTERVALS)
                 .where(INTERVALS.c.start_at < end, INTERVALS.c.state == State.RUNNING.value,
                        sa.or_(INTERVALS.c.end_at.is_(None), INTERVALS.c.end_at > start),
                        *([INTERVALS.c.user == user] if user is not None else []),
                        *([INTERVALS.c.team == team] if team is not None else []))
                 .order_by(INTERVALS.c.start_at, INTERVALS.c.key))
        with self.engine.connect() as connection:
            return [_interval(row) for row in connection.execute(query)]

    def holdings(self) -> Holdings:
        """What is held now, from the open intervals."""
        return Holdings.of(self.open_intervals())

    def gpu_hours(self, period: str, by: Sequence[str] = ("team",), *, team: str | None = None,
                  now: datetime | None = None) -> dict[tuple[str, ...], Fraction]:
        """GPU-hours used in `period`, summed by the columns `by` (of team, user, model, profile).

        Open intervals count up to `now`; everything is clipped to the period. `by=()` gives the total
        under the key ``()``.
        """
        unknown = [name for name in by if name not in GROUPINGS]
        if unknown or len(set(by)) != len(by):
            raise ValueError(f"cannot sum by {list(by)} (accepted: any of {', '.join(GROUPINGS)}, each once)")
        with self.engine.connect() as connection:
            return self._sum(connection, period, now or periods.utcnow(), tuple(by), team=team)

    def usage_rows(self, period: str, *, team: str | None = None, now: datetime | None = None) -> list[UsageRow]:
        """GPU-hours per team, user, model and profile in `period`: what bills are made of."""
        sums = self.gpu_hours(period, GROUPINGS, team=team, now=now)
        return [UsageRow(*names, hours) for names, hours in sorted(sums.items())]

    def usage(self, period: str, now: datetime | None = None) -> Usage:
        """GPU-hours counted against budgets in `period` (open intervals count at least their reservation)."""
        with self.engine.connect() as connection:
            return self._usage(connection, period, now or periods.utcnow())

    def _usage(self, connection: sa.Connection, period: str, now: datetime, team: str | None = None) -> Usage:
        sums = self._sum(connection, period, now, ("team", "model"), team=team, reserving=True)
        per_team: dict[str, Fraction] = {}
        for (name, _model), hours in sums.items():
            per_team[name] = per_team.get(name, Fraction(0)) + hours
        return Usage(period, per_team, {(name, model): hours for (name, model), hours in sums.items()})

    def gpu_hours_between(self, start: datetime, end: datetime, by: Sequence[str] = ("team",), *,
                          team: str | None = None, now: datetime | None = None) -> dict[tuple[str, ...], Fraction]:
        """Like `gpu_hours`, for any span [start, end) instead of a period (a day of a report)."""
        unknown = [name for name in by if name not in GROUPINGS]
        if unknown or len(set(by)) != len(by):
            raise ValueError(f"cannot sum by {list(by)} (accepted: any of {', '.join(GROUPINGS)}, each once)")
        bounds = (_seconds(start, "start"), _seconds(end, "end"))
        if bounds[1] < bounds[0]:
            raise ValueError(f"end {end.isoformat()} is before start {start.isoformat()}")
        with self.engine.connect() as connection:
            return self._sum(connection, bounds, now or periods.utcnow(), tuple(by), team=team)

    def queue_waits(self, period: str, *, team: str | None = None) -> dict[str, QueueWaits]:
        """How long the runs that started in `period` and waited (a second or more) waited in the queue, per team.

        Runs placed at once (a wait of 0 s on record) are left out: they would pull the mean towards 0 and
        count as "waited" in every figure made from this.
        """
        start, end = (_seconds(t, "period") for t in periods.period_bounds(period))
        c = INTERVALS.c
        query = (sa.select(c.team, sa.func.count(), sa.func.sum(c.queue_wait_s), sa.func.max(c.queue_wait_s))
                 .where(c.queue_wait_s > 0, _as_int(c.start_at) >= start, _as_int(c.start_at) < end)
                 .group_by(c.team))
        if team is not None:
            query = query.where(c.team == team)
        with self.engine.connect() as connection:
            return {name: QueueWaits(int(count), int(total), int(longest))
                    for name, count, total, longest in connection.execute(query)}

    def _sum(self, connection: sa.Connection, period: str | tuple[int, int], now: datetime, by: tuple[str, ...], *,
             team: str | None = None, reserving: bool = False) -> dict[tuple[str, ...], Fraction]:
        """Σ share × clipped seconds, grouped by `by`, in exact integers per share denominator.

        `period` is a billing period or (start, end) in epoch seconds.
        """
        if isinstance(period, str):
            period_start, period_end = (_seconds(t, "period") for t in periods.period_bounds(period))
        else:
            period_start, period_end = period
        now_s = _seconds(now, "now")
        c = INTERVALS.c
        start, end = _as_int(c.start_at), _as_int(c.end_at)
        # Two-argument LEAST/GREATEST: PostgreSQL's names; SQLite's min() and max() with two arguments
        # are the same scalar functions (with one argument they would be aggregates).
        least, greatest = (sa.func.least, sa.func.greatest) if self.dialect == "postgresql" else (sa.func.min,
                                                                                                 sa.func.max)
        # An open interval runs until now; for budgets, at least until the end of its reservation. A reserved
        # holding (admitted, not running yet) is not use: bills leave it out, budgets count its reservation.
        until: sa.ColumnElement[int] = sa.literal(now_s, sa.BigInteger)
        reserved = c.state == State.RESERVED.value
        if reserving:
            until = sa.case((reserved, start + c.reserve_s), else_=greatest(start + c.reserve_s, now_s))
        effective_end = sa.func.coalesce(end, until)
        seconds = least(effective_end, period_end) - greatest(start, period_start)
        groups = [c[name] for name in by]
        query = (
            sa.select(*groups, c.share_den, sa.func.sum(seconds * c.share_num).label("weighted"))
            # Overlaps the period (written so that the start_at and end_at indexes apply), and has run for
            # some time: an open interval that "starts" after `now` (a clock behind the event) has not.
            .where(start < period_end,
                   sa.or_(end > period_start, sa.and_(end.is_(None), until > period_start, until > start)))
            .group_by(*groups, c.share_den)
        )
        if team is not None:
            query = query.where(c.team == team)
        # Reserved holdings that ended never ran; open ones count for budgets only.
        query = query.where(sa.or_(~reserved, end.is_(None)) if reserving else ~reserved)
        if self.dialect == "postgresql" and len(by) == len(GROUPINGS):
            # The planner would hash every row on five text columns; reading `BILL_INDEX` in group order
            # and aggregating as it goes is about twice as fast on a month of a million intervals
            # (bench/ledger.py). For this transaction only.
            connection.exec_driver_sql("SET LOCAL enable_hashagg = off")
        sums: dict[tuple[str, ...], Fraction] = {}
        for *names, share_den, weighted in connection.execute(query):
            # PostgreSQL's SUM(bigint) is NUMERIC (a Decimal here): int() of it is exact.
            hours = Fraction(int(weighted), share_den * periods.SECONDS_PER_HOUR)
            key = tuple(names)
            sums[key] = sums[key] + hours if key in sums else hours
        if not by and not sums:
            sums[()] = Fraction(0)
        return sums


class _Values:
    """Column values about to be written, read like a row (times at the ledger's whole seconds)."""

    def __init__(self, values: dict[str, Any]):
        for name, value in values.items():
            if isinstance(value, datetime):
                value = periods.from_epoch_seconds(periods.to_epoch_seconds(value))
            setattr(self, name, value)
