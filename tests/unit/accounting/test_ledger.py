"""The ledger on SQLite and PostgreSQL: idempotent writes, exact sums clipped to periods, schema, concurrency."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool.hub.accounting import db
from gpupool.hub.accounting.ledger import INTERVALS, CloseResult, HowEnded, Ledger, OpenResult, UsageRow
from gpupool.policies import periods
from gpupool.policies.admission import Alert

F = Fraction


def t(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def rows(ledger: Ledger) -> list[tuple]:
    with ledger.engine.connect() as connection:
        return [tuple(r) for r in connection.execute(sa.select(INTERVALS).order_by(INTERVALS.c.key))]


START = t(2026, 11, 3, 10)


def open_quarter(ledger: Ledger, key: str = "alice/:1", start: datetime = START, **kwargs) -> OpenResult:
    args = {"user": "alice", "team": "vision", "profile": "h200-quarter", "model": "H200", "share": F(1, 4)}
    args.update(kwargs)
    return ledger.open_interval(key, args["user"], args["team"], args["profile"], args["model"], args["share"], start)


# --- idempotent writes ---------------------------------------------------------------------------------------


def test_the_same_open_and_close_twice_changes_nothing(ledger):
    assert open_quarter(ledger) is OpenResult.OPENED
    after_open = rows(ledger)
    assert open_quarter(ledger) is OpenResult.EXISTS
    assert rows(ledger) == after_open

    assert ledger.close_interval("alice/:1", t(2026, 11, 3, 20), "stopped") is CloseResult.CLOSED
    after_close = rows(ledger)
    assert ledger.close_interval("alice/:1", t(2026, 11, 3, 20), HowEnded.STOPPED) is CloseResult.ALREADY_CLOSED
    # A late or repeated close with another end does not move the first one.
    assert ledger.close_interval("alice/:1", t(2026, 11, 4), "culled") is CloseResult.ALREADY_CLOSED
    assert open_quarter(ledger) is OpenResult.EXISTS
    assert rows(ledger) == after_close
    interval = ledger.interval("alice/:1")
    assert (interval.end, interval.how, interval.share) == (t(2026, 11, 3, 20), "stopped", F(1, 4))
    assert ledger.gpu_hours("2026-11") == {("vision",): F(5, 2)}  # 0.25 × 10 h


def test_closing_an_unknown_interval_is_a_no_op(ledger):
    assert ledger.close_interval("nobody/:1", t(2026, 11, 3), "stopped") is CloseResult.UNKNOWN
    assert rows(ledger) == []


def test_a_key_names_one_interval(ledger):
    open_quarter(ledger)
    before = rows(ledger)
    with pytest.raises(ValueError, match=r"already names another interval \(it differs in user, share\)"):
        open_quarter(ledger, user="bob", share=F(1, 2))
    assert rows(ledger) == before


@pytest.mark.parametrize(("change", "message"), [
    ({"share": 0.25}, r"share must be exact: a Fraction, an int, a Decimal or text"),
    ({"share": F(0)}, r"share must be above 0"),
    ({"share": "a lot"}, r"'a lot' is not a share"),
    ({"share": F(1, 2**31)}, r"terms beyond 2\^31 - 1"),
    ({"start": datetime(2026, 11, 3, 10)}, r"start 2026-11-03T10:00:00 has no timezone"),
    ({"key": ""}, r"key must be a non-empty string"),
    ({"user": "x" * 256}, r"user 'x+'… is longer than 255 characters"),
    ({"team": "vi\x00sion"}, r"contains a NUL character"),
])
def test_bad_input_is_refused_and_nothing_is_written(ledger, change, message):
    args = {"key": "k", "user": "alice", "team": "vision", "profile": "p", "model": "H200", "share": F(1, 4),
            "start": t(2026, 11, 3)}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        ledger.open_interval(**args)
    assert rows(ledger) == []


def test_bad_closes_are_refused_and_nothing_changes(ledger):
    open_quarter(ledger)
    before = rows(ledger)
    with pytest.raises(ValueError, match=r"'lost' is not how an interval ends \(accepted: stopped, culled, failed, "
                                         r"preempted, reconciled\)"):
        ledger.close_interval("alice/:1", t(2026, 11, 4), "lost")
    with pytest.raises(ValueError, match="is before its start"):
        ledger.close_interval("alice/:1", t(2026, 11, 2), "stopped")
    with pytest.raises(ValueError, match="no timezone"):
        ledger.close_interval("alice/:1", datetime(2026, 11, 4), "stopped")
    assert rows(ledger) == before


def test_decimal_and_text_shares_are_stored_exactly(ledger):
    open_quarter(ledger, "a", share=Decimal("0.25"))
    open_quarter(ledger, "b", share="1/7")
    open_quarter(ledger, "c", share=2)
    assert [ledger.interval(k).share for k in "abc"] == [F(1, 4), F(1, 7), F(2)]


# --- sums clipped to periods ------------------------------------------------------------------------------------


def test_an_interval_open_across_a_period_boundary(ledger):
    ledger.open_interval("dave/:1", "dave", "vision", "h200-half", "H200", F(1, 2), t(2026, 10, 31, 22))
    now = t(2026, 11, 1, 3)
    # Still open: October gets its 2 hours, November the 3 hours so far.
    assert ledger.gpu_hours("2026-10", now=now) == {("vision",): F(1)}
    assert ledger.gpu_hours("2026-11", now=now) == {("vision",): F(3, 2)}
    assert ledger.gpu_hours("2026-12", now=now) == {}
    assert [i.key for i in ledger.open_intervals()] == ["dave/:1"]
    ledger.close_interval("dave/:1", t(2026, 11, 1, 6), "culled")
    later = t(2027, 1, 1)
    assert ledger.gpu_hours("2026-10", now=later) == {("vision",): F(1)}
    assert ledger.gpu_hours("2026-11", now=later) == {("vision",): F(3)}
    assert ledger.open_intervals() == []


def test_sums_by_team_user_model_and_profile_are_exact(ledger):
    ledger.open_interval("a", "alice", "vision", "h200-mig", "H200", F(1, 7), t(2026, 11, 1))
    ledger.close_interval("a", t(2026, 11, 1, 7), "stopped")  # 1/7 × 7 h = 1
    ledger.open_interval("b", "bob", "vision", "h200-mig", "H200", F(1, 7), t(2026, 11, 2))
    ledger.close_interval("b", t(2026, 11, 2, 1), "stopped")  # 1/7 × 1 h
    ledger.open_interval("c", "bob", "nlp", "a100-whole", "A100-80GB", F(1), t(2026, 11, 2))
    ledger.close_interval("c", t(2026, 11, 2, 0, 20), "failed")  # 1 × 20 min = 1/3
    period = "2026-11"
    assert ledger.gpu_hours(period, ()) == {(): F(1) + F(1, 7) + F(1, 3)}
    assert ledger.gpu_hours(period, ("team",)) == {("vision",): F(8, 7), ("nlp",): F(1, 3)}
    assert ledger.gpu_hours(period, ("user",)) == {("alice",): F(1), ("bob",): F(1, 7) + F(1, 3)}
    assert ledger.gpu_hours(period, ("model", "profile")) == {
        ("H200", "h200-mig"): F(8, 7), ("A100-80GB", "a100-whole"): F(1, 3)
    }
    assert ledger.gpu_hours(period, ("user",), team="nlp") == {("bob",): F(1, 3)}
    assert ledger.usage_rows(period, team="vision") == [
        UsageRow("vision", "alice", "H200", "h200-mig", F(1)), UsageRow("vision", "bob", "H200", "h200-mig", F(1, 7)),
    ]
    assert ledger.gpu_hours("2026-10", ()) == {(): F(0)}
    with pytest.raises(ValueError, match=r"cannot sum by \['team', 'gpu'\] \(accepted: any of team, user"):
        ledger.gpu_hours(period, ("team", "gpu"))
    with pytest.raises(ValueError, match="YYYY-MM"):
        ledger.gpu_hours("November")


def test_open_intervals_count_up_to_utcnow(ledger, monkeypatch):
    open_quarter(ledger, start=t(2026, 11, 3, 10))
    monkeypatch.setattr(periods, "utcnow", lambda: t(2026, 11, 3, 14))
    assert ledger.gpu_hours("2026-11") == {("vision",): F(1)}
    monkeypatch.setattr(periods, "utcnow", lambda: t(2026, 11, 3, 18))
    assert ledger.gpu_hours("2026-11") == {("vision",): F(2)}
    # Before the interval started (a clock behind the event) counts nothing rather than something negative.
    assert ledger.gpu_hours("2026-11", now=t(2026, 11, 3, 9)) == {}


hours = st.integers(min_value=0, max_value=24 * 120)
share_strategy = st.sampled_from([F(1, 7), F(1, 4), F(1, 3), F(1, 2), F(1), F(2), F(33, 100)])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(hours, st.integers(0, 3599), st.integers(0, 24 * 70 * 3600), share_strategy),
                min_size=1, max_size=6))
def test_sql_clipping_is_split_by_month(ledger, intervals):
    team = f"t{uuid.uuid4().hex[:12]}"  # each example its own team in the same database
    base = t(2026, 9, 1)
    now = t(2026, 12, 20)
    expected: dict[str, Fraction] = {}
    for i, (start_h, start_s, length_s, share) in enumerate(intervals):
        start = base + timedelta(hours=start_h, seconds=start_s)
        end = start + timedelta(seconds=length_s)
        ledger.open_interval(f"{team}/{i}", "u", team, "p", "H200", share, start)
        if end <= now and i % 3:  # some stay open, counted to `now`
            ledger.close_interval(f"{team}/{i}", end, "stopped")
        else:
            end = max(start, now)
        for piece in periods.split_by_month(start, end):
            seconds = piece.duration // timedelta(seconds=1)
            expected[piece.period] = expected.get(piece.period, F(0)) + periods.gpu_hours(share, seconds)
    for period in ("2026-08", "2026-09", "2026-10", "2026-11", "2026-12", "2027-01"):
        got = ledger.gpu_hours(period, (), team=team, now=now)[()]
        assert got == expected.get(period, F(0))
        assert got == sum((i.gpu_hours(period, now) for i in ledger.open_intervals(team)), F(0)) + sum(
            (ledger.interval(f"{team}/{j}").gpu_hours(period, now) for j in range(len(intervals))
             if not ledger.interval(f"{team}/{j}").is_open), F(0))


# --- heartbeats and reconciliation --------------------------------------------------------------------------------


def test_heartbeats_and_reconciliation_close_what_stopped_reporting(ledger):
    open_quarter(ledger, "alive", start=t(2026, 11, 3, 10))
    open_quarter(ledger, "gone", start=t(2026, 11, 3, 10))
    assert ledger.heartbeat("alive", t(2026, 11, 3, 12))
    assert ledger.heartbeat("alive", t(2026, 11, 3, 11))  # late heartbeat: last_seen does not go back
    assert ledger.heartbeat("gone", t(2026, 11, 3, 10, 30))
    assert not ledger.heartbeat("unknown", t(2026, 11, 3, 12))
    assert ledger.interval("alive").last_seen == t(2026, 11, 3, 12)

    assert ledger.reconcile(timedelta(minutes=30), now=t(2026, 11, 3, 12, 10)) == ["gone"]
    gone = ledger.interval("gone")
    assert (gone.end, gone.how) == (t(2026, 11, 3, 10, 30), "reconciled")
    assert ledger.reconcile(timedelta(minutes=30), now=t(2026, 11, 3, 12, 10)) == []
    assert not ledger.heartbeat("gone", t(2026, 11, 3, 13))  # closed intervals take no heartbeats
    assert [i.key for i in ledger.open_intervals()] == ["alive"]
    with pytest.raises(ValueError, match="positive timedelta"):
        ledger.reconcile(timedelta(0))


# --- alert log ---------------------------------------------------------------------------------------------------


def test_each_alert_is_claimed_once_per_team_scope_threshold_and_period(ledger):
    eighty = Alert("vision", "2026-11", "", Decimal("0.8"), F(80), Decimal(100))
    hundred = Alert("vision", "2026-11", "", Decimal("1.0"), F(100), Decimal(100))
    h200 = Alert("vision", "2026-11", "H200", Decimal("0.80"), F(48), Decimal(60))
    assert ledger.claim_alerts([eighty]) == [eighty]
    assert ledger.claim_alerts([eighty, hundred, h200]) == [hundred, h200]
    assert ledger.claim_alerts([eighty, hundred, h200]) == []
    next_month = Alert("vision", "2026-12", "", Decimal("0.8"), F(80), Decimal(100))
    assert ledger.claim_alerts([next_month]) == [next_month]


# --- concurrent writers -------------------------------------------------------------------------------------------


def run_together(n: int, work):
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return results


def test_concurrent_writers_of_the_same_events(ledger):
    opened = run_together(20, lambda i: open_quarter(ledger))
    assert sorted(opened) == [OpenResult.EXISTS] * 19 + [OpenResult.OPENED]
    closed = run_together(20, lambda i: ledger.close_interval("alice/:1", t(2026, 11, 3, 11 + i % 5), "stopped"))
    assert closed.count(CloseResult.CLOSED) == 1 and closed.count(CloseResult.ALREADY_CLOSED) == 19
    assert len(rows(ledger)) == 1
    alert = Alert("vision", "2026-11", "", Decimal("0.8"), F(80), Decimal(100))
    claimed = run_together(20, lambda i: ledger.claim_alerts([alert]))
    assert sum(len(c) for c in claimed) == 1


# --- schema, engines and migrations ----------------------------------------------------------------------------------


def test_migrations_build_exactly_the_models(ledger):
    with ledger.engine.connect() as connection:
        dialect = connection.dialect.name

        def include(obj, name, kind, reflected, compare_to) -> bool:
            return not (kind == "index" and name in db.POSTGRESQL_ONLY_INDEXES and dialect != "postgresql")

        context = MigrationContext.configure(connection, opts={"version_table": db.VERSION_TABLE,
                                                               "compare_type": True, "include_object": include})
        assert compare_metadata(context, db.Base.metadata) == []
    assert db.current_revision(ledger.engine) == db.head_revision()


def test_migrate_is_repeatable_and_reversible(ledger):
    open_quarter(ledger)
    db.migrate(ledger.engine)  # a second start: nothing to do, nothing lost
    assert len(rows(ledger)) == 1
    db.downgrade(ledger.engine, "base")
    assert not sa.inspect(ledger.engine).has_table("accounting_intervals")
    db.migrate(ledger.engine)
    assert rows(ledger) == []


def test_an_unmigrated_database_is_not_taken_for_a_ledger(database_url):
    empty = db.create_engine(database_url)
    empty.connect().close()  # the database exists (for SQLite: the file), but holds no ledger
    empty.dispose()
    needs = db.head_revision()
    with pytest.raises(ValueError, match=rf"schema revision none \(no ledger there\), this gpupool needs {needs}"):
        Ledger(database_url, migrate=False)


def test_postgresql_knows_how_many_groups_a_bill_has(postgres_server):
    # Without these statistics PostgreSQL sorts a month on disk instead of hashing it (see migration 0002).
    with Ledger(postgres_server.create_database()) as ledger, ledger.engine.connect() as connection:
        names = connection.exec_driver_sql("SELECT stxname FROM pg_statistic_ext").scalars().all()
    assert names == ["accounting_intervals_bill_groups"]


def test_sqlite_runs_in_wal_mode_with_foreign_keys_and_a_busy_timeout(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    with ledger.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == db.SQLITE_BUSY_TIMEOUT_MS
    ledger.dispose()


def test_an_in_memory_sqlite_ledger_is_one_database():
    with Ledger("sqlite://") as ledger:
        open_quarter(ledger)
        assert len(ledger.open_intervals()) == 1


@pytest.mark.parametrize(("url", "message"), [
    ("mysql://root@localhost/gpupool", r"not 'mysql'"),
    ("postgresql+psycopg2://u@h/d", r"not 'postgresql\+psycopg2'"),
    ("not a url", r"is not a database URL"),
])
def test_only_sqlite_and_postgresql_with_psycopg(url, message):
    with pytest.raises(ValueError, match=message + r".*accepted: sqlite:///PATH or postgresql\+psycopg://"):
        db.create_engine(url)


def test_a_plain_postgresql_url_means_psycopg_3():
    assert db.create_engine("postgresql://u@localhost/d").dialect.driver == "psycopg"


def test_queue_waits_count_only_runs_that_waited(ledger):
    """One run waited 63 s, three were placed at once: "1 run waited, 63 s", not "4 runs, 15.8 s on average"."""
    for n, wait in enumerate([63, 0, 0, 0]):
        ledger.keep_run(f"alice/@{n}", "alice", "vision", "h200-quarter", "H200", F(1, 4), START, START,
                        queue_wait=timedelta(seconds=wait))
    waits = ledger.queue_waits("2026-11")["vision"]
    assert (waits.count, waits.mean_s, waits.longest_s) == (1, 63, 63)
    assert ledger.queue_waits("2026-11", team="nlp") == {}
