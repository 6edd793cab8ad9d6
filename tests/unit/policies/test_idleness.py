"""The idle culler's decision (pure) and its records in the ledger: warned before every stop, active servers
never stopped, "keep it" bounded by the policy, a cull ending the run's interval `culled`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.hub.accounting.culls import IdleStore, idle_figures
from gpupool.hub.accounting.ledger import HowEnded, Ledger
from gpupool.policies.idleness import Action, IdleRecord, KeepRefused, Signals, decide, keep
from gpupool.policies.model import Idle

T0 = datetime(2026, 12, 5, 9, 0, tzinfo=UTC)
RULE = Idle(after_minutes=60, warn_minutes=10, gpu_below_percent=1, cpu_below_percent=5, keep_max_hours=2)
QUIET = Signals(gpu_percent=0.0, cpu_percent=0.5, busy_kernels=0)


def minutes(n: float) -> timedelta:
    return timedelta(minutes=n)


def run_looks(rule: Idle, looks: list[tuple[float, Signals]], record: IdleRecord | None = None):
    record = record or IdleRecord(started=T0, last_active=T0)
    decisions = []
    for at, signals in looks:
        decision = decide(rule, signals, record, T0 + minutes(at))
        record = decision.record
        decisions.append(decision)
    return decisions


def test_an_idle_server_is_warned_then_culled_at_its_time():
    decisions = run_looks(RULE, [(m, QUIET) for m in (1, 49, 50, 55, 60)])
    assert [d.action for d in decisions] == [Action.IDLE, Action.IDLE, Action.WARN, Action.WARNED, Action.CULL]
    warn = decisions[2]
    assert warn.cull_at == T0 + minutes(60) and warn.cause == "idle"
    assert "idle for 50 min" in warn.message and "stopped at 10:00 UTC" in warn.message
    assert "idle for 1 h 0 min" in decisions[-1].message


@pytest.mark.parametrize("busy", [
    Signals(gpu_percent=30.0, cpu_percent=0.0, busy_kernels=0),  # a CUDA loop with no HTTP activity
    Signals(gpu_percent=0.0, cpu_percent=90.0, busy_kernels=0),  # CPU-bound preprocessing
    Signals(gpu_percent=None, gpu_note="time-slicing", cpu_percent=0.0, busy_kernels=1),  # a cell running
])
def test_a_server_doing_something_is_never_warned(busy):
    decisions = run_looks(RULE, [(m, busy) for m in range(0, 200, 7)])
    assert {d.action for d in decisions} == {Action.ACTIVE}


def test_activity_after_the_warning_ends_it():
    decisions = run_looks(RULE, [(50, QUIET), (52, Signals(gpu_percent=80.0)), (60, QUIET), (102, QUIET),
                                 (112, QUIET)])
    assert [d.action for d in decisions] == [Action.WARN, Action.ACTIVE, Action.IDLE, Action.WARN, Action.CULL]
    assert decisions[1].record.warned_at is None
    assert decisions[3].cull_at == T0 + minutes(112)  # 60 minutes after the GPU was last busy


def test_jupyter_activity_counts_but_never_from_the_future():
    typed = Signals(gpu_percent=0.0, cpu_percent=0.0, busy_kernels=0, jupyter_activity=T0 + minutes(30))
    (decision,) = run_looks(RULE, [(40, typed)])
    assert decision.record.last_active == T0 + minutes(30) and decision.cull_at == T0 + minutes(90)
    clock_skew = Signals(gpu_percent=0.0, jupyter_activity=T0 + minutes(500))
    (decision,) = run_looks(RULE, [(40, clock_skew)])
    assert decision.record.last_active == T0 + minutes(40)


def test_a_culler_that_was_down_warns_first_and_culls_warn_minutes_later():
    decisions = run_looks(RULE, [(300, QUIET), (305, QUIET), (310, QUIET)])
    assert [d.action for d in decisions] == [Action.WARN, Action.WARNED, Action.CULL]
    assert decisions[0].cull_at == T0 + minutes(310)


def test_unknown_signals_are_left_out_not_guessed():
    # The GPU unknown (time-slicing), the rest idle: idle as far as the known signals tell, warned then culled.
    partial = Signals(gpu_percent=None, gpu_note="no per-process samples", cpu_percent=0.5, busy_kernels=0)
    assert [d.action for d in run_looks(RULE, [(50, partial), (60, partial)])] == [Action.WARN, Action.CULL]
    # Nothing readable at all: never stopped on no evidence.
    unknown = Signals(gpu_percent=None, cpu_percent=None, busy_kernels=None)
    assert {d.action for d in run_looks(RULE, [(m, unknown) for m in (50, 60, 500)])} == {Action.ACTIVE}


def test_a_rule_turned_off_ends_its_warning_and_turned_on_again_warns_anew():
    off = RULE.model_copy(update={"enabled": False})
    warned = run_looks(RULE, [(50, QUIET)])[0].record
    exempt = decide(off, QUIET, warned, T0 + minutes(55))
    assert exempt.action is Action.EXEMPT and exempt.record.warned_at is None
    again = decide(RULE, QUIET, exempt.record, T0 + minutes(240))
    assert again.action is Action.WARN and again.cull_at == T0 + minutes(250)


def test_times_beyond_a_year_are_refused_by_the_policy():
    for field, value in (("after_minutes", 10**10), ("max_age_hours", 10**9), ("keep_max_hours", 10**12)):
        with pytest.raises(ValueError, match=f"{field} must be at most"):
            Idle.model_validate({field: value})


def test_keep_it_postpones_within_the_policy_and_is_then_refused():
    record = run_looks(RULE, [(50, QUIET)])[0].record
    kept = keep(RULE, record, T0 + minutes(51), timedelta(hours=1.5))
    assert kept.keep_until == T0 + minutes(141) and kept.kept == timedelta(hours=1.5) and kept.warned_at is None
    decisions = run_looks(RULE, [(60, QUIET), (130, QUIET), (131, QUIET), (141, QUIET)], kept)
    assert [d.action for d in decisions] == [Action.IDLE, Action.IDLE, Action.WARN, Action.CULL]
    more = keep(RULE, decisions[2].record, T0 + minutes(132), timedelta(hours=4))
    assert more.kept == timedelta(hours=2)  # 1.5 h + the 0.5 h left of keep_max_hours
    assert more.keep_until == T0 + minutes(171)  # added to the keep still running (until 141)
    with pytest.raises(KeepRefused, match="the most its policy allows"):
        keep(RULE, more, T0 + minutes(133), timedelta(hours=1))


def test_max_age_stops_even_a_busy_server_warned_first():
    rule = Idle(after_minutes=60, warn_minutes=10, max_age_hours=Decimal(2))
    busy = Signals(gpu_percent=50.0)
    decisions = run_looks(rule, [(100, busy), (110, busy), (115, busy), (120, busy)])
    assert [d.action for d in decisions] == [Action.ACTIVE, Action.WARN, Action.WARNED, Action.CULL]
    assert decisions[1].cause == "max-age" and "has run for 1 h 50 min" in decisions[1].message


def test_a_rule_that_is_off_culls_nothing():
    off = Idle(enabled=False)
    decisions = run_looks(off, [(m, QUIET) for m in (10, 100, 1000)])
    assert {d.action for d in decisions} == {Action.EXEMPT} and decisions[0].cull_at is None
    with pytest.raises(KeepRefused, match="never culled"):
        keep(off, decisions[0].record, T0, timedelta(hours=1))


looks = st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["quiet", "gpu", "kernel", "keep"])), max_size=40)


@settings(max_examples=300, deadline=None)
@given(looks)
def test_every_cull_comes_warn_minutes_after_a_warning_and_after_minutes_after_activity(steps):
    record, now = IdleRecord(started=T0, last_active=T0), T0
    last_activity, warned_at = T0, None
    for gap, what in steps:
        now += minutes(gap)
        if what == "keep":
            try:
                record = keep(RULE, record, now, timedelta(minutes=30))
                warned_at = None
            except KeepRefused:
                pass
            continue
        signals = {"quiet": QUIET, "gpu": Signals(gpu_percent=40.0), "kernel": Signals(busy_kernels=2)}[what]
        decision = decide(RULE, signals, record, now)
        if what != "quiet":
            last_activity, warned_at = now, None
            assert decision.action is Action.ACTIVE
        if decision.action is Action.WARN:
            warned_at = now
        if decision.action is Action.CULL:
            assert warned_at is not None and now - warned_at >= minutes(10)
            assert now - last_activity >= minutes(60)
            assert record.keep_until is None or now >= record.keep_until
            break
        record = decision.record


# --- the records in the ledger's database ----------------------------------------------------------------------


@pytest.fixture
def ledger(tmp_path):
    return Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")


def test_a_culled_run_ends_culled_and_a_users_own_stop_stays_stopped(ledger):
    store = IdleStore(ledger.engine)
    for run in ("run-a", "run-b"):
        ledger.keep_run(run, "alice", "vision", "h200-quarter", "H200", Fraction(1, 4), T0, T0)
        decision = decide(RULE, QUIET, IdleRecord(started=T0, last_active=T0), T0 + minutes(50))
        store.save(run, "alice", run[-1], "vision", "h200-quarter", decision.record, T0 + minutes(50),
                   {"message": decision.message})
    assert [s.run for s in store.running("alice")] == ["run-a", "run-b"]
    assert store.request_cull("run-a", T0 + minutes(60), "idle", timedelta(0))
    assert not store.request_cull("run-a", T0 + minutes(60), "idle", timedelta(0))  # asked once
    assert [s.run for s in store.running(None)] == ["run-b"]  # being culled: no longer offered a keep
    ledger.close_run("run-a", T0 + minutes(60), HowEnded.STOPPED)  # what the spawner's stop writes
    ledger.close_run("run-b", T0 + minutes(61), HowEnded.STOPPED)
    how = {i.run: i.how for i in ledger.intervals_overlapping(T0, T0 + minutes(120))}
    assert how == {"run-a": HowEnded.CULLED, "run-b": HowEnded.STOPPED}
    assert store.running("alice") == []  # both ended
    # The report counts the cull, also when asked within the second it was made (the ledger keeps whole seconds).
    figures = idle_figures(ledger.engine, "2026-12", now=T0 + minutes(60) + timedelta(microseconds=300))
    assert figures["vision"].culled == 1


def test_a_keep_granted_during_a_look_is_not_undone_by_it(ledger):
    store = IdleStore(ledger.engine)
    ledger.keep_run("run-a", "alice", "vision", "h200-quarter", "H200", Fraction(1, 4), T0, T0)
    seen = decide(RULE, QUIET, IdleRecord(started=T0, last_active=T0), T0 + minutes(50))
    store.save("run-a", "alice", "", "vision", "h200-quarter", seen.record, T0 + minutes(50), {})
    kept = keep(RULE, store.get("run-a").record, T0 + minutes(51), timedelta(hours=1))
    store.keep("run-a", kept)
    # The culler's look that began before the keep writes what it saw, without the keep.
    stale = decide(RULE, QUIET, seen.record, T0 + minutes(52))
    store.save("run-a", "alice", "", "vision", "h200-quarter", stale.record, T0 + minutes(52), {})
    record = store.get("run-a").record
    assert record.keep_until == T0 + minutes(111) and record.kept == timedelta(hours=1) and record.warned_at is None
    # A look that read the record before the keep decides to cull: the stop is not asked for (the keep stands).
    assert not store.request_cull("run-a", T0 + minutes(60), "idle", seen.record.kept)
    assert store.get("run-a").cull_requested_at is None
    assert store.request_cull("run-a", T0 + minutes(60), "idle", kept.kept)
    store.cull_failed("run-a")  # the hub did not stop it: a later stop of its user is not a cull
    ledger.close_run("run-a", T0 + minutes(70), HowEnded.STOPPED)
    assert [i.how for i in ledger.intervals_overlapping(T0, T0 + minutes(120))] == [HowEnded.STOPPED]
