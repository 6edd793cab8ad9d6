"""What happens to a training job when one of its runs ends: a table of event → action, and the back-off.

Pure (no I/O): the embedded job runner and the Kubernetes job watcher translate what they saw into an
`Ended` event and apply the `Next` this module returns. Only a failure of the job's own program counts
against its `max_restarts`; a preemption, a lost node, a restart of the platform and a user's suspend never
do (Volcano counts evictions as retries: gpupool keeps its own count, with the cause of every restart).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpupool.policies.model import Restarts


class Event(StrEnum):
    """How a run of a job ended."""

    SUCCEEDED = "succeeded"  # the program exited 0
    FAILED = "failed"  # the program exited non-zero, or was killed by a signal nobody sent it
    PREEMPTED = "preempted"  # stopped for higher-priority work (SIGTERM, grace, SIGKILL)
    NODE_LOST = "node-lost"  # the machine or node it ran on went away
    PLATFORM_RESTART = "platform-restart"  # the platform restarted and the run did not survive it
    SUSPENDED = "suspended"  # its user suspended it
    CANCELLED = "cancelled"  # its user (or an admin) cancelled it


class Action(StrEnum):
    """What follows."""

    COMPLETE = "complete"  # the job succeeded
    RESTART = "restart"  # back to the queue after a back-off, resuming from its last checkpoint
    REQUEUE = "requeue"  # back to the head of its priority in the queue at once, resuming
    SUSPEND = "suspend"  # held until its user resumes it
    FAIL = "fail"  # the job failed
    CANCEL = "cancel"  # the job is cancelled


#: The table: what each event leads to before the restart rules look at exit codes and counts.
ON_EVENT: dict[Event, Action] = {
    Event.SUCCEEDED: Action.COMPLETE,
    Event.FAILED: Action.RESTART,
    Event.PREEMPTED: Action.REQUEUE,
    Event.NODE_LOST: Action.REQUEUE,
    Event.PLATFORM_RESTART: Action.REQUEUE,
    Event.SUSPENDED: Action.SUSPEND,
    Event.CANCELLED: Action.CANCEL,
}


@dataclass(frozen=True)
class Ended:
    """A run's end, as the runner saw it. `exit_code`: the program's, or -N when signal N killed it."""

    event: Event
    exit_code: int | None = None


@dataclass(frozen=True)
class Next:
    """What to do after a run ended: `action`, whether it `counts` as a retry, the back-off and why."""

    action: Action
    counts: bool
    delay_seconds: int
    reason: str


def backoff(rules: Restarts, counted: int) -> int:
    """Seconds before the restart that follows `counted` earlier counted restarts: doubling, capped."""
    return min(rules.max_backoff_seconds, rules.backoff_seconds * 2 ** min(counted, 32))


def after_run(ended: Ended, *, counted: int, max_restarts: int, rules: Restarts) -> Next:
    """What follows `ended`, for a job that has had `counted` counted restarts of at most `max_restarts`."""
    action = ON_EVENT[ended.event]
    code = ended.exit_code
    if action is Action.COMPLETE:
        return Next(action, False, 0, "finished (exit code 0)")
    if action is Action.REQUEUE:
        return Next(action, False, 0, f"{ended.event}: resumes from its last checkpoint when room frees (not a retry)")
    if action is Action.SUSPEND:
        return Next(action, False, 0, "suspended by its user: resumes from its last checkpoint when resumed")
    if action is Action.CANCEL:
        return Next(action, False, 0, "cancelled")
    exited = f"exit code {code}" if code is not None and code >= 0 else (
        f"killed by signal {-code}" if code is not None else "ended without an exit code")
    if code is not None and code in rules.never_retry_exit_codes:
        return Next(Action.FAIL, False, 0, f"failed ({exited}: never retried, policy jobs.restarts)")
    if code is not None and code in rules.always_retry_exit_codes:
        return Next(Action.RESTART, False, backoff(rules, counted),
                    f"failed ({exited}: always retried, not counted)")
    if counted >= max_restarts:
        tried = f"after {counted} restart{'s' if counted != 1 else ''}" if counted else "with no restarts allowed"
        return Next(Action.FAIL, False, 0, f"failed ({exited}) {tried}")
    return Next(Action.RESTART, True, backoff(rules, counted),
                f"failed ({exited}): restart {counted + 1} of {max_restarts}")
