"""Billing periods: UTC calendar months, splitting intervals at month boundaries, refusing naive times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.policies import periods
from gpupool.policies.periods import (
    MonthPiece, next_period, parse_period, period_bounds, period_of, period_reset, split_by_month,
)


def t(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def test_period_bounds_and_reset():
    assert period_bounds("2026-11") == (t(2026, 11, 1), t(2026, 12, 1))
    assert period_bounds("2026-12") == (t(2026, 12, 1), t(2027, 1, 1))
    assert period_bounds("2028-02") == (t(2028, 2, 1), t(2028, 3, 1))
    assert next_period("2026-12") == "2027-01"
    assert period_reset("2026-11") == "2026-12-01 00:00 UTC"


def test_period_of_converts_other_timezones_to_utc():
    # 00:30 on 1 December in UTC+1 is still November in UTC.
    assert period_of(datetime(2026, 12, 1, 0, 30, tzinfo=timezone(timedelta(hours=1)))) == "2026-11"
    assert period_of(t(2026, 11, 30, 23, 59, 59)) == "2026-11"
    assert period_of(t(2026, 12, 1)) == "2026-12"


@pytest.mark.parametrize("bad", ["2026-13", "2026-00", "2026-1", "26-11", "2026-11-01", " 2026-11", "", None, 202611])
def test_bad_periods_say_what_is_accepted(bad):
    with pytest.raises(ValueError, match="YYYY-MM"):
        parse_period(bad)


def test_naive_times_are_refused():
    with pytest.raises(ValueError, match="no timezone"):
        period_of(datetime(2026, 11, 1))
    with pytest.raises(ValueError, match="no timezone"):
        split_by_month(datetime(2026, 11, 1), t(2026, 12, 1))
    with pytest.raises(ValueError, match="timezone-aware datetime"):
        periods.ensure_utc("2026-11-01")  # type: ignore[arg-type]


def test_split_within_one_month():
    assert split_by_month(t(2026, 11, 3, 10), t(2026, 11, 3, 12)) == [
        MonthPiece("2026-11", t(2026, 11, 3, 10), t(2026, 11, 3, 12))
    ]


def test_split_at_month_end():
    assert split_by_month(t(2026, 10, 31, 23), t(2026, 11, 1, 2)) == [
        MonthPiece("2026-10", t(2026, 10, 31, 23), t(2026, 11, 1)),
        MonthPiece("2026-11", t(2026, 11, 1), t(2026, 11, 1, 2)),
    ]


def test_split_ending_exactly_at_a_boundary_has_no_empty_piece():
    assert split_by_month(t(2026, 11, 30, 22), t(2026, 12, 1)) == [
        MonthPiece("2026-11", t(2026, 11, 30, 22), t(2026, 12, 1))
    ]
    assert split_by_month(t(2026, 12, 1), t(2026, 12, 1)) == []


def test_split_over_the_leap_day_2028():
    pieces = split_by_month(t(2028, 2, 28, 12), t(2028, 3, 1, 6))
    assert pieces == [
        MonthPiece("2028-02", t(2028, 2, 28, 12), t(2028, 3, 1)),
        MonthPiece("2028-03", t(2028, 3, 1), t(2028, 3, 1, 6)),
    ]
    assert pieces[0].duration == timedelta(hours=36)  # 12 h of the 28th + the whole 29th


def test_split_spanning_several_months_and_a_year_end():
    pieces = split_by_month(t(2026, 11, 15), t(2027, 2, 10))
    assert [(p.period, p.start, p.end) for p in pieces] == [
        ("2026-11", t(2026, 11, 15), t(2026, 12, 1)),
        ("2026-12", t(2026, 12, 1), t(2027, 1, 1)),
        ("2027-01", t(2027, 1, 1), t(2027, 2, 1)),
        ("2027-02", t(2027, 2, 1), t(2027, 2, 10)),
    ]
    assert pieces[1].duration == timedelta(days=31)


def test_split_refuses_an_end_before_the_start():
    with pytest.raises(ValueError, match="before start"):
        split_by_month(t(2026, 11, 2), t(2026, 11, 1))


moments = st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2035, 12, 31),
                       timezones=st.just(UTC))


@settings(max_examples=300, deadline=None)
@given(moments, st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=800)))
def test_pieces_are_contiguous_disjoint_and_add_up(start, length):
    end = start + length
    pieces = split_by_month(start, end)
    if length == timedelta(0):
        assert pieces == []
        return
    assert pieces[0].start == start and pieces[-1].end == end
    for before, after in zip(pieces, pieces[1:], strict=False):
        assert before.end == after.start  # contiguous, hence not overlapping
        assert after.start == period_bounds(after.period)[0]  # cut exactly at midnight UTC on the 1st
    for piece in pieces:
        low, high = period_bounds(piece.period)
        assert low <= piece.start < piece.end <= high
    assert len({p.period for p in pieces}) == len(pieces)
    assert sum((p.duration for p in pieces), timedelta(0)) == length


def test_utcnow_is_aware_utc():
    now = periods.utcnow()
    assert now.tzinfo is not None and now.utcoffset() == timedelta(0)
