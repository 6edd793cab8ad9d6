"""Time for the accounting: the one `utcnow()`, billing periods (UTC calendar months) and month splitting.

Every time the ledger, admission and bills handle is timezone-aware UTC. Naive datetimes are refused:
an hour of ambiguity in a bill is an hour somebody pays for twice. Tests move time by replacing
`utcnow` in this module (callers always look it up here, never keep a copy).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fractions import Fraction

#: A billing period: one UTC calendar month, written ``YYYY-MM``.
PERIOD = re.compile(r"(\d{4})-(0[1-9]|1[0-2])")
SECONDS_PER_HOUR = 3600


def utcnow() -> datetime:
    """The current time, timezone-aware UTC. The only place the accounting reads the clock."""
    return datetime.now(UTC)


def ensure_utc(value: datetime, what: str = "time") -> datetime:
    """`value` as UTC; ValueError for a naive datetime or a non-datetime."""
    if not isinstance(value, datetime):
        raise ValueError(f"{what} must be a timezone-aware datetime, got {type(value).__name__} {value!r}")
    if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
        raise ValueError(
            f"{what} {value.isoformat()} has no timezone (accepted: timezone-aware datetimes, "
            "e.g. datetime(2026, 11, 1, tzinfo=UTC))"
        )
    return value.astimezone(UTC)


def period_of(moment: datetime) -> str:
    """The billing period ``YYYY-MM`` that contains `moment`."""
    moment = ensure_utc(moment)
    return f"{moment.year:04d}-{moment.month:02d}"


def parse_period(period: str) -> tuple[int, int]:
    """(year, month) of ``YYYY-MM``; ValueError naming the accepted form."""
    match = PERIOD.fullmatch(period) if isinstance(period, str) else None
    if match is None:
        raise ValueError(f"{period!r} is not a billing period (accepted: a UTC calendar month YYYY-MM, e.g. 2026-11)")
    return int(match.group(1)), int(match.group(2))


def _month_start(year: int, month: int) -> datetime:
    return datetime(year, month, 1, tzinfo=UTC)


def period_bounds(period: str) -> tuple[datetime, datetime]:
    """[start, end) of `period`: midnight UTC on the 1st to midnight UTC on the 1st of the next month."""
    year, month = parse_period(period)
    return _month_start(year, month), _next_month_start(year, month)


def _next_month_start(year: int, month: int) -> datetime:
    return _month_start(year + month // 12, month % 12 + 1)


def next_period(period: str) -> str:
    return period_of(period_bounds(period)[1])


def period_reset(period: str) -> str:
    """When the budget of `period` resets, for people: ``2026-12-01 00:00 UTC``."""
    return period_bounds(period)[1].strftime("%Y-%m-%d %H:%M UTC")


@dataclass(frozen=True)
class MonthPiece:
    """The part of an interval that falls in one billing period."""

    period: str
    start: datetime
    end: datetime

    @property
    def duration(self) -> timedelta:
        return self.end - self.start


def split_by_month(start: datetime, end: datetime) -> list[MonthPiece]:
    """[start, end) cut at every UTC month boundary, in order; [] for an empty interval.

    The pieces are contiguous (each starts where the previous ended), do not overlap, and their
    durations add up to end − start exactly.
    """
    start, end = ensure_utc(start, "start"), ensure_utc(end, "end")
    if end < start:
        raise ValueError(f"end {end.isoformat()} is before start {start.isoformat()}")
    pieces = []
    cursor = start
    while cursor < end:
        boundary = _next_month_start(cursor.year, cursor.month)
        piece_end = min(boundary, end)
        pieces.append(MonthPiece(period_of(cursor), cursor, piece_end))
        cursor = piece_end
    return pieces


def gpu_hours(share: Fraction, seconds: int | Fraction) -> Fraction:
    """GPU-hours of holding `share` of a card for `seconds`, exactly."""
    return Fraction(share) * Fraction(seconds) / SECONDS_PER_HOUR


def to_epoch_seconds(moment: datetime, what: str = "time") -> int:
    """Whole seconds since 1970-01-01 UTC, rounded down (the ledger's resolution)."""
    return (ensure_utc(moment, what) - EPOCH) // timedelta(seconds=1)


def from_epoch_seconds(seconds: int) -> datetime:
    return EPOCH + timedelta(seconds=int(seconds))


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
