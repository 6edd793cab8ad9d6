"""The idle culler's records in the ledger's database: one row per server run holding a GPU share.

The culler writes them at every look (`IdleStore.save`), a user's "keep it" through the culler's API
(`IdleStore.keep`), and the cull it asks the hub for (`IdleStore.request_cull`), after which the run's interval
ends `culled`. The hub's home page and the culler's page read them (`IdleStore.of_user`), and the reports the
GPU-hours culling gave back (`reclaimed`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from fractions import Fraction
from typing import Any

import sqlalchemy as sa

from gpupool.hub.accounting import db
from gpupool.policies import periods
from gpupool.policies.idleness import IdleRecord

IDLE = db.IdleServer.__table__
IDLE_TIME = db.IdleTime.__table__
INTERVALS = db.UsageInterval.__table__
#: "Reclaimed" GPU-hours of a cull: the share × the time until its user started a server of that team again, at
#: most this long (and never past the period's end): what the idle server would have held had nobody stopped it.
RECLAIM_CAP = timedelta(hours=24)


@dataclass(frozen=True)
class IdleServer:
    run: str
    user: str
    server: str
    team: str
    profile: str
    record: IdleRecord
    seen_at: datetime
    seen: dict[str, Any]
    cull_requested_at: datetime | None
    cull_reason: str


def _row(row: sa.Row) -> IdleServer:
    return IdleServer(
        run=row.run, user=row.user, server=row.server, team=row.team, profile=row.profile,
        record=IdleRecord(started=row.started_at, last_active=row.last_active_at, warned_at=row.warned_at,
                          warned_for=row.warned_for, keep_until=row.keep_until, kept=timedelta(seconds=row.kept_s)),
        seen_at=row.seen_at, seen=json.loads(row.seen or "{}"), cull_requested_at=row.cull_requested_at,
        cull_reason=row.cull_reason,
    )


class IdleStore:
    """The idle records of the ledger's database (`engine`: the ledger's, migrated)."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine
        self._writer = db.writer(engine)

    def get(self, run: str) -> IdleServer | None:
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(IDLE).where(IDLE.c.run == run)).first()
        return None if row is None else _row(row)

    def running(self, user: str | None) -> list[IdleServer]:
        """The records of runs still running (their interval in the ledger open) and not being culled: `user`'s,
        or everyone's (None)."""
        open_runs = sa.select(INTERVALS.c.run).where(INTERVALS.c.end_at.is_(None), INTERVALS.c.run.is_not(None))
        query = sa.select(IDLE).where(IDLE.c.cull_requested_at.is_(None), IDLE.c.run.in_(open_runs))
        if user is not None:
            query = query.where(IDLE.c.user == user)
        with self.engine.connect() as connection:
            rows = connection.execute(query.order_by(IDLE.c.user, IDLE.c.server)).all()
        return [_row(row) for row in rows]

    def runs(self, runs: list[str]) -> dict[str, IdleServer]:
        if not runs:
            return {}
        with self.engine.connect() as connection:
            rows = connection.execute(sa.select(IDLE).where(IDLE.c.run.in_(runs))).all()
        return {row.run: _row(row) for row in rows}

    def save(self, run: str, user: str, server: str, team: str, profile: str, record: IdleRecord, seen_at: datetime,
             seen: dict[str, Any]) -> None:
        """Write what the culler saw of `run` now (a new run's row, or the row updated); a keep granted
        meanwhile is never undone (the later `keep_until` and the larger `kept` win)."""
        values = {"user": user, "server": server, "team": team, "profile": profile, "started_at": record.started,
                  "last_active_at": record.last_active, "warned_at": record.warned_at,
                  "warned_for": record.warned_for, "seen_at": seen_at, "seen": json.dumps(seen, sort_keys=True)}
        with self._writer.begin() as connection:
            current = connection.execute(sa.select(IDLE).where(IDLE.c.run == run).with_for_update()).first()
            if current is None:
                connection.execute(IDLE.insert().values(
                    run=run, keep_until=record.keep_until, kept_s=int(record.kept.total_seconds()),
                    cull_requested_at=None, cull_reason="", **values))
                return
            if current.kept_s > int(record.kept.total_seconds()):
                # Kept by its user while the culler looked: that keep stands, and its warning is over.
                values.update(warned_at=None, warned_for=None)
            connection.execute(IDLE.update().where(IDLE.c.run == run).values(**values))

    def keep(self, run: str, record: IdleRecord) -> None:
        """Record a user's "keep it": the new stop time and how much was kept in all."""
        with self._writer.begin() as connection:
            connection.execute(IDLE.update().where(IDLE.c.run == run).values(
                keep_until=record.keep_until, kept_s=int(record.kept.total_seconds()), warned_at=None,
                warned_for=None))

    def request_cull(self, run: str, at: datetime, reason: str, kept: timedelta) -> bool:
        """Mark `run` as being stopped by the culler, unless its user kept it since the culler read its record
        (`kept`, what had been kept then) or a stop is already asked for; whether it was marked."""
        with self._writer.begin() as connection:
            return connection.execute(
                IDLE.update().where(IDLE.c.run == run, IDLE.c.kept_s == int(kept.total_seconds()),
                                    IDLE.c.cull_requested_at.is_(None))
                .values(cull_requested_at=at, cull_reason=reason)).rowcount == 1

    def cull_failed(self, run: str) -> None:
        """The hub did not stop it: a later stop by its user is not a cull."""
        with self._writer.begin() as connection:
            connection.execute(IDLE.update().where(IDLE.c.run == run).values(cull_requested_at=None,
                                                                             cull_reason=""))

    def add_idle(self, run: str, team: str, model: str, share: Fraction, start: datetime, end: datetime,
                 kind: str = "server") -> None:
        """`run` (of a `server` or a `job`) sat idle from `start` to `end` (between two looks): added to its idle
        time, per period."""
        if end <= start:
            return
        share = Fraction(share)
        with self._writer.begin() as connection:
            for piece in periods.split_by_month(start, end):
                seconds = int(piece.duration.total_seconds())
                if seconds <= 0:
                    continue
                key = (IDLE_TIME.c.run == run) & (IDLE_TIME.c.period == piece.period)
                if connection.execute(IDLE_TIME.update().where(key).values(idle_s=IDLE_TIME.c.idle_s + seconds)
                                      ).rowcount == 0:
                    connection.execute(IDLE_TIME.insert().values(
                        run=run, period=piece.period, kind=kind, team=team, model=model, share_num=share.numerator,
                        share_den=share.denominator, idle_s=seconds))


@dataclass(frozen=True)
class IdleFigures:
    """A team's idle GPUs in a period: GPU-hours held by idle servers and by idle jobs, servers culled and the
    GPU-hours culling gave back."""

    idle_gpu_hours: Fraction
    job_idle_gpu_hours: Fraction
    culled: int
    reclaimed_gpu_hours: Fraction


def idle_figures(engine: sa.Engine, period: str, now: datetime | None = None) -> dict[str, IdleFigures]:
    """Per team, for `period`: idle GPU-hours of servers and of jobs (from the culler's looks), servers culled,
    and GPU-hours reclaimed
    (`RECLAIM_CAP`: each cull's share until its user started a server of that team again, capped)."""
    start, end = periods.period_bounds(period)
    moment = now or periods.utcnow()
    if moment < end:
        # Up to now, and the ledger keeps whole seconds: a cull of this very second is in (its second < now's + 1).
        end = moment + timedelta(seconds=1)
    idle: dict[tuple[str, str], Fraction] = {}
    with engine.connect() as connection:
        for row in connection.execute(sa.select(IDLE_TIME).where(IDLE_TIME.c.period == period)):
            idle[row.team, row.kind] = idle.get((row.team, row.kind), Fraction(0)) + periods.gpu_hours(
                Fraction(row.share_num, row.share_den), row.idle_s)
        culls = connection.execute(
            sa.select(IDLE.c.run, IDLE.c.user, IDLE.c.team, IDLE.c.cull_requested_at, INTERVALS.c.share_num,
                      INTERVALS.c.share_den)
            .join(INTERVALS, INTERVALS.c.run == IDLE.c.run)
            .where(IDLE.c.cull_requested_at.is_not(None), INTERVALS.c.how == "culled",
                   IDLE.c.cull_requested_at >= start, IDLE.c.cull_requested_at < end)).all()
        culled: dict[str, int] = {}
        reclaimed: dict[str, Fraction] = {}
        for cull in culls:
            culled[cull.team] = culled.get(cull.team, 0) + 1
            after = cull.cull_requested_at
            next_start = connection.execute(
                sa.select(sa.func.min(INTERVALS.c.start_at)).where(
                    INTERVALS.c.user == cull.user, INTERVALS.c.team == cull.team,
                    INTERVALS.c.start_at >= after)).scalar()
            until = min(after + RECLAIM_CAP, end, next_start if next_start is not None else end)
            seconds = max(0, int((until - after).total_seconds()))
            reclaimed[cull.team] = reclaimed.get(cull.team, Fraction(0)) + periods.gpu_hours(
                Fraction(cull.share_num, cull.share_den), seconds)
    return {team: IdleFigures(idle.get((team, "server"), Fraction(0)), idle.get((team, "job"), Fraction(0)),
                              culled.get(team, 0), reclaimed.get(team, Fraction(0)))
            for team in sorted({team for team, _ in idle} | set(culled))}
