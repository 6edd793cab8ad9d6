"""The idle culler's clock as an end-to-end test moves it (`IdleCuller.clock_offset_file`), instead of waiting out
idle windows on the wall clock.

The culler starts `behind` the system clock and the test moves it forward, one step at a time, each step seen by a
look of the culler before the next (`step_until`). It never gets ahead of the system clock, so the culler's
records (idle time, culls) lie in the past of the other processes, whose reports and pages read the system clock.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import requests

from harness import Hub, wait_for


class CullerClock:
    """The offset file the culler reads at every look, and the time it makes."""

    def __init__(self, path: Path, behind: timedelta):
        self.path = path
        self.offset = -behind
        self._write()

    @property
    def culler_args(self) -> list[str]:
        """The culler's command-line option naming the file (its admin's configuration)."""
        return [f"--IdleCuller.clock_offset_file={self.path}"]

    def _write(self) -> None:
        # Whole, never half-written: the culler refuses an offset smaller than the one before.
        part = self.path.with_suffix(".part")
        part.write_text(f"{self.offset.total_seconds():.0f}\n")
        os.replace(part, self.path)

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset

    def advance(self, minutes: float) -> datetime:
        """Let `minutes` pass at once for the culler; its time then."""
        self.offset += timedelta(minutes=minutes)
        assert self.offset <= timedelta(0), f"the culler's clock would get ahead of the system's ({self.offset})"
        self._write()
        return self.now()


def seen_by_culler(hub: Hub, token: str) -> dict:
    """The token's user's server as the culler last saw it (its API); {} when it lists none (never seen, or
    stopped or being culled)."""
    reply = requests.get(f"{hub.url}/services/culler/api/servers", headers={"Authorization": f"token {token}"},
                         timeout=60)
    assert reply.status_code == 200, reply.text
    servers = reply.json()["servers"]
    return servers[0] if servers else {}


def looked_at(hub: Hub, user: str, token: str, moment: datetime, timeout: float = 120) -> dict:
    """`user`'s server as a look of the culler at `moment` or later saw it; {} once the hub runs it no more."""
    # The ledger keeps whole seconds: a row stamped with the second `moment` falls in may come from a look that
    # began before `moment` (before what the test just did, such as a keep), so the next whole second it is.
    floor = moment.replace(microsecond=0) + (timedelta(seconds=1) if moment.microsecond else timedelta(0))

    def seen():
        row = seen_by_culler(hub, token)
        if row:
            return row if datetime.fromisoformat(row["seen_at"]) >= floor else None
        # Not listed: not looked at yet, or being culled (then stopping), or gone.
        return {"gone": True} if hub.server(user) is None else None

    row = wait_for(seen, timeout=timeout, every=0.2,
                   message=f"the culler never looked at {user}'s server at {moment} or later")
    return {} if row.get("gone") else row


def step_until(hub: Hub, user: str, token: str, clock: CullerClock, done, minutes: float, most: float) -> dict:
    """Let the culler's time pass `minutes` at a time, each step seen by one of its looks at `user`'s server, until
    `done(row)` holds for the server as it saw it (a row of `seen_by_culler`; {} once the hub runs it no more);
    that row. At most `most` minutes in all: more fails the test, saying what the culler saw last."""
    row, moved = looked_at(hub, user, token, clock.now()), 0.0
    while not done(row):
        assert moved < most, f"what the test waits for never came in {moved} minutes of the culler's time: {row}"
        row = looked_at(hub, user, token, clock.advance(minutes))
        moved += minutes
    return row
