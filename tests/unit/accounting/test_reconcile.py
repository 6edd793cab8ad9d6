"""Server runs in the ledger and their reconciliation with the hub's view, on SQLite and PostgreSQL.

`reconcile` is given what the hub's REST API answered (parsed by `servers_of` from real answer shapes);
the end-to-end test against a real hub is tests/e2e/test_accounting_restart.py.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from fractions import Fraction

import pytest

from gpupool.hub.accounting.ledger import (
    INTERVALS, CloseResult, HowEnded, Ledger, RunResult, _interval, job_run_key, run_key, run_kind,
)
from gpupool.hub.accounting.reports import running_servers
from gpupool.hub.accounting.servers import HubServer, reconcile, servers_of, user_groups
from gpupool.policies import periods
from gpupool.policies.admission import AdmissionRequest

Q = Fraction(1, 4)
FACTS = ("alice", "vision", "h200-quarter", "H200", Q)


def t(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def pieces(ledger: Ledger, run: str):
    with ledger.engine.connect() as connection:
        return [_interval(r) for r in connection.execute(
            INTERVALS.select().where(INTERVALS.c.run == run).order_by(INTERVALS.c.start_at))]


def seconds_of(intervals) -> int:
    return sum(int((i.end - i.start).total_seconds()) for i in intervals)


# --- the key ----------------------------------------------------------------------------------------------


def test_the_spawner_and_the_rest_api_compute_the_same_key():
    naive = datetime(2026, 12, 2, 14, 20, 0, 123456)  # orm_spawner.started, as the hub keeps it
    (server,) = servers_of([{"name": "alice", "servers": {"": {"started": "2026-12-02T14:20:00.123456Z",
                                                                "ready": True, "user_options": {}}}}])
    assert run_key("alice", "", naive) == server.run == "alice/@2026-12-02T14:20:00.123456Z"
    # isoformat() leaves out a zero fraction: still the same key
    (whole,) = servers_of([{"name": "a", "servers": {"gpu": {"started": "2026-12-02T14:20:00Z", "ready": True}}}])
    assert whole.run == run_key("a", "gpu", datetime(2026, 12, 2, 14, 20)) == "a/gpu@2026-12-02T14:20:00.000000Z"


def test_keys_are_one_to_one_and_fit_the_ledger():
    start = t(2026, 12, 2, 14)
    assert run_key("alice", "", start) != run_key("alice", "", start + timedelta(microseconds=1))
    long = run_key("x" * 255, "y" * 255, start)
    assert len(long) <= 240 and long.startswith("run-sha256:") and long != run_key("x" * 255, "y" * 254, start)


# --- keeping a run --------------------------------------------------------------------------------------


def test_a_run_opens_once_and_heartbeats(ledger):
    run = run_key("alice", "", t(2026, 11, 3, 10))
    assert ledger.keep_run(run, *FACTS, t(2026, 11, 3, 10, 1), t(2026, 11, 3, 10, 1),
                           queue_wait=timedelta(seconds=42)) is RunResult.OPENED
    assert ledger.keep_run(run, *FACTS, t(2026, 11, 3, 10), t(2026, 11, 3, 10, 5)) is RunResult.RUNNING
    (piece,) = pieces(ledger, run)
    assert piece.key == run and piece.start == t(2026, 11, 3, 10, 1)  # the first writer's start stands
    assert piece.last_seen == t(2026, 11, 3, 10, 5) and piece.queue_wait == timedelta(seconds=42)
    assert ledger.close_run(run, t(2026, 11, 3, 11), HowEnded.STOPPED) is CloseResult.CLOSED
    assert ledger.close_run(run, t(2026, 11, 3, 12), HowEnded.STOPPED) is CloseResult.ALREADY_CLOSED
    assert ledger.close_run("nobody/@x", t(2026, 11, 3, 12), HowEnded.STOPPED) is CloseResult.UNKNOWN
    # a late report of a stopped run changes nothing
    assert ledger.keep_run(run, *FACTS, t(2026, 11, 3, 10), t(2026, 11, 3, 13)) is RunResult.ENDED
    (piece,) = pieces(ledger, run)
    assert piece.end == t(2026, 11, 3, 11) and piece.how == "stopped"


def test_a_reconciled_run_continues_where_it_was_closed(ledger):
    run = run_key("alice", "", t(2026, 11, 3, 10))
    ledger.keep_run(run, *FACTS, t(2026, 11, 3, 10), t(2026, 11, 3, 10, 30))
    assert ledger.reconcile(timedelta(minutes=5), now=t(2026, 11, 3, 11)) == [run]
    assert ledger.keep_run(run, *FACTS, t(2026, 11, 3, 10), t(2026, 11, 3, 11, 2)) is RunResult.CONTINUED
    assert ledger.keep_run(run, *FACTS, t(2026, 11, 3, 10), t(2026, 11, 3, 11, 3)) is RunResult.RUNNING
    ledger.close_run(run, t(2026, 11, 3, 12), HowEnded.STOPPED)
    first, second = pieces(ledger, run)
    assert (first.end, first.how) == (t(2026, 11, 3, 10, 30), "reconciled")
    assert second.key == f"{run}~1" and second.start == first.end, "contiguous: nothing lost, nothing twice"
    assert seconds_of([first, second]) == 2 * 3600


def test_concurrent_callers_continue_a_run_once(ledger):
    run = run_key("alice", "", t(2026, 11, 3, 10))
    ledger.keep_run(run, *FACTS, t(2026, 11, 3, 10), t(2026, 11, 3, 10))
    ledger.close_run(run, None, HowEnded.RECONCILED)
    barrier = threading.Barrier(8)
    results = []

    def report():
        barrier.wait()
        results.append(ledger.keep_run(run, *FACTS, t(2026, 11, 3, 10), t(2026, 11, 3, 11)))

    threads = [threading.Thread(target=report) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(pieces(ledger, run)) == 2
    assert RunResult.CONTINUED in results and set(results) <= {RunResult.CONTINUED, RunResult.RUNNING}


def test_bad_runs_are_refused(ledger):
    with pytest.raises(ValueError, match="run"):
        ledger.keep_run("", *FACTS, t(2026, 11, 3), t(2026, 11, 3))
    with pytest.raises(ValueError, match="queue_wait"):
        ledger.keep_run("a/@x", *FACTS, t(2026, 11, 3), t(2026, 11, 3), queue_wait=timedelta(seconds=-1))
    with pytest.raises(ValueError, match="is not how an interval ends"):
        ledger.close_run("a/@x", None, "vanished")
    assert ledger.open_intervals() == []


# --- reconciliation with the hub's answer -----------------------------------------------------------------


def server(user: str, started: datetime, ready: bool = True, **options) -> HubServer:
    return HubServer(user, "", started, ready, options or {"profile": "h200-quarter", "team": "vision"})


GROUPS = user_groups([{"name": "vision", "users": ["alice", "bob", "carol"]}, {"name": "nlp", "users": ["nadia"]}])


def test_reconcile_opens_what_runs_and_closes_what_is_gone(ledger, policy):
    asked = t(2026, 11, 3, 12)
    alice = server("alice", t(2026, 11, 3, 10))  # running, the ledger never heard of it (a failed write)
    bob = server("bob", t(2026, 11, 3, 11), ready=False)  # still spawning: its spawner opens it
    nadia = server("nadia", t(2026, 11, 3, 9), profile="h200-quarter")  # no team in its options: from groups
    gone = run_key("carol", "", t(2026, 11, 3, 8))  # the hub no longer runs it
    ledger.keep_run(gone, "carol", "vision", "h200-quarter", "H200", Q, t(2026, 11, 3, 8), t(2026, 11, 3, 11, 30))
    late = run_key("dave", "", asked + timedelta(seconds=2))  # started after the hub answered
    ledger.keep_run(late, "dave", "vision", "h200-quarter", "H200", Q, asked + timedelta(seconds=3),
                    asked + timedelta(seconds=3))
    ledger.open_interval("job-1", "erin", "vision", "h200-quarter", "H200", Q, t(2026, 11, 3, 7))  # no run
    stopping = HubServer("frank", "", t(2026, 11, 3, 6), False, {"profile": "h200-quarter", "team": "vision"})
    ledger.keep_run(stopping.run, "frank", "vision", "h200-quarter", "H200", Q, t(2026, 11, 3, 6), t(2026, 11, 3, 11))

    done = reconcile(ledger, policy, [alice, bob, nadia, stopping], GROUPS, asked)
    (still,) = pieces(ledger, stopping.run)
    assert still.is_open and still.last_seen == asked, "a server being stopped still holds its share"

    assert sorted(done.opened) == sorted([alice.run, nadia.run]) and done.closed == [gone]
    (opened,) = pieces(ledger, alice.run)
    assert (opened.start, opened.last_seen, opened.team, opened.share) == (alice.started, asked, "vision", Q)
    assert pieces(ledger, nadia.run)[0].team == "nlp"
    assert pieces(ledger, bob.run) == []
    (closed,) = pieces(ledger, gone)
    assert (closed.end, closed.how) == (t(2026, 11, 3, 11, 30), "reconciled")
    assert {i.key for i in ledger.open_intervals()} == {alice.run, nadia.run, late, "job-1", stopping.run}
    # the same answer again changes nothing
    again = reconcile(ledger, policy, [alice, bob, nadia, stopping], GROUPS, asked)
    assert (again.opened, again.continued, again.closed) == ([], [], [])


def test_servers_the_policy_cannot_account_for_are_reported_not_guessed(ledger, policy):
    foreign = server("alice", t(2026, 11, 3, 10), profile="h200-quarter", team="nlp")  # not alice's team
    unknown = HubServer("bob", "x", t(2026, 11, 3, 10), True, {"profile": "gone-profile"})
    cpu = HubServer("carol", "", t(2026, 11, 3, 10), True, {"profile": "cpu"})
    done = reconcile(ledger, policy, [foreign, unknown, cpu], GROUPS, t(2026, 11, 3, 12))
    assert set(done.unknown) == {foreign.run, unknown.run}
    assert "cannot be charged" in done.unknown[foreign.run] and "No such profile" in done.unknown[unknown.run]
    assert ledger.open_intervals() == []


def test_a_run_across_a_month_boundary_during_a_restart(ledger, policy, monkeypatch):
    """Hub and service down from 23:55 to 00:20: closed at the last heartbeat, continued, split by month."""
    clock = [t(2026, 11, 30, 23, 50)]
    monkeypatch.setattr(periods, "utcnow", lambda: clock[0])
    alice = server("alice", t(2026, 11, 30, 23, 50))
    reconcile(ledger, policy, [alice], GROUPS, clock[0])  # as the spawner or the service would
    clock[0] = t(2026, 11, 30, 23, 55)
    reconcile(ledger, policy, [alice], GROUPS, clock[0])  # last seen before everything went down
    clock[0] = t(2026, 12, 1, 0, 20)  # back up; the stale rule runs before the hub answers
    assert ledger.reconcile(timedelta(minutes=5)) == [alice.run]
    done = reconcile(ledger, policy, [alice], GROUPS, clock[0])
    assert done.continued == [alice.run]
    clock[0] = t(2026, 12, 1, 0, 30)
    ledger.close_run(alice.run, clock[0], HowEnded.STOPPED)
    first, second = pieces(ledger, alice.run)
    assert second.start == first.end == t(2026, 11, 30, 23, 55)
    assert seconds_of([first, second]) == 40 * 60, "every second it ran, once"
    november = ledger.gpu_hours("2026-11", ("user",))[("alice",)]
    december = ledger.gpu_hours("2026-12", ("user",))[("alice",)]
    assert (november, december) == (Q * Fraction(10, 60), Q * Fraction(30, 60))


def test_a_continued_run_is_one_running_server_for_its_user(ledger, policy):
    alice = server("alice", t(2026, 11, 3, 10))
    reconcile(ledger, policy, [alice], GROUPS, t(2026, 11, 3, 10))
    reconcile(ledger, policy, [alice], GROUPS, t(2026, 11, 3, 11))
    ledger.reconcile(timedelta(minutes=5), now=t(2026, 11, 3, 12))  # unseen while the hub was down
    reconcile(ledger, policy, [alice], GROUPS, t(2026, 11, 3, 12))  # continued from 11:00
    (running,) = running_servers(ledger, policy, "alice", now=t(2026, 11, 3, 13))
    assert running["key"] == alice.run and running["since"] == t(2026, 11, 3, 10).isoformat()
    assert running["gpu_hours"] == "0.75"  # 3 h × 0.25, across both intervals
    assert running["cost"] == "2.40"  # × 3.20 EUR, rounded half up like the bills


# --- holdings reserved at admission -------------------------------------------------------------------------


def admitted(ledger: Ledger, policy, user: str, at: datetime) -> str:
    run = run_key(user, "", at)
    result = ledger.admit(policy, AdmissionRequest(user=user, team="vision", at=at, profile="h200-quarter"), run)
    assert result.opened and ledger.interval(run).is_reserved
    return run


def test_a_reserved_holding_is_no_running_server_and_costs_nothing_until_it_runs(ledger, policy):
    run = admitted(ledger, policy, "alice", t(2026, 11, 3, 10))
    assert running_servers(ledger, policy, "alice", now=t(2026, 11, 3, 11)) == []
    assert ledger.intervals_overlapping(t(2026, 11, 3), t(2026, 11, 4), user="alice", team="vision") == []
    assert ledger.gpu_hours("2026-11", ("user",), now=t(2026, 11, 3, 11)) == {}
    assert ledger.holdings().team_user == {("vision", "alice"): Q}  # yet held against the quotas
    # Its pod runs from 11:00 (an hour in Volcano's queue): shown and billed from then on, not from admission.
    assert ledger.keep_run(run, *FACTS, t(2026, 11, 3, 11), t(2026, 11, 3, 11)) is RunResult.OPENED
    (running,) = running_servers(ledger, policy, "alice", now=t(2026, 11, 3, 13))
    assert running["since"] == t(2026, 11, 3, 11).isoformat() and running["gpu_hours"] == "0.5"


def test_a_reserved_holding_nobody_saw_is_reconciled_and_runs_from_when_it_did(ledger, policy):
    run = admitted(ledger, policy, "alice", t(2026, 11, 3, 10))
    ledger.reconcile(timedelta(minutes=5), now=t(2026, 11, 3, 12))  # not seen while it waited: closed unbilled
    assert ledger.open_intervals() == [] and ledger.gpu_hours("2026-11", ("user",), now=t(2026, 11, 3, 12)) == {}
    # The hub's REST API then shows it running (started at 10:00): it runs from 12:30, not from its closed holding
    assert ledger.keep_run(run, *FACTS, t(2026, 11, 3, 12, 30), t(2026, 11, 3, 12, 30)) is RunResult.CONTINUED
    assert ledger.gpu_hours("2026-11", ("user",), now=t(2026, 11, 3, 13, 30)) == {("alice",): Q}


def test_a_training_jobs_run_is_kind_job_and_reconciliation_with_the_hub_leaves_it_alone(ledger, policy):
    # A job is not one of the hub's servers: its runner reports it (keep_run, heartbeats, close_run).
    run = job_run_key("0123456789ab", t(2026, 11, 3, 9))
    assert run == "job:0123456789ab@2026-11-03T09:00:00.000000Z" and run_kind(run) == "job"
    assert run_kind(run_key("alice", "", t(2026, 11, 3, 9))) == "server"
    ledger.keep_run(run, *FACTS, t(2026, 11, 3, 9), t(2026, 11, 3, 11))
    gone = run_key("carol", "", t(2026, 11, 3, 8))
    ledger.keep_run(gone, "carol", "vision", "h200-quarter", "H200", Q, t(2026, 11, 3, 8), t(2026, 11, 3, 11))
    done = reconcile(ledger, policy, [], GROUPS, t(2026, 11, 3, 12))
    assert done.closed == [gone]
    (job,) = pieces(ledger, run)
    assert job.is_open and job.kind == "job" and pieces(ledger, gone)[0].kind == "server"
    # Stale all the same when its runner stops reporting (the hub and its runner down for long): closed then.
    assert ledger.reconcile(timedelta(minutes=5), now=t(2026, 11, 3, 12)) == [run]
    (job,) = pieces(ledger, run)
    assert (job.end, job.how, job.kind) == (t(2026, 11, 3, 11), "reconciled", "job")
    # A continuation (the runner back, the job still running) is a job's too.
    ledger.keep_run(run, *FACTS, t(2026, 11, 3, 9), t(2026, 11, 3, 12, 30))
    assert [p.kind for p in pieces(ledger, run)] == ["job", "job"]
