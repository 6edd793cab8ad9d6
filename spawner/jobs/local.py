"""The embedded mode's job backend: training jobs through the hub's one pool, as processes of their users.

The runner (`jobs.runner.JobRunner` over this `LocalBackend`) runs in the hub process (`gpupool.hub.app`'s
`GPUPoolHub` starts it), beside the spawners, and this backend asks the same `LocalPool` for every run of a job, so
servers and jobs wait in one queue, count against the same quotas and budgets through the same door, and are
ordered by one set of priorities. The jobs themselves live in the ledger's database (`accounting.jobs.JobStore`):
the jobs service writes submissions and cancels there, the runner hands this backend what waits and what runs,
and it starts, watches and stops the runs' processes.

A run is a process group of the job's user (`python -m gpupool.train.launch` around the job's command), with
a server's environment for the job's share (`CUDA_*`, `GPUPOOL_*`, MLflow, DVC) plus `GPUPOOL_JOB_ID`,
`GPUPOOL_CHECKPOINT_DIR` and `GPUPOOL_RESTART_COUNT`; its output is appended to the job's log. Each run is
one ledger interval of kind `job`: reserved while placed, billed from its start to its end. A run outlives
a restart of the hub: the runner re-adopts it by PID and process start time, and learns its exit status
from the file the launcher writes.

Preemption: a request (server or job) that waits for room may stop preemptible jobs of lower priority
(`accounting.preemption.victims`): SIGTERM to the group, `jobs.grace_seconds`, then SIGKILL. The preempted
job goes back to the head of its priority in the queue, and its restart count does not change.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import stat
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from fractions import Fraction
from pathlib import Path

from gpupool.hub.accounting.jobs import Job, Run, default_checkpoint_dir, job_log
from gpupool.hub.accounting.ledger import job_run_key
from gpupool.policies import periods
from gpupool.policies.admission import LOWEST_PRIORITY, Reason
from gpupool.policies.choice import Choice
from gpupool.policies.model import Policy
from gpupool.policies.placement import choose_cards, placement_for
from gpupool.policies.preemption import Holder, victims
from gpupool.policies.resources import profile_share
from gpupool.policies.restarts import Ended, Event
from gpupool.spawner.jobs.runner import HEARTBEAT_S, JobBackend, JobRunner
from gpupool.spawner.local import (
    LocalGPUSpawner, ensure_system_user, ensure_team_folder, exit_record, mps_env, read_exit_record,
    server_env_paths, watch_exit,
)
from gpupool.spawner.mixin import choice_env, mlflow_env
from gpupool.spawner.pool import Allocation, LocalPool, Refused, Request, process_alive, process_start_time

#: Events after which a job goes back to the head of its priority in the queue.
REQUEUED = {Event.PREEMPTED.value, Event.NODE_LOST.value, Event.PLATFORM_RESTART.value}


def pool_key(job_id: str) -> str:
    """The job's key in the pool's queue and allocations (no `/`: no server's key looks like it)."""
    return f"job:{job_id}"


def is_job_key(key: str) -> bool:
    return key.startswith("job:") and "/" not in key


@dataclass
class Active:
    """A run this runner watches."""

    job: Job
    run: Run
    pid: int
    started: float  # the process's start time (psutil), to tell it from a reused PID
    proc: subprocess.Popen | None  # None for a run re-adopted after a restart of the hub
    exit_file: Path
    allocation: Allocation | None
    stopping: Event | None = None  # why this runner is stopping it (SIGTERM sent)
    kill_at: float | None = None  # when SIGKILL follows
    seen: float = 0.0  # last heartbeat (monotonic)


@dataclass(frozen=True)
class Launch:
    """What one run of a job is started with."""

    job: Job
    attempt: int
    restarts: int
    allocation: Allocation | None
    token: str | None  # a hub API token of the job's user for this run (MLflow, the jobs service)
    hub_api_url: str


def private_folder(spawner: LocalGPUSpawner, job: Job) -> Path:
    """The run's private folder (DVC config, credentials, exit status): the user's, like a server's."""
    return Path(spawner.server_config_root) / job.user / f"job-{job.id}"


def _private(folder: Path, parent: int, owner: tuple[int, int] | None) -> int:
    """`folder`, in the folder open as `parent`, made (or kept) as a real folder of `owner`'s only, 0700
    (the team folder's default ACLs give the group rwx; mode 0700 masks them); open, for the caller to close."""
    try:
        os.mkdir(folder.name, 0o700, dir_fd=parent)
    except FileExistsError:
        pass
    try:  # a descriptor: a link swapped in after a look by path is never followed, here or further down
        descriptor = os.open(folder.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except OSError:
        raise RuntimeError(f"{folder} is not a folder (a link?): the job's checkpoints cannot go there") from None
    try:
        os.fchmod(descriptor, 0o700)
        if owner is not None:
            os.fchown(descriptor, *owner)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def checkpoint_folder(checkpoints: Path, owner: tuple[int, int] | None) -> None:
    """The default checkpoint folder `TEAM/checkpoints/USER/JOB`: `checkpoints` the platform's (0711: members
    pass through to their own folder, list nothing, create nothing), `USER` and `JOB` the user's, 0700, so no
    teammate can read a checkpoint or plant one for a job to load. Walked by descriptors: a member may rename
    what is in the team folder (`checkpoints` among it) at any moment, and `USER` is the user's own."""
    shared = checkpoints.parent.parent
    shared.mkdir(exist_ok=True)
    try:
        top = os.open(shared, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        top = None
    try:
        if top is None or os.fstat(top).st_uid != os.getuid():
            raise RuntimeError(f"{shared} is not the platform's own folder (someone else made it): move it away; "
                               "jobs keep their checkpoints there")
        os.fchmod(top, 0o711)
        user = _private(checkpoints.parent, top, owner)
        try:
            os.close(_private(checkpoints, user, owner))
        finally:
            os.close(user)
    finally:
        if top is not None:
            os.close(top)


def launch(spawner: LocalGPUSpawner, started: Launch, state_dir: str) -> tuple[subprocess.Popen, Path]:
    """Start one run of a job as its user (a thread's work: accounts, folders, files); its process and the
    file its exit status will be written to."""
    job, choice, policy = started.job, spawner.gpupool_choice, spawner.policy
    teams = spawner.user_teams()
    owner = None
    if spawner.run_as == "user":
        account = ensure_system_user(job.user, teams, spawner.log, spawner.identity_record)
        owner = (account.uid, account.gid)
    for team in teams:
        ensure_team_folder(Path(spawner.team_root), team, spawner.run_as == "user")
    env = spawner.user_env({})
    env.update(server_env_paths(spawner.choice_environment(choice), env.get("HOME", ""), os.environ.get("PATH", ""),
                                spawner.run_as))
    env.update({k: v for k, v in spawner.environment.items() if isinstance(v, str)})
    env.update({"JUPYTERHUB_USER": job.user, "JUPYTERHUB_API_URL": started.hub_api_url})
    if started.token:
        env["JUPYTERHUB_API_TOKEN"] = started.token
        if spawner.mlflow_url:
            env.update(mlflow_env(spawner.mlflow_url, started.token, job.team))
    env.update(choice_env(choice, policy))
    allocation = started.allocation
    if allocation is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(allocation.cards)
        if allocation.share < 1:
            env.update(mps_env(state_dir, allocation.share, policy.models[allocation.model].memory_gib))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    folder = private_folder(spawner, job)
    env.update(spawner.dataset_env(folder))
    checkpoints = Path(job.checkpoint_dir or default_checkpoint_dir(spawner.team_root, job.team, job.user, job.id))
    if checkpoints == default_checkpoint_dir(spawner.team_root, job.team, job.user, job.id):
        checkpoint_folder(checkpoints, owner)
    env.update({"GPUPOOL_JOB_ID": job.id, "GPUPOOL_JOB_RUN": str(started.attempt),
                "GPUPOOL_CHECKPOINT_DIR": str(checkpoints), "GPUPOOL_RESTART_COUNT": str(started.restarts)})
    env.update(job.env)
    workdir = job.workdir or env.get("HOME") or "/"
    exit_file = folder / "exit-status"
    exit_file.unlink(missing_ok=True)
    become = spawner.make_preexec_fn(job.user)

    def preexec():
        hear_signals()
        become()
        try:
            os.chdir(workdir)  # as the user: a folder they cannot enter fails the run
        except OSError as error:  # the log says why; Popen says only "Exception occurred in preexec_fn"
            os.write(1, f"--- gpupool: the run cannot enter its working folder {workdir}: {error.strerror} ---\n"
                        .encode())
            raise

    log = job_log(state_dir, job.id)
    log.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    python = str(Path(spawner.server_env) / "bin" / "python")
    command = [python, "-m", "gpupool.train.launch", str(exit_file), "--", *job.command]
    with open(log, "ab") as out:
        out.write(f"--- gpupool: run {started.attempt} of job {job.id} starts at {periods.utcnow():%Y-%m-%d %H:%M:%S} "
                  f"UTC{' on ' + ', '.join(allocation.cards) if allocation else ''} ---\n".encode())
        out.flush()
        try:
            process = subprocess.Popen(command, env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=subprocess.STDOUT, preexec_fn=preexec, start_new_session=True,
                                       close_fds=True)
        except (OSError, subprocess.SubprocessError) as error:
            out.write(f"--- gpupool: the run could not start in {workdir}: {error} ---\n".encode())
            raise
    return process, exit_file


def read_exit_status(path: Path) -> int | None:
    """The status the run wrote into its private folder, which is its user's: a link they planted there (to
    `/dev/zero`, a FIFO, a root-owned file) is never followed, and no more than a status is read."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return None
        return int(os.read(descriptor, 64).decode().strip())
    except (OSError, ValueError):
        return None
    finally:
        os.close(descriptor)


def hear_signals() -> None:
    """In a run's process before it execs: no signal blocked. A run must hear SIGTERM (preemption, suspend, cancel),
    a signal mask is inherited across exec, and the worker thread that starts the run may have signals blocked: a
    blocked SIGTERM waits, unheard, until the SIGKILL at the end of the grace period."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # the run's own session: its group id is its PID
    except (ProcessLookupError, PermissionError):
        pass


class LocalBackend:
    """The `JobBackend` of the embedded mode: each run of a job a process group of its user, placed by `pool`."""

    def __init__(self, pool: LocalPool, state_dir: str, spawner_of: Callable[[Job], Awaitable[LocalGPUSpawner]],
                 token_of: Callable[[Job, int], Awaitable[str | None]],
                 revoke: Callable[[Job, int], Awaitable[None]], hub_api_url: str):
        """`spawner_of(job)`: a `LocalGPUSpawner` of the hub's configuration for the job's user and choice
        (every setting a server gets, from the one place it is configured); `token_of(job, attempt)` makes
        the run's hub token, `revoke` removes it when the run ends."""
        self.pool, self.state_dir, self.spawner_of, self.token_of, self.revoke = (pool, state_dir, spawner_of,
                                                                                  token_of, revoke)
        self.hub_api_url = hub_api_url
        self.runner: JobRunner | None = None
        self.acquiring: dict[str, asyncio.Task] = {}
        self.active: dict[str, Active] = {}
        self._stopping = False

    def bind(self, runner: JobRunner) -> None:
        self.runner = runner
        self.store, self.ledger, self.log = runner.store, runner.ledger, runner.log

    async def look(self) -> None:
        """Nothing to list: the runs are this process's children (or re-adopted PIDs), the queue the pool's."""

    async def close(self) -> None:
        """The hub goes down: the runs go on (the next hub re-adopts them); the jobs waiting keep their place."""
        self._stopping = True
        for task in self.acquiring.values():
            task.cancel()

    # --- starting ----------------------------------------------------------------------------------------

    async def submit(self, job: Job, policy: Policy) -> None:
        """The job asks the pool for room (it waits in the pool's queue, with the servers, as long as it takes)."""
        if job.id not in self.acquiring and job.id not in self.active:
            self.acquiring[job.id] = asyncio.get_running_loop().create_task(self._acquire(job))

    async def _acquire(self, job: Job) -> None:
        holding, allocation = None, None
        try:
            policy = self.runner.policy_of()
            if await self.runner.refused_by_policy(job, policy):
                return
            profile = policy.profiles[job.profile]
            queued = periods.utcnow()
            if profile.gpu is not None:
                holding = job_run_key(job.id, queued)
                runs = await asyncio.to_thread(self.store.runs, job.id)
                request = Request(
                    key=pool_key(job.id), user=job.user, team=job.team, profile=job.profile,
                    display_name=f"job {job.id} ({profile.display_name})", model=profile.gpu.model,
                    share=profile_share(profile, policy), priority=policy.job_priority(job.team, job.priority),
                    holding=holding)
                first = bool(runs) and runs[-1].event in REQUEUED
                allocation = await self.pool.acquire(request, options={"job": job.id}, first=first)
            run = await asyncio.to_thread(self.store.start_run, job.id, periods.utcnow(), holding=holding)
            if run is None:  # cancelled as it was placed
                self.pool.release(pool_key(job.id))
                await self.runner.give_back(holding)
                return
            await self._launch(job, run, allocation, periods.utcnow() - queued)
        except Refused as refused:
            await self.runner.refuse(job, str(refused))
        except asyncio.CancelledError:
            if not self._stopping:  # cancelled by its user: it leaves the queue (a hub going down keeps it)
                self.pool.forget(pool_key(job.id))
            raise
        finally:
            self.acquiring.pop(job.id, None)

    async def _launch(self, job: Job, run: Run, allocation: Allocation | None, queue_wait) -> None:
        spawner = await self.spawner_of(job)
        profile = copy.deepcopy(spawner.policy.profiles[job.profile])
        image = job.image if job.image in profile.images else None  # a choice the policy since took away: base
        spawner.gpupool_choice = Choice(job.profile, profile, job.team, image)
        token = await self.token_of(job, run.attempt)
        job = await asyncio.to_thread(self.store.get, job.id) or job
        started = Launch(job, run.attempt, job.restarts, allocation, token, self.hub_api_url)
        try:
            process, exit_file = await asyncio.to_thread(launch, spawner, started, self.state_dir)
        except Exception as error:
            self.log.error("gpupool job %s: run %d could not start: %s", job.id, run.attempt, error)
            await self._end(job, run, Ended(Event.FAILED, 127), periods.utcnow())
            return
        pid_started = process_start_time(process.pid) or time.time()
        await asyncio.to_thread(self.store.set_process, job.id, run.attempt, process.pid, int(pid_started * 1000))
        active = Active(job, run, process.pid, pid_started, process, exit_file, allocation, seen=time.monotonic())
        self.active[job.id] = active
        watch_exit(process.pid, exit_record(self.state_dir, process.pid, pid_started))
        if allocation is not None:
            self.pool.store.mark_running(allocation.key, process.pid)
            profile = spawner.gpupool_choice.profile
            now = periods.utcnow()
            await asyncio.to_thread(self.ledger.keep_run, run.holding, job.user, job.team, job.profile,
                                    profile.gpu.model, allocation.share, now, now, queue_wait=queue_wait)
        self.log.info("gpupool job %s (%s): run %d started as PID %d", job.id, job.user, run.attempt, process.pid)

    # --- following and ending ------------------------------------------------------------------------------

    async def follow(self, job: Job, run: Run, policy: Policy) -> None:
        active = self.active.get(job.id)
        if active is not None:  # else its process is still being started
            await self._follow(active, policy)

    async def stop(self, job: Job, run: Run, why: Event, policy: Policy) -> None:
        active = self.active.get(job.id)
        if active is not None:
            self.stop_run(active, why, policy)
            await self._follow(active, policy)

    async def _follow(self, active: Active, policy: Policy) -> None:
        if active.proc is not None:
            gone = active.proc.poll() is not None
        else:
            gone = not process_alive(active.pid, active.started)
        if gone:
            # The command's own status, as the launcher saw it (-9: SIGKILL); the launcher's when it wrote none
            # (itself killed); unknown for a re-adopted run that left no file.
            status = read_exit_status(active.exit_file)
            if status is None and active.proc is not None:
                status = active.proc.returncode
            ended_at = None
            if active.proc is None:
                ended_at = read_exit_record(exit_record(self.state_dir, active.pid, active.started))
            else:
                exit_record(self.state_dir, active.pid, active.started).unlink(missing_ok=True)
            if active.stopping is not None:
                ended = Ended(active.stopping, status)
            elif status is None:
                ended = Ended(Event.FAILED, None)
            else:
                ended = Ended(Event.SUCCEEDED if status == 0 else Event.FAILED, status)
            self.active.pop(active.job.id, None)
            await self._end(active.job, active.run, ended, ended_at or periods.utcnow())
            return
        if active.kill_at is not None and time.monotonic() >= active.kill_at:
            self.log.warning("gpupool job %s: still running %s s after SIGTERM; SIGKILL",
                             active.job.id, policy.jobs.grace_seconds)
            _signal_group(active.pid, signal.SIGKILL)
            active.kill_at = None
        if active.allocation is not None and time.monotonic() - active.seen >= HEARTBEAT_S:
            # Seen running: a heartbeat, or a continuation where reconciliation closed it (the hub was down long).
            active.seen, job, allocation = time.monotonic(), active.job, active.allocation
            await asyncio.to_thread(self.ledger.keep_run, active.run.holding, job.user, job.team, job.profile,
                                    allocation.model, allocation.share, active.run.started_at, periods.utcnow())

    def stop_run(self, active: Active, why: Event, policy: Policy) -> None:
        """SIGTERM to the run's group now, SIGKILL after the policy's grace period; it ends as `why`."""
        if active.stopping is not None:
            return
        active.stopping = why
        active.kill_at = time.monotonic() + policy.jobs.grace_seconds
        self.log.info("gpupool job %s: stopping run %d (%s): SIGTERM, SIGKILL in %d s", active.job.id,
                      active.run.attempt, why.value, policy.jobs.grace_seconds)
        _signal_group(active.pid, signal.SIGTERM)

    async def _end(self, job: Job, run: Run, ended: Ended, at: datetime) -> None:
        """The run's end, recorded by the runner; then its place in the pool, its token and a line in its log."""
        following = await self.runner.end(job, run, ended, at)
        self.pool.release(pool_key(job.id))
        await self.revoke(job, run.attempt)
        what = following.reason if following is not None else ended.event.value
        try:
            with open(job_log(self.state_dir, job.id), "ab") as out:
                out.write(f"--- gpupool: run {run.attempt} ended at {at:%Y-%m-%d %H:%M:%S} UTC: {what} ---\n".encode())
        except OSError:
            pass

    async def adopt(self) -> None:
        """After a restart of the hub: follow the runs that still run, end those that ended meanwhile."""
        running = await asyncio.to_thread(self.store.running)
        for job, run in running:
            started = run.pid_started_ms / 1000 if run.pid_started_ms else None
            allocation = self.pool.store.get(pool_key(job.id))
            spawner = await self.spawner_of(job)
            exit_file = private_folder(spawner, job) / "exit-status"
            if run.pid is not None and process_alive(run.pid, started):
                self.active[job.id] = Active(job, run, run.pid, started, None, exit_file, allocation,
                                             seen=time.monotonic())
                self.log.info("gpupool job %s: re-adopted run %d (PID %d)", job.id, run.attempt, run.pid)
                continue
            status = read_exit_status(exit_file) if run.pid is not None else None
            ended_at = read_exit_record(exit_record(self.state_dir, run.pid, started)) if run.pid else None
            if status is None:  # it did not end by itself (the machine restarted, or it never started)
                ended = Ended(Event.PLATFORM_RESTART, None)
            else:
                ended = Ended(Event.SUCCEEDED if status == 0 else Event.FAILED, status)
            if ended_at is None:
                interval = self.ledger.run_intervals(run.holding)[-1:] if run.holding else []
                ended_at = interval[0].last_seen if interval else periods.utcnow()
            await self._end(job, run, ended, ended_at)
        # Queue entries of jobs from before the restart: those still waiting are asked for again at the first
        # round (and keep their place); the others leave the queue.
        waiting = {j.id for j in await asyncio.to_thread(self.store.jobs, states=("queued", "restarting"))}
        for key in [k for k in self.pool.restoring if is_job_key(k)]:
            if key.removeprefix("job:") not in waiting:
                self.pool.restoring.pop(key, None)
                self.pool.store.dequeue(key)

    # --- the round's end: what left, why each waits, and preempting for them -------------------------------

    async def tidy(self, live: Mapping[str, Job], policy: Policy) -> None:
        for job_id, task in list(self.acquiring.items()):
            if job_id not in live:  # cancelled (or refused) while it waited
                task.cancel()
        for job_id, active in list(self.active.items()):
            if job_id not in live:  # its job is gone from the table: stopped as cancelled
                self.stop_run(active, Event.CANCELLED, policy)
                await self._follow(active, policy)
        await self._reasons()
        await self._preempt(policy)

    async def _reasons(self) -> None:
        for job_id in list(self.acquiring):
            ticket = self.pool.ticket(pool_key(job_id))
            if ticket is not None and ticket.news:
                await asyncio.to_thread(self.store.set_reason, job_id, ticket.message())

    async def _preempt(self, policy: Policy) -> None:
        rules = policy.jobs.preemption
        blocked = [t for t in self.pool.waiting.values()
                   if not t.future.done() and t.code is Reason.NO_CAPACITY]
        if not rules.enabled or not blocked or not self.active:
            return
        stopping = {key for key, a in self.active.items() if a.stopping is not None}
        # Each at its priority as admitted: an over-budget request queues at the lowest and preempts nothing (at its
        # nominal priority it would stop a job that is then admitted ahead of it, round after round).
        holdings = await asyncio.to_thread(self.pool.holdings)
        admitted = {}
        for ticket in blocked:
            verdict = await asyncio.to_thread(self.pool.decide, ticket.request, holdings)
            admitted[ticket.request.key] = (LOWEST_PRIORITY if verdict.priority == LOWEST_PRIORITY
                                            else ticket.request.priority)
        blocked.sort(key=lambda t: (-admitted[t.request.key], t.seq))
        for ticket in blocked:
            request = ticket.request
            kind = "job" if is_job_key(request.key) else "server"
            holders = await asyncio.to_thread(self._holders, policy, request.model, stopping)
            cards = [c.uuid for c in sorted(self.pool.cards, key=lambda c: c.index) if c.model == request.model]
            used = self.pool.store.used()
            for key in stopping:  # what is being stopped already will be free: count it as free
                active = self.active.get(key)
                if active is not None and active.allocation is not None:
                    for card in active.allocation.cards:
                        used[card] = used.get(card, Fraction(0)) - min(active.allocation.share, Fraction(1))
            placement = placement_for(policy, request.model)
            chosen = victims(rules, kind, admitted[request.key], request.model, request.share, cards, used, holders,
                             lambda free, share: choose_cards(free, share, placement))
            for job_id in chosen:
                self.log.warning("gpupool: preempting job %s for %s (priority %d)", job_id, request.key,
                                 request.priority)
                self.stop_run(self.active[job_id], Event.PREEMPTED, policy)
                stopping.add(job_id)
            if chosen:
                return  # one request at a time: the next round sees the room this one made

    def _holders(self, policy: Policy, model: str, stopping: set[str]) -> list[Holder]:
        holdings = self.pool.holdings()
        holders = []
        for job_id, active in self.active.items():
            allocation = active.allocation
            if allocation is None or job_id in stopping or allocation.model != model:
                continue
            job = active.job
            request = Request(pool_key(job_id), job.user, job.team, job.profile, "", allocation.model,
                              allocation.share, policy.job_priority(job.team, job.priority), holding=active.run.holding)
            verdict = self.pool.decide(request, holdings)
            holders.append(Holder(job_id, allocation.model, allocation.cards, min(allocation.share, Fraction(1)),
                                  request.priority, job.preemptible, verdict.priority == LOWEST_PRIORITY,
                                  active.started or 0.0))
        return holders


_: type[JobBackend] = LocalBackend  # conformance, as Kueue's adapters assert theirs (and the tests at run time)
