"""`Ledger.admit` on SQLite and PostgreSQL: 50 concurrent requests never over-admit; reservations; idempotence."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction

import pytest

from gpupool.hub.accounting.ledger import AdmissionResult, CloseResult, Ledger, RunResult, State
from gpupool.policies.admission import AdmissionRequest

AT = datetime(2026, 11, 15, 12, tzinfo=UTC)
CONCURRENT = 50


def request(user: str, profile: str = "h200-quarter", at: datetime = AT, **kwargs) -> AdmissionRequest:
    return AdmissionRequest(user=user, team="vision", at=at, profile=profile, **kwargs)


def used_nine_hours(ledger: Ledger) -> None:
    """bob used a whole H200 for 9 hours earlier this month."""
    start = datetime(2026, 11, 2, tzinfo=UTC)
    ledger.open_interval("bob/:0", "bob", "vision", "h200-whole", "H200", Fraction(1), start)
    ledger.close_interval("bob/:0", start + timedelta(hours=9), "stopped")


def admit_together(ledger: Ledger, policy, profile: str, **kwargs) -> list[AdmissionResult]:
    """50 users ask at the same instant, each from its own thread (and database connection)."""
    barrier = threading.Barrier(CONCURRENT)
    results: list[AdmissionResult | None] = [None] * CONCURRENT
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        try:
            barrier.wait()
            results[i] = ledger.admit(policy, request(f"user{i}", profile, **kwargs), key=f"user{i}/:1")
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(CONCURRENT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


@pytest.mark.parametrize(("profile", "fit"), [("h200-whole", 1), ("h200-quarter", 4), ("h200-mig", 7)])
def test_50_concurrent_requests_for_the_last_share(ledger, make_policy, profile, fit):
    # Team quota 2 cards; bob already holds one: one card is left, asked for by 50 users at once.
    policy = make_policy(teams={"vision": {"quota": {"gpus": 2, "per_user_gpus": None, "per_model": {}}}})
    ledger.open_interval("bob/:1", "bob", "vision", "a100-whole", "A100-80GB", Fraction(1), AT - timedelta(hours=1))
    results = admit_together(ledger, policy, profile)

    admitted = [r for r in results if r.decision.action == "admit"]
    assert len(admitted) == fit and all(r.opened for r in admitted)
    assert sum(r.decision.action == "wait" for r in results) == CONCURRENT - fit
    held = sum((i.share for i in ledger.open_intervals("vision")), Fraction(0))
    assert held <= 2
    assert len(ledger.open_intervals("vision")) == fit + 1
    waiting = next(r for r in results if r.decision.action == "wait")
    assert waiting.decision.reason.startswith('team "vision" holds 2 of 2 GPUs (quota)')


def test_50_concurrent_requests_for_the_last_gpu_hour(ledger, make_policy):
    # 10 GPU-hours a month, 9 used; each request reserves 1 GPU-hour (a whole card for an hour).
    policy = make_policy(teams={"vision": {"quota": None, "budget": {"gpu_hours": 10, "per_model": {},
                                                                     "on_exhausted": "deny"}}})
    used_nine_hours(ledger)
    results = admit_together(ledger, policy, "h200-whole", reserve=timedelta(hours=1))

    admitted = [r for r in results if r.decision.action == "admit"]
    assert len(admitted) == 1
    assert sum(r.decision.action == "deny" for r in results) == CONCURRENT - 1
    assert ledger.usage("2026-11", now=AT).team["vision"] == 10  # 9 used + 1 reserved: never more
    denied = next(r for r in results if r.decision.action == "deny")
    assert denied.decision.reason == ('team "vision": budget of 10 GPU-hours for 2026-11 used: 10 (100%); '
                                      "resets 2026-12-01 00:00 UTC")


def test_each_alert_is_sent_once_however_many_admissions_cross_it(ledger, make_policy):
    policy = make_policy(teams={"vision": {"quota": None, "budget": {"gpu_hours": 10, "per_model": {},
                                                                     "on_exhausted": "alert"}}})
    used_nine_hours(ledger)
    results = admit_together(ledger, policy, "h200-whole", reserve=timedelta(hours=1))

    assert all(r.decision.action == "admit" for r in results)  # `alert` admits beyond the budget
    sent = sorted(a.threshold for r in results for a in r.alerts)
    assert sent == [Decimal("0.5"), Decimal("0.8"), Decimal("1.0")]  # each threshold once, between all 50
    again = ledger.admit(policy, request("late", "h200-whole"), key="late/:1")
    assert again.decision.admitted and again.alerts == ()


def run(ledger: Ledger, key: str, at: datetime) -> RunResult:
    """The admitted workload `key` runs from `at` (as its spawner says when it does)."""
    held = ledger.interval(key)
    return ledger.keep_run(key, held.user, held.team, held.profile, held.model, held.share, at, at)


def test_reservations_count_until_the_interval_has_run_that_long(ledger, policy):
    result = ledger.admit(policy, request("alice", "h200-whole", reserve=timedelta(hours=2)), key="alice/:1")
    assert result.opened and result.decision.admitted
    assert run(ledger, "alice/:1", AT) is RunResult.OPENED
    assert ledger.usage("2026-11", now=AT + timedelta(minutes=30)).team["vision"] == 2  # reserved
    assert ledger.usage("2026-11", now=AT + timedelta(hours=3)).team["vision"] == 3  # ran longer
    # Reports and bills count use, not reservations.
    assert ledger.gpu_hours("2026-11", now=AT + timedelta(minutes=30)) == {("vision",): Fraction(1, 2)}
    ledger.close_interval("alice/:1", AT + timedelta(minutes=30), "failed")
    assert ledger.usage("2026-11", now=AT + timedelta(hours=3)).team["vision"] == Fraction(1, 2)


def test_an_admitted_workload_is_held_from_admission_and_billed_from_when_it_runs(ledger, make_policy):
    # Quota: one card. alice is admitted at AT; her pod waits an hour in Volcano's queue, then runs an hour.
    policy = make_policy(teams={"vision": {"quota": {"gpus": 1, "per_user_gpus": None, "per_model": {}}}})
    assert ledger.admit(policy, request("alice", "h200-whole"), key="alice/:1").decision.admitted
    held = ledger.interval("alice/:1")
    assert (held.state, held.run, held.is_open) == (State.RESERVED, "alice/:1", True)
    # Held: the quota is full for bob while alice's pod waits, though nothing runs yet...
    waiting = ledger.admit(policy, request("bob", "h200-whole", at=AT + timedelta(minutes=30)), key="bob/:1")
    assert (waiting.decision.action, waiting.decision.code) == ("wait", "quota-full")
    assert ledger.holdings().team == {"vision": 1}
    # ... and not billed: no GPU-hour for the hour it waited.
    assert ledger.gpu_hours("2026-11", now=AT + timedelta(hours=1)) == {}
    assert run(ledger, "alice/:1", AT + timedelta(hours=1)) is RunResult.OPENED
    assert run(ledger, "alice/:1", AT + timedelta(hours=1)) is RunResult.RUNNING  # a second report: nothing new
    assert ledger.interval("alice/:1").state is State.RUNNING
    assert ledger.gpu_hours("2026-11", now=AT + timedelta(hours=2)) == {("vision",): Fraction(1)}
    assert ledger.close_run("alice/:1", AT + timedelta(hours=2), "stopped") is CloseResult.CLOSED
    assert ledger.gpu_hours("2026-11", now=AT + timedelta(hours=5)) == {("vision",): Fraction(1)}


def test_a_holding_that_ends_without_running_costs_nothing_and_frees_its_share(ledger, make_policy):
    policy = make_policy(teams={"vision": {"quota": {"gpus": 1, "per_user_gpus": None, "per_model": {}}}})
    assert ledger.admit(policy, request("alice", "h200-whole", reserve=timedelta(hours=1)), key="alice/:1").opened
    assert ledger.usage("2026-11", now=AT).team["vision"] == 1  # budgets count its reservation while it is held
    ledger.close_run("alice/:1", AT + timedelta(minutes=20), "failed")  # its pod never ran
    assert ledger.gpu_hours("2026-11", now=AT + timedelta(hours=1)) == {}
    assert ledger.usage("2026-11", now=AT + timedelta(hours=1)).team == {}
    assert ledger.interval("alice/:1").gpu_hours("2026-11", AT + timedelta(hours=1)) == 0
    assert ledger.admit(policy, request("bob", "h200-whole", at=AT + timedelta(minutes=21)), key="bob/:1").opened
    # A late report that it runs changes nothing: it ended.
    assert run(ledger, "alice/:1", AT + timedelta(minutes=30)) is RunResult.ENDED


def test_admitting_the_same_key_again_changes_nothing(ledger, policy):
    first = ledger.admit(policy, request("alice"), key="alice/:1")
    assert first.opened and first.decision.admitted
    again = ledger.admit(policy, request("alice", at=AT + timedelta(minutes=5)), key="alice/:1")
    assert (again.opened, again.decision.action) == (False, "admit")
    assert again.decision.reason == "already admitted: interval 'alice/:1' is open"
    assert again.decision.code == "already-admitted"
    assert len(ledger.open_intervals()) == 1 and ledger.interval("alice/:1").start == AT
    ledger.close_interval("alice/:1", AT + timedelta(hours=1), "stopped")
    with pytest.raises(ValueError, match="names an interval that has ended; use a new key"):
        ledger.admit(policy, request("alice"), key="alice/:1")


def test_waiting_and_denied_requests_write_no_interval(ledger, make_policy):
    deny = make_policy(teams={"vision": {"budget": {"gpu_hours": 0, "per_model": {}, "on_exhausted": "deny"}}})
    assert ledger.admit(deny, request("alice"), key="alice/:1").decision.action == "deny"
    assert ledger.interval("alice/:1") is None
    policy = make_policy()
    ledger.open_interval("alice/:0", "alice", "vision", "h200-whole", "H200", Fraction(1), AT)
    result = ledger.admit(policy, request("alice"), key="alice/:2")
    assert (result.decision.action, result.opened) == ("wait", False)
    assert ledger.interval("alice/:2") is None


def test_cpu_only_is_admitted_without_an_interval(ledger, policy):
    result = ledger.admit(policy, request("alice", "cpu"), key="alice/:1")
    assert (result.decision.action, result.opened) == ("admit", False)
    assert ledger.open_intervals() == []


def test_bad_requests_write_nothing(ledger, policy):
    with pytest.raises(ValueError, match="unknown team 'robots'"):
        ledger.admit(policy, AdmissionRequest(user="alice", team="robots", at=AT, profile="cpu"), key="k")
    with pytest.raises(ValueError, match="key must be a non-empty string"):
        ledger.admit(policy, request("alice"), key="")
    assert ledger.open_intervals() == []
