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
from typing import Any

import sqlalchemy as sa

from gpupool.hub.accounting import db
from gpupool.hub.accounting.idleness import IdleRecord

IDLE = db.IdleServer.__table__
INTERVALS = db.UsageInterval.__table__


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

    @property
    def label(self) -> str:
        return f"server {self.server!r}" if self.server else "your default server"


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
            current = connection.execute(sa.select(IDLE).where(IDLE.c.run == run)).first()
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

    def request_cull(self, run: str, at: datetime, reason: str) -> None:
        with self._writer.begin() as connection:
            connection.execute(IDLE.update().where(IDLE.c.run == run).values(cull_requested_at=at,
                                                                             cull_reason=reason))

    def cull_failed(self, run: str) -> None:
        """The hub did not stop it: a later stop by its user is not a cull."""
        with self._writer.begin() as connection:
            connection.execute(IDLE.update().where(IDLE.c.run == run).values(cull_requested_at=None,
                                                                             cull_reason=""))
