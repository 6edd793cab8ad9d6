"""The training jobs' runner, written once for every engine: each round it reads the jobs table and hands each
job to the engine's adapter (a `JobBackend`: processes on the embedded pool, Volcano Jobs in a cluster), and it
keeps what is the same on every engine: the round itself, a job the policy cannot run refused, the ledger's one
door and the give-back of what it held, and a run's end counted by the restart rules and closed in the ledger.

After Kueue's jobframework (`GenericJob`): an adapter translates gpupool's jobs into its engine's work and
reports back what the engine did; it never decides what follows a run (`JobStore.end_run`, the restart rules)
nor bills on its own terms (`Ledger.keep_run` from when the run ran, `close_run` as the run ended).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Protocol, runtime_checkable

from gpupool.hub.accounting import notify
from gpupool.hub.accounting.jobs import LEDGER_END, Job, JobStore, Run, policy_problem, priority_order
from gpupool.hub.accounting.ledger import JOB_RUN_PREFIX, HowEnded, Ledger
from gpupool.policies import periods
from gpupool.policies.admission import AdmissionRequest, Decision
from gpupool.policies.model import Policy
from gpupool.policies.restarts import Ended, Event, Next

#: Seconds between two rounds: two looks at the jobs table and at the engine.
TICK_S = 1.0
#: Seconds between two heartbeats of a running run's ledger interval.
HEARTBEAT_S = 30.0


@runtime_checkable
class JobBackend(Protocol):
    """What an engine does for the runner. Each call is the engine's part for one job (or one round); what the
    jobs table and the ledger record goes through the runner (`JobRunner.refuse`, `admit`, `give_back`, `end`)."""

    def bind(self, runner: JobRunner) -> None:
        """The runner this adapter works for (its store, ledger, policy, log and shared steps), once, before
        `adopt`."""

    async def adopt(self) -> None:
        """After a start of the hub, before the first round: take up the runs the engine still runs, end (through
        `JobRunner.end`) those that ended while no hub watched, and start watching the engine."""

    async def look(self) -> None:
        """The start of a round: read the engine's own state once (a listing), for the round's calls to use."""

    async def submit(self, job: Job, policy: Policy) -> None:
        """A job whose turn it is (queued, or restarting past its back-off), every round it waits: through the
        door, then its next run started in the engine (`JobStore.start_run`); once, however many rounds it waits
        (the adapter knows what it has in hand)."""

    async def follow(self, job: Job, run: Run, policy: Policy) -> None:
        """A run the jobs table says runs: how it stands in the engine; a heartbeat of its ledger interval while it
        runs; its end (`JobRunner.end`) once the engine says it ended, and how."""

    async def stop(self, job: Job, run: Run, why: Event, policy: Policy) -> None:
        """A running job its user cancelled or suspended (`why`), every round until its run ends: stop the run in
        the engine (the policy's grace period to save a checkpoint), and end it once the engine has stopped it."""

    async def tidy(self, live: Mapping[str, Job], policy: Policy) -> None:
        """The end of a round, with the jobs not over (`live`, by id): what concerns the engine beyond one job
        (waiting work the engine restarted by itself, preemption, what it holds for jobs that are over)."""

    async def close(self) -> None:
        """The hub goes down: stop watching. The runs go on; the next hub's `adopt` takes them up."""


class JobRunner:
    """Runs the jobs in `store` on one engine (`backend`), one round every `tick` seconds."""

    def __init__(self, store: JobStore, ledger: Ledger, policy_of: Callable[[], Policy], backend: JobBackend, log,
                 tick: float = TICK_S):
        self.store, self.ledger, self.policy_of, self.backend = store, ledger, policy_of, backend
        self.log, self.tick_s = log, tick
        self._task: asyncio.Task | None = None
        backend.bind(self)

    # --- the loop ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.backend.adopt()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """The hub goes down: stop the rounds and the watching (the runs go on; the next hub re-adopts them)."""
        await cancel_tasks([self._task] if self._task is not None else [])
        await self.backend.close()

    async def _loop(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # the engine or the database unreachable, a bug: log, and try again at the next tick
                self.log.exception("gpupool job runner: a round failed; trying again")
            await asyncio.sleep(self.tick_s)

    async def step(self) -> None:
        """One round: follow what runs (stopping what its user cancelled or suspended), submit what waits, then
        the engine's own tidying."""
        policy = self.policy_of()
        await self.backend.look()
        now = periods.utcnow()
        live, waiting, running = await asyncio.to_thread(
            lambda: ({j.id: j for j in self.store.jobs(states=("queued", "restarting", "running"))},
                     self.store.waiting(now, priority_order(policy)), self.store.running()))
        for job, run in running:
            if job.cancel_requested or job.suspend_requested:
                why = Event.CANCELLED if job.cancel_requested else Event.SUSPENDED
                await self.each(job.id, self.backend.stop(job, run, why, policy))
            else:
                await self.each(job.id, self.backend.follow(job, run, policy))
        for job in waiting:
            await self.each(job.id, self.backend.submit(job, policy))
        await self.backend.tidy(live, policy)

    async def each(self, job_id: str, work) -> None:
        """One job's part of a round: its failure is said and tried again next round, the others go on."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:  # an engine's error, a run gpupool cannot read
            self.log.exception("gpupool job %s: this round failed for it; trying again", job_id)

    # --- what every engine shares ------------------------------------------------------------------------

    async def refuse(self, job: Job, reason: str) -> None:
        """A waiting job that will never run: `failed`, with why."""
        await asyncio.to_thread(self.store.refuse, job.id, reason, periods.utcnow())

    async def refused_by_policy(self, job: Job, policy: Policy) -> bool:
        """Whether the policy can no longer run the job (its profile or team gone): then it is refused."""
        problem = policy_problem(policy, job)
        if problem:
            await self.refuse(job, problem)
        return bool(problem)

    async def admit(self, job: Job, policy: Policy, holding: str, at: datetime) -> Decision:
        """The job's next run through the ledger's one door (quota and budget): admitted, its share is held under
        `holding` as `reserved` until the run is billed or given back."""
        request = AdmissionRequest(user=job.user, team=job.team, at=at, profile=job.profile)
        return (await asyncio.to_thread(notify.admit, policy, self.ledger, request, holding, self.log)).decision

    async def turned_away(self, job: Job, decision: Decision, at: datetime) -> None:
        """A run the door did not admit: the job is refused when the door denies it, else it waits for quota."""
        if decision.action == "deny":
            await asyncio.to_thread(self.store.refuse, job.id, decision.reason, at)
        else:
            await asyncio.to_thread(self.store.set_reason, job.id, f"waiting for quota: {decision.reason}")

    async def give_back(self, holding: str | None) -> None:
        """What the door held for a run that never ran: released, never billed."""
        if holding:
            await asyncio.to_thread(self.ledger.close_run, holding, periods.utcnow(), HowEnded.FAILED)

    def reconcile(self) -> None:
        """What a crash between the jobs table and the ledger left open: the holding of a run the table says has
        ended closes when and as that run ended; a holding no run took (the hub stopped between the door and the
        engine) closes unbilled."""
        for interval in self.ledger.open_intervals():
            holding = interval.run or interval.key
            if interval.kind != "job" or not holding.startswith(JOB_RUN_PREFIX):
                continue
            job_id = holding[len(JOB_RUN_PREFIX):].split("@", 1)[0]
            run = next((r for r in self.store.runs(job_id) if r.holding == holding), None)
            if run is None:
                self.ledger.close_run(holding, interval.start, HowEnded.FAILED)
            elif run.ended_at is not None:
                self.ledger.close_run(holding, run.ended_at, LEDGER_END[Event(run.event)])
            else:
                continue
            self.log.warning("gpupool job %s: closed its ledger interval %s, left open by a crash", job_id, holding)

    async def end(self, job: Job, run: Run, ended: Ended, at: datetime, policy: Policy | None = None) -> Next | None:
        """Run `run` ended (`ended`, at `at`): recorded, the job moved on by the restart rules, its ledger interval
        closed as it ended; what follows, or None when that run had ended already."""
        policy = policy or self.policy_of()
        following = await asyncio.to_thread(self.store.end_run, job.id, run.attempt, ended, at, policy)
        if run.holding:
            await asyncio.to_thread(self.ledger.close_run, run.holding, at, LEDGER_END[ended.event])
        self.log.info("gpupool job %s: run %d ended (%s, exit %s): %s", job.id, run.attempt, ended.event.value,
                      ended.exit_code, following.reason if following is not None else "already ended")
        return following


async def cancel_tasks(tasks: list[asyncio.Task]) -> None:
    """Cancel `tasks` and wait until they are done."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except BaseException:  # noqa: BLE001 - cancelled, or it had failed and said so
            pass
