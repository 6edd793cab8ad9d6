"""`gpupool usage export`: the ledger's usage of a period as a workload that `gpupool replay` reads back.

One row per run of a server or a job (a run continued after a stale close is several intervals of the ledger:
they are joined again): when it was asked for (`arrival`: its start less its queue wait), when it ran, who, on
what, and how it ended, clipped to the period as its bill counts it (a run from the month before starts at the
period's first instant, one going on past its end ends there). Reserved holdings that never ran are not usage
and are left out; a run still going ends at the export's time, with `how` = `running`.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from datetime import datetime, timedelta

from gpupool.hub.accounting.ledger import Interval, Ledger
from gpupool.policies import periods

USAGE_HEADER = ["arrival", "start", "end", "user", "team", "profile", "model", "share", "kind", "how"]


def _iso(moment: datetime) -> str:
    return periods.ensure_utc(moment).isoformat().replace("+00:00", "Z")


def usage_rows(intervals: Iterable[Interval], now: datetime, within: tuple[datetime, datetime] | None = None
               ) -> list[dict[str, str]]:
    """The runs of `intervals` as rows of `USAGE_HEADER`, in order of arrival; with `within` ([start, end)),
    each clipped to it, as a bill counts it."""
    runs: dict[str, list[Interval]] = {}
    for interval in intervals:
        if not interval.is_reserved:
            runs.setdefault(interval.run or interval.key, []).append(interval)
    rows = []
    for pieces in runs.values():
        pieces.sort(key=lambda i: i.start)
        first, last = pieces[0], max(pieces, key=lambda i: i.end or now)
        still = any(i.end is None for i in pieces)
        start, end = first.start, now if still else last.end
        arrival = start - (first.queue_wait or timedelta(0))
        if within is not None:
            arrival, start = max(within[0], arrival), max(within[0], start)
            still, end = still or end > within[1], min(end, within[1])  # it ran on past the period's end
        rows.append({
            "arrival": _iso(arrival), "start": _iso(start), "end": _iso(end), "user": first.user,
            "team": first.team, "profile": first.profile, "model": first.model, "share": str(first.share),
            "kind": first.kind, "how": "running" if still else (last.how or ""),
        })
    rows.sort(key=lambda r: (r["arrival"], r["start"], r["user"]))
    return rows


def usage_csv(ledger: Ledger, period: str, now: datetime | None = None) -> str:
    """The runs that used the pool in `period` (YYYY-MM, UTC) as CSV; ValueError for a malformed period."""
    start, end = periods.period_bounds(period)
    now = now or periods.utcnow()
    out = io.StringIO()
    writer = csv.DictWriter(out, USAGE_HEADER, lineterminator="\n")
    writer.writeheader()
    writer.writerows(usage_rows(ledger.intervals_overlapping(start, end), now, (start, end)))
    return out.getvalue()
