"""Training jobs in the ledger's database: a submission checked against the policy, then a job whose every
run (attempt) is recorded, and whose state after a run follows the restart rules (`restarts.after_run`).

Every change is one transaction with a condition on the state it starts from, so that two writers (a
retried request, the runner and a cancel, two hub processes) never both apply: a job starts once per
attempt, a run ends once, a cancel of a job that already ended changes nothing. A submission with the same
idempotency key makes one job. Jobs and runs survive restarts of every process: the runner re-adopts what
the table says is running (`Run.pid`, `Run.pid_started_ms`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal, NamedTuple

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpupool.hub.accounting import db
from gpupool.hub.accounting.ledger import HowEnded
from gpupool.policies.choice import image_way_out
from gpupool.policies.model import JOB_PRIORITIES, Policy
from gpupool.policies.restarts import Action, Ended, Event, Next, after_run

JOBS = db.Job.__table__
RUNS = db.JobRun.__table__
LOGS = db.JobLog.__table__

#: Environment variables a job may not set: the platform's own (its share, its identity, its hub token).
RESERVED_ENV = re.compile(r"(GPUPOOL_|CUDA_|JUPYTERHUB_|MLFLOW_TRACKING_|NVIDIA_).*|PATH|HOME|USER|LOGNAME")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: What a job id looks like (`new_job_id`).
JOB_ID = re.compile(r"[a-f0-9]{12}")

#: The state each action leads to.
STATE_AFTER: dict[Action, str] = {
    Action.COMPLETE: "succeeded", Action.RESTART: "restarting", Action.REQUEUE: "queued",
    Action.SUSPEND: "suspended", Action.FAIL: "failed", Action.CANCEL: "cancelled",
}


def env_problem(name: Any, value: Any) -> str | None:
    """Why a job may not set environment variable `name` to `value`, or None when it may."""
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        return f"{name!r} is not an environment variable name (accepted: letters, digits, _)"
    if RESERVED_ENV.fullmatch(name):
        return (f"{name} is set by the platform (GPUPOOL_*, CUDA_*, JUPYTERHUB_*, MLFLOW_TRACKING_*, NVIDIA_*, "
                "PATH, HOME, USER, LOGNAME cannot be given)")
    if not isinstance(value, str):
        return f"the value of {name} is not a string: {value!r}"
    if "\0" in value:
        return f"the value of {name} contains a NUL character"
    return None


class JobRefused(ValueError):
    """A submission or change the policy or the job's state does not allow; the message says why and what
    is accepted (a 4xx for API clients)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class JobSubmission(BaseModel):
    """What a user asks for (`gpupool jobs submit`, `POST /jobs`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str = Field(description="A profile the team may use, as on the spawn page (`h200-quarter`).")
    team: str | None = Field(None, description="The team the job runs for (default: the user's only team, "
                             "or the first of theirs the profile is offered to).")
    command: list[str] = Field(min_length=1, description="The program and its arguments.")
    max_restarts: int | None = Field(None, ge=0, description="Failed runs restarted (default and upper bound: "
                                     "the policy's `jobs.restarts.max_restarts`).")
    priority: Literal["low", "normal", "high"] | None = Field(
        None, description="Within what the team allows (`teams.NAME.job_priorities`).")
    preemptible: bool | None = Field(None, description="May be preempted by higher-priority work (default: "
                                     "the profile's `preemptible`).")
    checkpoint_dir: str | None = Field(None, description="Where `gpupool.train` keeps the checkpoints "
                                       "(default: a folder of the job's in the team's storage, private).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables.")
    image: str | None = Field(None, description="One of the profile's image choices, as on the spawn page "
                              "(`finetune`; default: the profile's default image).")
    workdir: str | None = Field(None, description="Working directory (default: the user's home).")

    @field_validator("command")
    @classmethod
    def _command(cls, command: list[str]) -> list[str]:
        if not command[0].strip():
            raise ValueError("the command's program is empty")
        if any("\0" in part for part in command):
            raise ValueError("the command contains a NUL character")
        return command

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            problem = env_problem(name, value)
            if problem:
                raise ValueError(problem)
        return env

    @field_validator("workdir", "checkpoint_dir")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        if path is not None and not path.startswith("/"):
            raise ValueError(f"{path!r} is not an absolute path")
        return path


@dataclass(frozen=True)
class Resolved:
    """A submission with the policy's defaults filled in, checked."""

    team: str
    profile: str
    priority: str
    preemptible: bool
    max_restarts: int
    image: str | None = None


def resolve(policy: Policy, user: str, teams: Iterable[str], submission: JobSubmission) -> Resolved:
    """The submission of `user` (member of `teams`) as the policy allows it, or `JobRefused` saying why."""
    teams = list(teams)
    profile = policy.profiles.get(submission.profile)
    if profile is None:
        offered = sorted(policy.profiles_for_teams(set(teams)))
        raise JobRefused(f"no profile {submission.profile!r} (options: {', '.join(offered) or 'none: you are in no team'})")
    if submission.team is not None:
        if submission.team not in teams:
            raise JobRefused(f"{user} is not a member of team {submission.team!r} "
                             f"(your teams: {', '.join(teams) or 'none'})", status=403)
        team = submission.team
    else:
        candidates = [t for t in teams if t in profile.teams]
        if not candidates:
            raise JobRefused(f"profile {submission.profile!r} is not offered to your teams "
                             f"({', '.join(teams) or 'none'}); it is for: {', '.join(profile.teams)}", status=403)
        team = candidates[0]
    if team not in profile.teams:
        raise JobRefused(f"profile {submission.profile!r} is not offered to team {team!r} "
                         f"(it is for: {', '.join(profile.teams)})", status=403)
    allowed = policy.teams[team].job_priorities
    priority = submission.priority or policy.default_job_priority(team)
    if priority not in allowed:
        raise JobRefused(f"team {team!r} may not run {priority}-priority jobs (allowed: {', '.join(allowed)})",
                         status=403)
    ceiling = policy.jobs.restarts.max_restarts
    max_restarts = ceiling if submission.max_restarts is None else submission.max_restarts
    if max_restarts > ceiling:
        raise JobRefused(f"max_restarts {max_restarts} is above the policy's {ceiling} (jobs.restarts.max_restarts)")
    preemptible = profile.preemptible if submission.preemptible is None else submission.preemptible
    if profile.preemptible and not preemptible:
        raise JobRefused(f"profile {submission.profile!r} is preemptible: its jobs are too")
    image = submission.image
    if image is not None and image not in profile.images:
        raise JobRefused(f"profile {submission.profile!r} has no image {image!r} (options: "
                         f"{', '.join(profile.images) or 'none'})"
                         + image_way_out(policy.profiles_for_teams(set(teams)), image))
    if image is None and profile.images:
        image = next((i for i, img in profile.images.items() if img.default), next(iter(profile.images)))
    return Resolved(team, submission.profile, priority, preemptible, max_restarts, image)


#: Kubernetes mode: where a job's checkpoint folder (its `USER/JOB` folder of the policy's `jobs.checkpoint_claim`)
#: is mounted when the submission names none.
DEFAULT_CHECKPOINT_MOUNT = "/checkpoints"
#: Kubernetes mode: the label of a job's Volcano Job and pods that names the job.
JOB_ID_LABEL = "gpupool.io/job-id"

#: How a run's ledger interval ends, by how the run ended (both modes' runners).
LEDGER_END: dict[Event, HowEnded] = {
    Event.SUCCEEDED: HowEnded.STOPPED, Event.FAILED: HowEnded.FAILED, Event.PREEMPTED: HowEnded.PREEMPTED,
    Event.NODE_LOST: HowEnded.FAILED, Event.PLATFORM_RESTART: HowEnded.FAILED, Event.SUSPENDED: HowEnded.STOPPED,
    Event.CANCELLED: HowEnded.STOPPED,
}


def policy_problem(policy: Policy, job: Job) -> str | None:
    """Why a waiting job can no longer run under `policy` (its profile or team is gone), or None."""
    if job.profile not in policy.profiles or job.team not in policy.teams:
        return f"the policy no longer has profile {job.profile!r} or team {job.team!r}"
    return None


def new_job_id() -> str:
    return secrets.token_hex(6)


@dataclass(frozen=True)
class Run:
    job_id: str
    attempt: int
    started_at: datetime
    ended_at: datetime | None
    event: str | None
    exit_code: int | None
    counted: bool
    reason: str
    pid: int | None
    pid_started_ms: int | None
    holding: str | None
    cluster_retry: int | None = None


@dataclass(frozen=True)
class Job:
    id: str
    user: str
    team: str
    profile: str
    priority: str
    preemptible: bool
    command: tuple[str, ...]
    env: Mapping[str, str]
    workdir: str | None
    checkpoint_dir: str | None
    image: str | None
    max_restarts: int
    state: str
    reason: str
    restarts: int
    runs: int
    exit_code: int | None
    cancel_requested: bool
    suspend_requested: bool
    submitted_at: datetime
    queued_at: datetime
    not_before: datetime | None
    ended_at: datetime | None

    @property
    def ended(self) -> bool:
        return self.state in db.JOB_ENDED

    def as_json(self) -> dict[str, Any]:
        """The job as the REST API and `gpupool jobs show --json` give it."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["command"], out["env"] = list(self.command), dict(self.env)
        for key in ("submitted_at", "queued_at", "not_before", "ended_at"):
            out[key] = out[key].isoformat().replace("+00:00", "Z") if out[key] is not None else None
        return out


def _job(row: Any) -> Job:
    values = dict(row._mapping)
    values.pop("submit_key", None)
    values["command"] = tuple(json.loads(values["command"]))
    values["env"] = json.loads(values["env"])
    return Job(**values)


def _run(row: Any) -> Run:
    values = dict(row._mapping)
    values.pop("id", None)
    return Run(**values)


class LogProgress(NamedTuple):
    """How far a pod's output is kept (`JobStore.log_progress`)."""

    source: str
    size: int
    at: datetime


class JobStore:
    """The jobs table of the ledger's database (`engine`: the ledger's, migrated)."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine
        self._writer = db.writer(engine)

    # --- submitting and reading ------------------------------------------------------------------------

    def submit(self, user: str, resolved: Resolved, submission: JobSubmission, at: datetime,
               key: str | None = None, checkpoint_dir: str | None = None) -> Job:
        """A new queued job; with an idempotency `key` already used by `user`, that job (nothing new)."""
        if key is not None:
            key = f"{user}/{key}"
            existing = self._by_key(key)
            if existing is not None:
                return existing
        job_id = new_job_id()
        values = {
            "id": job_id, "submit_key": key, "user": user, "team": resolved.team, "profile": resolved.profile,
            "priority": resolved.priority, "preemptible": resolved.preemptible,
            "command": json.dumps(submission.command), "env": json.dumps(submission.env, sort_keys=True),
            "workdir": submission.workdir, "checkpoint_dir": submission.checkpoint_dir or checkpoint_dir,
            "image": resolved.image,
            "max_restarts": resolved.max_restarts, "state": "queued", "reason": "in queue", "restarts": 0,
            "runs": 0, "exit_code": None, "cancel_requested": False, "suspend_requested": False, "submitted_at": at, "queued_at": at,
            "not_before": None, "ended_at": None,
        }
        try:
            with self._writer.begin() as connection:
                connection.execute(JOBS.insert().values(**values))
        except sa.exc.IntegrityError:
            existing = self._by_key(key) if key is not None else None
            if existing is None:
                raise
            return existing  # the same submission, committed by another writer meanwhile
        return self.get(job_id)

    def _by_key(self, key: str) -> Job | None:
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(JOBS).where(JOBS.c.submit_key == key)).first()
        return None if row is None else _job(row)

    def get(self, job_id: str) -> Job | None:
        if not JOB_ID.fullmatch(job_id or ""):
            return None
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(JOBS).where(JOBS.c.id == job_id)).first()
        return None if row is None else _job(row)

    def jobs(self, *, users: Iterable[str] | None = None, teams: Iterable[str] | None = None,
             states: Iterable[str] | None = None) -> list[Job]:
        """Jobs of any of `users` or any of `teams` (both None: all), newest first."""
        query = sa.select(JOBS)
        who = []
        if users is not None:
            who.append(JOBS.c.user.in_(list(users)))
        if teams is not None:
            who.append(JOBS.c.team.in_(list(teams)))
        if who:
            query = query.where(sa.or_(*who))
        if states is not None:
            query = query.where(JOBS.c.state.in_(list(states)))
        with self.engine.connect() as connection:
            return [_job(r) for r in connection.execute(query.order_by(JOBS.c.submitted_at.desc(), JOBS.c.id))]

    def waiting(self, at: datetime, priority_of: Any) -> list[Job]:
        """Jobs that may be started now (queued, or restarting past their back-off), in queue order:
        higher `priority_of(job)` first, then earlier `queued_at`."""
        c = JOBS.c
        query = sa.select(JOBS).where(sa.or_(c.state == "queued",
                                             sa.and_(c.state == "restarting", c.not_before <= at)))
        with self.engine.connect() as connection:
            found = [_job(r) for r in connection.execute(query)]
        return sorted(found, key=lambda j: (-priority_of(j), j.queued_at, j.id))

    def runs(self, job_id: str) -> list[Run]:
        with self.engine.connect() as connection:
            rows = connection.execute(sa.select(RUNS).where(RUNS.c.job_id == job_id).order_by(RUNS.c.attempt))
            return [_run(r) for r in rows]

    def running(self) -> list[tuple[Job, Run]]:
        """Running jobs with their open run (what a runner re-adopts after a restart)."""
        query = (sa.select(JOBS, RUNS.c.attempt).join(RUNS, RUNS.c.job_id == JOBS.c.id)
                 .where(JOBS.c.state == "running", RUNS.c.ended_at.is_(None)))
        with self.engine.connect() as connection:
            pairs = [(r.id, r.attempt) for r in connection.execute(query)]
        return [(self.get(job_id), next(r for r in self.runs(job_id) if r.attempt == attempt))
                for job_id, attempt in pairs]

    # --- changes -----------------------------------------------------------------------------------------

    def start_run(self, job_id: str, at: datetime, *, pid: int | None = None, pid_started_ms: int | None = None,
                  holding: str | None = None, cluster_retry: int | None = None) -> Run | None:
        """The job's next run begins (it was waiting): its attempt; None if it is not waiting any more (it
        was cancelled, or another writer started it)."""
        with self._writer.begin() as connection:
            row = connection.execute(sa.select(JOBS.c.runs, JOBS.c.state, JOBS.c.cancel_requested)
                                     .where(JOBS.c.id == job_id).with_for_update()).first()
            if row is None or row.state not in ("queued", "restarting") or row.cancel_requested:
                return None
            attempt = row.runs + 1
            changed = connection.execute(
                JOBS.update().where(JOBS.c.id == job_id, JOBS.c.runs == row.runs,
                                    JOBS.c.state.in_(("queued", "restarting")))
                .values(state="running", runs=attempt, not_before=None, reason=f"running (run {attempt})"))
            if changed.rowcount != 1:
                return None
            connection.execute(RUNS.insert().values(
                job_id=job_id, attempt=attempt, started_at=at, ended_at=None, event=None, exit_code=None,
                counted=False, reason="", pid=pid, pid_started_ms=pid_started_ms, holding=holding,
                cluster_retry=cluster_retry))
        return next(r for r in self.runs(job_id) if r.attempt == attempt)

    def set_process(self, job_id: str, attempt: int, pid: int, pid_started_ms: int) -> None:
        """The run's process, once it exists (started after `start_run` recorded the attempt)."""
        with self._writer.begin() as connection:
            connection.execute(RUNS.update().where(RUNS.c.job_id == job_id, RUNS.c.attempt == attempt,
                                                   RUNS.c.ended_at.is_(None))
                               .values(pid=pid, pid_started_ms=pid_started_ms))

    def end_run(self, job_id: str, attempt: int, ended: Ended, at: datetime, policy: Policy) -> Next | None:
        """Run `attempt` ended (`ended`): record it and move the job on by the restart rules; what follows,
        or None when that run had already ended (the same end reported twice changes nothing)."""
        with self._writer.begin() as connection:
            job = connection.execute(sa.select(JOBS).where(JOBS.c.id == job_id).with_for_update()).first()
            run = connection.execute(sa.select(RUNS).where(RUNS.c.job_id == job_id, RUNS.c.attempt == attempt)).first()
            if job is None or run is None or run.ended_at is not None:
                return None
            if job.cancel_requested and ended.event is not Event.SUCCEEDED:
                ended = Ended(Event.CANCELLED, ended.exit_code)  # whatever the stop looked like to the runner
            elif job.suspend_requested and ended.event not in (Event.SUCCEEDED, Event.CANCELLED):
                ended = Ended(Event.SUSPENDED, ended.exit_code)  # stopped for its user's suspend: never a failure
            following = after_run(ended, counted=job.restarts, max_restarts=job.max_restarts,
                                  rules=policy.jobs.restarts)
            end = max(at, run.started_at)
            connection.execute(RUNS.update().where(RUNS.c.id == run.id, RUNS.c.ended_at.is_(None)).values(
                ended_at=end, event=ended.event.value, exit_code=ended.exit_code, counted=following.counts,
                reason=following.reason))
            state = STATE_AFTER[following.action]
            values: dict[str, Any] = {"state": state, "reason": following.reason, "suspend_requested": False,
                                      "restarts": job.restarts + following.counts, "exit_code": ended.exit_code}
            if state in db.JOB_ENDED:
                values["ended_at"] = end
            elif following.action is Action.RESTART:
                values["not_before"] = end + timedelta(seconds=following.delay_seconds)
                values["queued_at"] = end  # a failed run goes to the back of its priority
            # requeued (preempted, node lost, the platform restarted): its place in the queue is kept
            connection.execute(JOBS.update().where(JOBS.c.id == job_id).values(**values))
        return following

    def cancel(self, job_id: str, at: datetime) -> Job | None:
        """Cancel: a job that waits ends at once (it never starts); a running one is marked, and its runner
        stops it (SIGTERM, grace, SIGKILL) and ends its run as cancelled. An ended job stays as it is."""
        with self._writer.begin() as connection:
            connection.execute(JOBS.update().where(JOBS.c.id == job_id,
                                                   JOBS.c.state.in_(("queued", "restarting", "suspended")))
                               .values(state="cancelled", ended_at=at, cancel_requested=True,
                                       reason=sa.case((JOBS.c.runs == 0, "cancelled while queued: it never ran"),
                                                      else_="cancelled while waiting to run again")))
            connection.execute(JOBS.update().where(JOBS.c.id == job_id, JOBS.c.state == "running")
                               .values(cancel_requested=True, reason="cancelling: stopping its run"))
        return self.get(job_id)

    def set_checkpoint_dir(self, job_id: str, folder: str) -> Job | None:
        """The job's checkpoint folder, when the submission named none (the default is made of its id)."""
        with self._writer.begin() as connection:
            connection.execute(JOBS.update().where(JOBS.c.id == job_id, JOBS.c.checkpoint_dir.is_(None))
                               .values(checkpoint_dir=folder))
        return self.get(job_id)

    def refuse(self, job_id: str, reason: str, at: datetime) -> Job | None:
        """A waiting job the pool will never start (its profile can never fit, its team's budget denies it, the
        policy no longer has its profile): `failed`, with why. A job not waiting any more stays as it is."""
        with self._writer.begin() as connection:
            connection.execute(JOBS.update().where(JOBS.c.id == job_id, JOBS.c.state.in_(("queued", "restarting")))
                               .values(state="failed", ended_at=at, reason=reason[:500]))
        return self.get(job_id)

    def set_reason(self, job_id: str, reason: str, states: Iterable[str] = ("queued", "restarting")) -> None:
        """Why a waiting job waits (its place in the queue and what it waits for), for its user to see; in the
        Kubernetes mode also where a running job's pod stands (`states` with `running`: in Volcano's queue)."""
        with self._writer.begin() as connection:
            connection.execute(JOBS.update().where(JOBS.c.id == job_id, JOBS.c.state.in_(list(states)),
                                                   JOBS.c.reason != reason[:500])
                               .values(reason=reason[:500]))

    def suspend(self, job_id: str, at: datetime) -> Job | None:
        """Suspend: a job that waits is held at once (it keeps its place for when it is resumed); a running
        one is marked, and its runner stops it (SIGTERM, grace, SIGKILL) and holds it. A suspend never counts
        against the job's restarts. Any other job stays as it is."""
        with self._writer.begin() as connection:
            connection.execute(JOBS.update().where(JOBS.c.id == job_id, JOBS.c.state.in_(("queued", "restarting")),
                                                   JOBS.c.cancel_requested.is_(False))
                               .values(state="suspended",
                                       reason="suspended by its user: resumes from its last checkpoint when resumed"))
            connection.execute(JOBS.update().where(JOBS.c.id == job_id, JOBS.c.state == "running",
                                                   JOBS.c.cancel_requested.is_(False))
                               .values(suspend_requested=True, reason="suspending: stopping its run"))
        return self.get(job_id)

    def resume(self, job_id: str, at: datetime) -> Job | None:
        """A suspended job goes back to the queue at its place (a failed run's back-off, if it is not over, still
        applies). A job whose run is being stopped for a suspend is not suspended yet: it stays as it is."""
        with self._writer.begin() as connection:
            connection.execute(JOBS.update().where(JOBS.c.id == job_id, JOBS.c.state == "suspended").values(
                state=sa.case((JOBS.c.not_before > at, "restarting"), else_="queued"), reason="in queue (resumed)"))
        return self.get(job_id)


    # --- the Kubernetes mode's logs (`db.JobLog`) ---------------------------------------------------------

    def log_kept(self, job_id: str, source: str) -> int:
        """Bytes of `source` kept in the job's log so far."""
        with self.engine.connect() as connection:
            return connection.execute(sa.select(sa.func.coalesce(sa.func.sum(LOGS.c.size), 0)).where(
                LOGS.c.job_id == job_id, LOGS.c.source == source)).scalar_one()

    def log_progress(self, job_id: str, pod_uid: str) -> LogProgress | None:
        """How far a pod's output is kept: the source of its latest pieces (its uid, or `UID@SECONDS` after a
        rotation of its log), their bytes and when the last was kept; None before any."""
        with self.engine.connect() as connection:
            latest = connection.execute(
                sa.select(LOGS.c.source, LOGS.c.at).where(
                    LOGS.c.job_id == job_id, sa.or_(LOGS.c.source == pod_uid, LOGS.c.source.startswith(pod_uid + "@")))
                .order_by(LOGS.c.start.desc()).limit(1)).first()
        if latest is None:
            return None
        return LogProgress(latest.source, self.log_kept(job_id, latest.source), latest.at)

    def keep_log(self, job_id: str, source: str, data: bytes, at: datetime) -> None:
        """Append `data` to the job's log, in one transaction (the write lock on SQLite orders the appends; on
        PostgreSQL the (job, start) key refuses a second writer's piece at the same offset, which goes again)."""
        if not data:
            return
        while True:
            try:
                with self._writer.begin() as connection:
                    connection.execute(LOGS.insert().values(job_id=job_id, source=source, start=self._log_end(
                        connection, job_id), data=data, size=len(data), at=at))
                return
            except sa.exc.IntegrityError:
                if self.get(job_id) is None:
                    return  # the job is gone: nothing to keep
                continue  # another piece took that offset first

    @staticmethod
    def _log_end(connection: sa.Connection, job_id: str) -> int:
        """The job's log's size: its last piece's end (one row through the (job, start) index)."""
        last = connection.execute(sa.select(LOGS.c.start, LOGS.c.size).where(LOGS.c.job_id == job_id)
                                  .order_by(LOGS.c.start.desc()).limit(1)).first()
        return last.start + last.size if last is not None else 0

    def read_log(self, job_id: str, offset: int, limit: int) -> bytes:
        """At most `limit` bytes of the job's log from byte `offset` (b"" past its end)."""
        with self.engine.connect() as connection:
            first = connection.execute(sa.select(sa.func.max(LOGS.c.start)).where(
                LOGS.c.job_id == job_id, LOGS.c.start <= offset)).scalar_one() or 0
            rows = connection.execute(
                sa.select(LOGS.c.start, LOGS.c.data).where(LOGS.c.job_id == job_id, LOGS.c.start >= first,
                                                           LOGS.c.start < offset + limit)
                .order_by(LOGS.c.start)).all()
        if not rows:
            return b""
        data = b"".join(row.data for row in rows)
        skip = offset - rows[0].start
        return data[max(0, skip):max(0, skip) + limit]

    def log_tail(self, job_id: str, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
        """The last `lines` lines of the job's log (of at most its last `max_bytes`)."""
        with self.engine.connect() as connection:
            end = self._log_end(connection, job_id)
        start = max(0, end - max_bytes)
        return tail_text(self.read_log(job_id, start, max_bytes), lines, cut=start > 0)

def job_folder(state_dir: str | Path, job_id: str) -> Path:
    """The hub's folder of job `job_id` in the platform's state folder (its log; private to the hub)."""
    if not JOB_ID.fullmatch(job_id):
        raise ValueError(f"{job_id!r} is not a job id")
    return Path(state_dir) / "jobs" / job_id


def default_checkpoint_dir(team_root: str | Path, team: str, user: str, job_id: str) -> Path:
    """A job's checkpoints by default: in the team's storage, in a folder of its user's that only they enter
    (`TEAM_ROOT/TEAM/checkpoints/USER/JOB`)."""
    return Path(team_root) / team / "checkpoints" / user / job_id


def job_log(state_dir: str | Path, job_id: str) -> Path:
    """The job's log: the output of every run, one after the other, with a line between runs."""
    return job_folder(state_dir, job_id) / "log"


def log_tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last `lines` lines of the log at `path` (at most its last `max_bytes`); "" when there is none."""
    try:
        with open(path, "rb") as log:
            log.seek(0, 2)
            size = log.tell()
            log.seek(max(0, size - max_bytes))
            data = log.read()
    except OSError:
        return ""
    return tail_text(data, lines, cut=size > max_bytes)


def tail_text(data: bytes, lines: int, cut: bool) -> str:
    """The last `lines` lines of a log's last bytes `data` (`cut`: its first line is a part of one), each
    progress line at its last state (`collapse_progress`)."""
    text = collapse_progress(data).decode("utf-8", "replace")
    if cut:
        text = text.split("\n", 1)[-1]
    return "\n".join(text.splitlines()[-lines:])


def collapse_progress(data: bytes, continued: bool = False) -> bytes:
    """A log's bytes with each line's carriage-return redraws (a tqdm bar updating itself, `\\r` then the new
    state, hundreds of times) collapsed to the line's last state, as a terminal would end up showing it; a CRLF
    line end is a plain one. Both modes' logs are served through this (the embedded runner's file, the pods'
    output kept in the database), so a progress bar is one line in `gpupool jobs show`, `logs` and the pages
    whatever wrote it. `continued`: `data` starts inside a line already served; when that line is redrawn the
    result starts with `\\r` and its new state, for a terminal following the log to redraw it too."""
    if b"\r" not in data:
        return data
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if b"\r" in line:
            parts = line.split(b"\r")
            shown = max((n for n, part in enumerate(parts) if part), default=0)  # a trailing \r erases nothing
            lines[i] = b"\r" + parts[shown] if (i == 0 and continued and shown > 0) else parts[shown]
    return b"\n".join(lines)


def priority_order(policy: Policy) -> Any:
    """`JobStore.waiting`'s order for `policy`: the team's priority plus the job's priority offset."""
    known = set(JOB_PRIORITIES)

    def priority_of(job: Job) -> int:
        if job.team not in policy.teams or job.priority not in known:
            return -1  # a team the policy no longer has: behind everything
        return policy.job_priority(job.team, job.priority)

    return priority_of
