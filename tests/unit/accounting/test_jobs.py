"""Training jobs in the ledger's database (SQLite and PostgreSQL): submissions checked against the policy, one
row per run, the restart rules applied in the same transaction, and every change applied once."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from pydantic import ValidationError

from gpupool.hub.accounting import db
from gpupool.hub.accounting.jobs import (
    JobRefused, JobStore, JobSubmission, collapse_progress, priority_order, resolve,
)
from gpupool.policies.restarts import Ended, Event

T0 = datetime(2026, 12, 4, 9, 0, tzinfo=UTC)


@pytest.fixture
def jobs_policy(make_policy):
    return make_policy(teams={"vision": {"job_priorities": ["low", "normal", "high"]}},
                       jobs={"restarts": {"max_restarts": 2, "backoff_seconds": 10, "never_retry_exit_codes": [2]}})


@pytest.fixture
def store(ledger) -> JobStore:
    return JobStore(ledger.engine)


def submit(store, policy, user="alice", teams=("vision",), key=None, at=T0, **asked):
    submission = JobSubmission(**{"profile": "h200-quarter", "command": ["python", "train.py"], **asked})
    return store.submit(user, resolve(policy, user, teams, submission), submission, at, key=key)


# --- submissions -------------------------------------------------------------------------------------------

def test_a_submission_gets_the_policys_defaults(jobs_policy):
    resolved = resolve(jobs_policy, "alice", ["nlp", "vision"], JobSubmission(profile="h200-half", command=["x"]))
    assert (resolved.team, resolved.priority, resolved.preemptible, resolved.max_restarts) == \
        ("vision", "normal", False, 2)  # the first of her teams the profile is offered to
    spot = resolve(jobs_policy, "alice", ["vision"], JobSubmission(profile="h200-quarter-spot", command=["x"]))
    assert spot.preemptible  # the profile's


@pytest.mark.parametrize(("asked", "teams", "message", "status"), [
    ({"profile": "h300"}, ["vision"], "no profile 'h300' (options: a100-whole, cpu, h200-half", 400),
    ({"profile": "h200-half"}, ["nlp"], "profile 'h200-half' is not offered to your teams (nlp); it is for: vision", 403),
    ({"team": "nlp"}, ["vision"], "alice is not a member of team 'nlp' (your teams: vision)", 403),
    ({"team": "nlp", "profile": "cpu", "priority": "high"}, ["nlp"],
     "team 'nlp' may not run high-priority jobs (allowed: low, normal)", 403),
    ({"max_restarts": 5}, ["vision"], "max_restarts 5 is above the policy's 2 (jobs.restarts.max_restarts)", 400),
    ({"profile": "h200-quarter-spot", "preemptible": False}, ["vision"], "is preemptible: its jobs are too", 400),
])
def test_a_submission_the_policy_does_not_allow_is_refused_saying_why(jobs_policy, asked, teams, message, status):
    submission = JobSubmission(**{"profile": "h200-quarter", "command": ["python"], **asked})
    with pytest.raises(JobRefused) as refused:
        resolve(jobs_policy, "alice", teams, submission)
    assert message in str(refused.value) and refused.value.status == status


@pytest.mark.parametrize(("asked", "message"), [
    ({"command": []}, "at least 1 item"),
    ({"command": [" "]}, "the command's program is empty"),
    ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "CUDA_VISIBLE_DEVICES is set by the platform"),
    ({"env": {"GPUPOOL_TEAM": "nlp"}}, "GPUPOOL_TEAM is set by the platform"),
    ({"env": {"1X": "y"}}, "'1X' is not an environment variable name"),
    ({"workdir": "relative/dir"}, "'relative/dir' is not an absolute path"),
    ({"max_restarts": -1}, "greater than or equal to 0"),
    ({"priority": "urgent"}, "'low', 'normal' or 'high'"),
    ({"gpus": 8}, "Extra inputs are not permitted"),
])
def test_a_malformed_submission_is_refused_by_its_model(asked, message):
    with pytest.raises(ValidationError, match=message):
        JobSubmission(**{"profile": "cpu", "command": ["python"], **asked})


def test_a_submission_is_stored_queued_and_idempotent_by_key(store, jobs_policy):
    job = submit(store, jobs_policy, key="k1", env={"SEED": "7"}, workdir="/home/alice")
    assert (job.state, job.reason, job.runs, job.restarts, job.command, job.env) == \
        ("queued", "in queue", 0, 0, ("python", "train.py"), {"SEED": "7"})
    assert submit(store, jobs_policy, key="k1") == job  # a retried request: the same job
    assert submit(store, jobs_policy, user="carol", key="k1").id != job.id  # keys are per user
    assert len(store.jobs()) == 2
    assert store.get("not-an-id") is None and store.get("0" * 12) is None


def test_the_queue_orders_by_team_and_job_priority_then_time(store, jobs_policy):
    order = priority_order(jobs_policy)
    low = submit(store, jobs_policy, priority="low", at=T0)
    normal = submit(store, jobs_policy, at=T0 + timedelta(seconds=1))
    high = submit(store, jobs_policy, priority="high", at=T0 + timedelta(seconds=2))
    nlp = submit(store, jobs_policy, user="bob", teams=("nlp",), at=T0 - timedelta(hours=1))
    # vision 100 + offsets (0, 10, 20) against nlp 50 + 10
    assert [j.id for j in store.waiting(T0 + timedelta(minutes=1), order)] == [high.id, normal.id, low.id, nlp.id]


# --- runs and restarts -------------------------------------------------------------------------------------

def test_failures_restart_with_back_off_then_the_job_fails_with_the_last_reason(store, jobs_policy):
    job = submit(store, jobs_policy)
    order = priority_order(jobs_policy)
    at = T0
    for attempt in (1, 2, 3):
        run = store.start_run(job.id, at, pid=100 + attempt, pid_started_ms=1)
        assert run.attempt == attempt
        assert store.start_run(job.id, at) is None  # it runs: no second start of the same attempt
        at += timedelta(minutes=5)
        following = store.end_run(job.id, attempt, Ended(Event.FAILED, 1), at, jobs_policy)
        assert store.end_run(job.id, attempt, Ended(Event.FAILED, 1), at, jobs_policy) is None  # once
        job = store.get(job.id)
        if attempt < 3:
            assert (job.state, job.restarts, following.delay_seconds) == ("restarting", attempt, 10 * 2 ** (attempt - 1))
            assert store.waiting(at, order) == []  # its back-off runs
            at += timedelta(seconds=following.delay_seconds)
            assert [j.id for j in store.waiting(at, order)] == [job.id]
    assert (job.state, job.exit_code, job.reason) == ("failed", 1, "failed (exit code 1) after 2 restarts")
    assert job.ended_at == at
    runs = store.runs(job.id)
    assert [(r.attempt, r.event, r.counted) for r in runs] == [(1, "failed", True), (2, "failed", True),
                                                               (3, "failed", False)]
    assert all(r.ended_at > r.started_at for r in runs)


def test_preemption_and_platform_restarts_requeue_at_their_place_and_never_count(store, jobs_policy):
    order = priority_order(jobs_policy)
    job = submit(store, jobs_policy, max_restarts=0)
    later = submit(store, jobs_policy, at=T0 + timedelta(minutes=1))
    for attempt, event in enumerate((Event.PREEMPTED, Event.PLATFORM_RESTART, Event.NODE_LOST), start=1):
        store.start_run(job.id, T0 + timedelta(minutes=10 * attempt))
        store.end_run(job.id, attempt, Ended(event, -15), T0 + timedelta(minutes=10 * attempt + 5), jobs_policy)
        job = store.get(job.id)
        assert (job.state, job.restarts) == ("queued", 0)
        # back at the head of its priority: ahead of the job submitted after it
        assert [j.id for j in store.waiting(T0 + timedelta(hours=1), order)] == [job.id, later.id]
    assert [(r.event, r.counted) for r in store.runs(job.id)] == [
        ("preempted", False), ("platform-restart", False), ("node-lost", False)]
    store.start_run(job.id, T0 + timedelta(hours=2))
    store.end_run(job.id, 4, Ended(Event.SUCCEEDED, 0), T0 + timedelta(hours=3), jobs_policy)
    assert store.get(job.id).state == "succeeded"


def test_a_job_cancelled_while_queued_never_starts(store, jobs_policy):
    job = submit(store, jobs_policy)
    cancelled = store.cancel(job.id, T0 + timedelta(minutes=1))
    assert (cancelled.state, cancelled.reason) == ("cancelled", "cancelled while queued: it never ran")
    assert store.start_run(job.id, T0 + timedelta(minutes=2)) is None
    assert store.runs(job.id) == [] and store.waiting(T0 + timedelta(hours=1), priority_order(jobs_policy)) == []
    assert store.cancel(job.id, T0 + timedelta(minutes=3)) == cancelled  # again: nothing changes


def test_a_running_job_cancelled_ends_as_cancelled_however_its_process_ended(store, jobs_policy):
    job = submit(store, jobs_policy)
    store.start_run(job.id, T0)
    marked = store.cancel(job.id, T0 + timedelta(minutes=1))
    assert (marked.state, marked.cancel_requested) == ("running", True)
    # The runner's SIGTERM ended it with a failure-looking code: still a cancel, never a restart.
    store.end_run(job.id, 1, Ended(Event.FAILED, -15), T0 + timedelta(minutes=2), jobs_policy)
    job = store.get(job.id)
    assert (job.state, job.restarts, store.runs(job.id)[0].event) == ("cancelled", 0, "cancelled")


def test_a_queued_job_suspended_keeps_its_place_and_never_starts_until_resumed(store, jobs_policy):
    first = submit(store, jobs_policy)
    second = submit(store, jobs_policy, at=T0 + timedelta(minutes=1))
    held = store.suspend(first.id, T0 + timedelta(minutes=2))
    assert (held.state, held.reason) == ("suspended", "suspended by its user: resumes from its last checkpoint "
                                                      "when resumed")
    assert store.start_run(first.id, T0 + timedelta(minutes=3)) is None
    assert [j.id for j in store.waiting(T0 + timedelta(hours=1), priority_order(jobs_policy))] == [second.id]
    assert store.suspend(first.id, T0 + timedelta(minutes=4)) == held  # again: nothing changes
    resumed = store.resume(first.id, T0 + timedelta(minutes=5))
    assert (resumed.state, resumed.queued_at) == ("queued", first.queued_at)  # its place, ahead of the second
    assert [j.id for j in store.waiting(T0 + timedelta(hours=1), priority_order(jobs_policy))] == [first.id, second.id]
    assert store.resume(first.id, T0 + timedelta(minutes=6)) == resumed


def test_a_running_job_suspended_is_held_after_its_run_ends_and_the_suspend_never_counts(store, jobs_policy):
    job = submit(store, jobs_policy)
    store.start_run(job.id, T0)
    marked = store.suspend(job.id, T0 + timedelta(minutes=1))
    assert (marked.state, marked.suspend_requested, marked.reason) == ("running", True, "suspending: stopping its run")
    # The runner's SIGTERM ended it with a failure-looking code: a suspend, not a failure, not a restart.
    store.end_run(job.id, 1, Ended(Event.FAILED, -15), T0 + timedelta(minutes=2), jobs_policy)
    held = store.get(job.id)
    assert (held.state, held.restarts, held.suspend_requested, store.runs(job.id)[0].event) == (
        "suspended", 0, False, "suspended")
    assert store.runs(job.id)[0].counted is False
    resumed = store.resume(job.id, T0 + timedelta(minutes=3))
    assert resumed.state == "queued" and store.start_run(job.id, T0 + timedelta(minutes=4)).attempt == 2


def test_a_running_job_being_suspended_is_not_resumed_until_it_is_suspended(store, jobs_policy):
    job = submit(store, jobs_policy)
    store.start_run(job.id, T0)
    marked = store.suspend(job.id, T0 + timedelta(minutes=1))
    assert store.resume(job.id, T0 + timedelta(minutes=1)) == marked  # its run is still stopping
    store.end_run(job.id, 1, Ended(Event.SUSPENDED, -15), T0 + timedelta(minutes=2), jobs_policy)
    assert store.resume(job.id, T0 + timedelta(minutes=3)).state == "queued"


def test_a_job_suspended_in_its_back_off_still_waits_for_the_rest_of_it(store, jobs_policy):
    job = submit(store, jobs_policy)
    store.start_run(job.id, T0)
    store.end_run(job.id, 1, Ended(Event.FAILED, 1), T0, jobs_policy)  # back-off: 10 s (the policy's)
    assert store.get(job.id).state == "restarting"
    store.suspend(job.id, T0 + timedelta(seconds=1))
    resumed = store.resume(job.id, T0 + timedelta(seconds=2))
    assert (resumed.state, resumed.not_before) == ("restarting", T0 + timedelta(seconds=10))
    assert store.waiting(T0 + timedelta(seconds=5), priority_order(jobs_policy)) == []
    assert [j.id for j in store.waiting(T0 + timedelta(seconds=10), priority_order(jobs_policy))] == [job.id]


def test_a_cancel_wins_over_a_suspend_and_an_ended_job_is_neither(store, jobs_policy):
    job = submit(store, jobs_policy)
    store.start_run(job.id, T0)
    store.suspend(job.id, T0 + timedelta(minutes=1))
    store.cancel(job.id, T0 + timedelta(minutes=1))
    store.end_run(job.id, 1, Ended(Event.FAILED, -15), T0 + timedelta(minutes=2), jobs_policy)
    ended = store.get(job.id)
    assert ended.state == "cancelled"
    assert store.suspend(job.id, T0 + timedelta(minutes=3)) == ended == store.resume(job.id, T0 + timedelta(minutes=3))


def test_a_running_job_is_found_again_with_its_process(store, jobs_policy):
    job = submit(store, jobs_policy)
    store.start_run(job.id, T0, holding="alice/job")
    store.set_process(job.id, 1, pid=4242, pid_started_ms=1_700_000_000_123)
    ((found, run),) = store.running()
    assert found.id == job.id and (run.pid, run.pid_started_ms, run.holding) == (4242, 1_700_000_000_123, "alice/job")


def test_concurrent_starts_of_one_job_start_it_once(store, jobs_policy):
    job = submit(store, jobs_policy)
    started, barrier = [], threading.Barrier(8)

    def start():
        barrier.wait()
        started.append(store.start_run(job.id, T0))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len([r for r in started if r is not None]) == 1
    assert len(store.runs(job.id)) == 1 and store.get(job.id).runs == 1


def test_the_tables_refuse_what_no_code_path_writes(store, jobs_policy):
    job = submit(store, jobs_policy)
    with pytest.raises(sa.exc.IntegrityError):
        with store.engine.begin() as connection:
            connection.execute(db.Job.__table__.update().values(state="lost"))
    with pytest.raises(sa.exc.IntegrityError):
        with store.engine.begin() as connection:  # ended without being in a final state
            connection.execute(db.Job.__table__.update().values(ended_at=T0))
    assert store.get(job.id).state == "queued"


def test_the_run_events_are_the_restart_rules_events():
    assert tuple(Event) == db.RUN_EVENTS


# --- the Kubernetes mode's logs ---------------------------------------------------------------------------------


def test_a_jobs_log_is_its_pieces_in_order_read_from_any_offset_and_counted_per_source(store, jobs_policy):
    job, other = submit(store, jobs_policy), submit(store, jobs_policy, user="bob")
    store.keep_log(job.id, "pod-a", b"step 1\nstep", T0)
    store.keep_log(other.id, "pod-x", b"bob's\n", T0)
    store.keep_log(job.id, "pod-a", b" 2\n", T0 + timedelta(seconds=1))
    store.keep_log(job.id, "pod-b", b"resumed\n", T0 + timedelta(seconds=2))
    store.keep_log(job.id, "pod-b", b"", T0)  # nothing to keep: no piece
    whole = b"step 1\nstep 2\nresumed\n"
    assert store.read_log(job.id, 0, 1 << 20) == whole
    assert all(store.read_log(job.id, start, size) == whole[start:start + size]
               for start in range(len(whole) + 2) for size in (1, 3, 8, 100))
    assert (store.log_kept(job.id, "pod-a"), store.log_kept(job.id, "pod-b"), store.log_kept(job.id, "pod-c")) == (
        14, 8, 0)
    assert store.log_tail(job.id, lines=2) == "step 2\nresumed"
    assert store.log_tail(job.id, lines=5, max_bytes=10) == "resumed"  # the cut first line is left out
    assert store.read_log(other.id, 0, 100) == b"bob's\n" and store.log_tail("nosuchjob") == ""
    # How far each pod's output is kept: the latest source of that pod (after a rotation, `UID@SECONDS`).
    assert store.log_progress(job.id, "pod-a") == ("pod-a", 14, T0 + timedelta(seconds=1))
    store.keep_log(job.id, "pod-a@1796374800", b"after the rotation\n", T0 + timedelta(seconds=9))
    assert store.log_progress(job.id, "pod-a") == ("pod-a@1796374800", 19, T0 + timedelta(seconds=9))
    assert store.log_progress(job.id, "pod-c") is None and store.log_progress(job.id, "pod") is None


def test_a_progress_bar_is_served_at_its_last_state_however_its_pieces_were_kept(store, jobs_policy):
    # What tqdm writes: "\r" and the bar again at every step, the line ended once, when the bar closes.
    bar = b"".join(b"\rtraining: %3d%%|" % p + b"#" * (p // 10) + b"|" for p in range(0, 101, 10))
    job = submit(store, jobs_policy)
    for piece in (b"epoch 1\r\n", bar[:37], bar[37:200], bar[200:] + b"\n", b"done\n"):  # a pod's output, in pieces
        store.keep_log(job.id, "pod-a", piece, T0)
    assert store.log_tail(job.id) == "epoch 1\ntraining: 100%|##########|\ndone"
    whole = store.read_log(job.id, 0, 1 << 20)
    assert collapse_progress(whole) == b"epoch 1\ntraining: 100%|##########|\ndone\n"
    # A reader following the log while the bar draws: each read of the open line gives its state then; one that
    # starts inside it gives "\r" and the state it is redrawn to (a terminal redraws it), or the text added to it.
    assert collapse_progress(whole[:whole.index(b"training:  30%")]) == b"epoch 1\ntraining:  20%|##|"
    assert collapse_progress(b"\rtraining:  10%|#|\rtraining:  20%|##|", continued=True) == b"\rtraining:  20%|##|"
    assert collapse_progress(b"#|\n", continued=True) == b"#|\n"  # no redraw: the rest of the line as it is
    assert collapse_progress(b"step 3\r", continued=True) == b"step 3"  # a line end's "\r" erases nothing
    assert collapse_progress(b"plain\nlines\n", continued=True) == b"plain\nlines\n"


def test_concurrent_writers_of_one_jobs_log_lose_no_piece(store, jobs_policy):
    job = submit(store, jobs_policy)
    barrier = threading.Barrier(6)

    def write(source: str):
        barrier.wait()
        for n in range(10):
            store.keep_log(job.id, source, f"{source} {n}\n".encode(), T0)

    threads = [threading.Thread(target=write, args=(f"pod-{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = store.read_log(job.id, 0, 1 << 20).decode().splitlines()
    assert sorted(lines) == sorted(f"pod-{i} {n}" for i in range(6) for n in range(10))
    for i in range(6):  # each writer's pieces in its order
        assert [line for line in lines if line.startswith(f"pod-{i} ")] == [f"pod-{i} {n}" for n in range(10)]
