"""The restart rules of training jobs: preemption and the platform never count, failures count up to
`max_restarts` with a doubling back-off, and exit codes can be listed as never- or always-retry."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpupool.policies.model import Restarts
from gpupool.policies.restarts import ON_EVENT, Action, Ended, Event, Next, after_run, backoff

RULES = Restarts(max_restarts=3, backoff_seconds=10, max_backoff_seconds=60, never_retry_exit_codes=[2],
                 always_retry_exit_codes=[75])


def test_every_event_has_an_action():
    assert set(ON_EVENT) == set(Event)


def test_a_failure_restarts_with_a_doubling_back_off_until_the_limit():
    outcomes = [after_run(Ended(Event.FAILED, 1), counted=n, max_restarts=3, rules=RULES) for n in range(4)]
    assert outcomes == [
        Next(Action.RESTART, True, 10, "failed (exit code 1): restart 1 of 3"),
        Next(Action.RESTART, True, 20, "failed (exit code 1): restart 2 of 3"),
        Next(Action.RESTART, True, 40, "failed (exit code 1): restart 3 of 3"),
        Next(Action.FAIL, False, 0, "failed (exit code 1) after 3 restarts"),
    ]
    assert backoff(RULES, 10) == 60  # capped
    assert after_run(Ended(Event.FAILED, -9), counted=0, max_restarts=0, rules=RULES) == \
        Next(Action.FAIL, False, 0, "failed (killed by signal 9) with no restarts allowed")


def test_exit_codes_listed_as_never_or_always_retry():
    assert after_run(Ended(Event.FAILED, 2), counted=0, max_restarts=3, rules=RULES) == \
        Next(Action.FAIL, False, 0, "failed (exit code 2: never retried, policy jobs.restarts)")
    assert after_run(Ended(Event.FAILED, 75), counted=3, max_restarts=3, rules=RULES) == \
        Next(Action.RESTART, False, 60, "failed (exit code 75: always retried, not counted)")


def test_what_is_not_the_jobs_fault_requeues_and_never_counts():
    for event in (Event.PREEMPTED, Event.NODE_LOST, Event.PLATFORM_RESTART):
        outcome = after_run(Ended(event, -15), counted=3, max_restarts=3, rules=RULES)
        assert (outcome.action, outcome.counts, outcome.delay_seconds) == (Action.REQUEUE, False, 0)
        assert outcome.reason.startswith(f"{event}: ") and "not a retry" in outcome.reason
    assert after_run(Ended(Event.SUSPENDED), counted=0, max_restarts=0, rules=RULES).action is Action.SUSPEND
    assert after_run(Ended(Event.CANCELLED, -15), counted=0, max_restarts=3, rules=RULES).action is Action.CANCEL
    assert after_run(Ended(Event.SUCCEEDED, 0), counted=1, max_restarts=3, rules=RULES) == \
        Next(Action.COMPLETE, False, 0, "finished (exit code 0)")


@given(st.lists(st.sampled_from(list(Event)), max_size=40), st.integers(0, 5),
       st.lists(st.integers(-15, 3), min_size=40, max_size=40))
def test_a_job_never_restarts_more_than_allowed_for_its_own_failures(events, max_restarts, codes):
    counted = 0
    for event, code in zip(events, codes):
        outcome = after_run(Ended(event, code), counted=counted, max_restarts=max_restarts, rules=RULES)
        assert outcome.counts == (event is Event.FAILED and outcome.action is Action.RESTART
                                  and code not in RULES.always_retry_exit_codes)
        counted += outcome.counts
        assert counted <= max_restarts
        if outcome.action in (Action.COMPLETE, Action.FAIL, Action.CANCEL):
            break
        assert 0 <= outcome.delay_seconds <= RULES.max_backoff_seconds
