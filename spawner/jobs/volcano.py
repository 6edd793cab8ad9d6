"""The Kubernetes mode's job backend: training jobs as Volcano Jobs, submitted and watched through the API.

The runner (`jobs.runner.JobRunner` over this `VolcanoBackend`) runs in the hub process (`gpupool.hub.app`'s
`GPUPoolHub` starts it when the spawner is `GPUKubeSpawner`); this backend does for the cluster what
`jobs.local.LocalBackend` does on one machine, from the same jobs table (`accounting.jobs.JobStore`) that the jobs
service writes:

- a waiting job goes through the ledger's one door (`JobRunner.admit`: quota and budget, its share held as
  `reserved`), then becomes a Volcano Job (`volcano_objects.volcano_job`) in its team's queue. Volcano schedules
  it, restarts it under the Job's policies and preempts it; gpupool never places a pod itself;
- a watch on the jobs' pods (list, then watch from the resourceVersion) sees how each pod ended, before
  Volcano deletes it to restart the Job: its exit code, a kubelet eviction, a disruption (preemption, a
  drained or lost node) or a deletion (`volcano_objects.pod_end`);
- every round it lists the Volcano Jobs (label selector) and reads each one's phase and restart count
  (`volcano_objects.job_state`). A higher restart count than the run's (`Run.cluster_retry`), or an ended phase,
  ends the run: `JobRunner.end` counts it by gpupool's restart rules (a preemption or a lost node never counts),
  and its ledger interval closes. When gpupool's rules end the job (its restarts used up, an exit code never
  retried) while Volcano would go on, gpupool deletes the Volcano Job; when they continue it, the next run
  is Volcano's restarted pod (or, after a Volcano Job that ended, a new Volcano Job when its turn comes);
- each run is billed from the moment its pod runs (`Ledger.keep_run` from the container's start time), with
  a heartbeat while it runs, and closed when it ends: one interval per run, none overlapping;
- a cancel or suspend deletes the Volcano Job (its pods get their grace period to save a checkpoint);
- each pod's output is read through the API server while it runs (`PodLogs`) into the job's log in the
  database, so `gpupool jobs logs` and the job's page show every run's output after Volcano deleted the pods.

Everything it knows is in the jobs table and the cluster, so a restarted hub goes on where the last one
stopped; only a pod that ended and was deleted while no hub watched leaves no cause (the run then ends as
`node-lost`, which requeues it and never counts against its restarts).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any

from gpupool.hub.accounting.jobs import Job, Run, policy_problem
from gpupool.hub.accounting.ledger import job_run_key
from gpupool.policies import periods
from gpupool.policies.admission import LOWEST_PRIORITY
from gpupool.policies.model import Policy
from gpupool.policies.resources import profile_share
from gpupool.policies.restarts import Action, Ended, Event, Next
from gpupool.spawner.jobs.podlogs import PodLogs, read_answer
from gpupool.spawner.jobs.runner import HEARTBEAT_S, JobBackend, JobRunner, cancel_tasks
from gpupool.spawner.jobs.volcano_objects import (
    JOB_API_VERSION, JOB_ID_LABEL, SUBMISSION_LABEL, JobSpec, finished_at, job_name, job_state, pod_end,
    pod_retry, running_since, volcano_job,
)
from gpupool.spawner.volcano import INSTANCE_LABEL, Release, team_queue

GROUP, VERSION = JOB_API_VERSION.split("/")
PLURAL = "jobs"
#: Seconds a run whose Volcano Job moved on waits for the pod watch to tell how its pod ended (the watch's lag;
#: Volcano deletes a pod it restarts, so only the watch saw its end) before it ends as `node-lost`.
END_WAIT_S = 10.0
#: Seconds past the grace period a cancelled or suspended job's Volcano Job may take to go (its pod's deletion)
#: before its run ends anyway (a pod on a lost node stays Terminating until the node is back or removed).
DELETE_WAIT_S = 60.0
#: gpupool's states of a Volcano Job that will not run its pod again by itself.
OVER = ("succeeded", "failed", "cancelled", "suspended")


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time of the Kubernetes API (`2026-12-05T22:01:02Z`), as UTC."""
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class VolcanoBackend:
    """The `JobBackend` of the Kubernetes mode: submits, watches and ends the Volcano Jobs of the runner's jobs, in
    `namespace`."""

    def __init__(self, custom, core, namespace: str, release: Release, default_image: str,
                 storage_of: Callable[[Job], Awaitable[Mapping[str, Any]]] | None = None):
        """`custom`, `core`: kubernetes_asyncio's CustomObjectsApi and CoreV1Api (the spawner's clients);
        `default_image`: what profiles without image choices run (the hub's notebook image); `storage_of(job)`:
        the user's `volumes`, `volume_mounts` and `security_context` as the hub's spawner gives their servers."""
        self.custom, self.core, self.namespace, self.release = custom, core, namespace, release
        self.default_image, self.storage_of = default_image, storage_of
        self.runner: JobRunner | None = None
        #: From the pod watch, by (job id, Volcano Job submission, Volcano restart): how that pod's run ended, when
        #: its container ran. The submission (`volcano_objects.SUBMISSION_LABEL`) tells a new Volcano Job of a job
        #: (after a suspend, a cancelled restart) from the last one, whose pods' late events must not count for it.
        self.ends: dict[tuple[str, str, int], Ended] = {}
        self.started: dict[tuple[str, str, int], str] = {}
        self.finished: dict[tuple[str, str, int], str] = {}  # when its container terminated, where it did
        self.billed: dict[str, tuple[bool, float]] = {}  # run holding → (billed as running, when written)
        #: Job ids whose Volcano Job this backend deleted and waits to see gone, with when it asked (monotonic).
        self.deleting: dict[str, float] = {}
        self.moved_on: dict[tuple[str, int], tuple[float, datetime]] = {}  # run's end unknown: since (monotonic, UTC)
        self.cluster: dict[str, dict] = {}  # this round's Volcano Jobs, by job id
        self.pods_seen = asyncio.Event()  # the watch's first list is in
        self.pod_logs: PodLogs | None = None
        self._tasks: list[asyncio.Task] = []

    def bind(self, runner: JobRunner) -> None:
        self.runner = runner
        self.store, self.ledger, self.log = runner.store, runner.ledger, runner.log
        self.pod_logs = PodLogs(runner.store, self.core, self.namespace, runner.log)

    # --- the watch ---------------------------------------------------------------------------------------

    async def adopt(self) -> None:
        """Everything is in the jobs table and the cluster: close what a crash left open in the ledger, then watch
        the jobs' pods (the rounds follow the runs from there)."""
        await asyncio.to_thread(self.runner.reconcile)
        self._tasks = [asyncio.get_running_loop().create_task(self._watch_pods())]

    async def close(self) -> None:
        """The hub goes down: stop watching (the Volcano Jobs go on; the next hub follows them)."""
        await cancel_tasks(self._tasks)
        await self.pod_logs.stop()

    async def _watch_pods(self) -> None:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client import ApiException

        version = None
        while True:
            try:
                if version is None:
                    listed = await read_answer(await self.core.list_namespaced_pod(
                        self.namespace, label_selector=self.selector, _preload_content=False))
                    for pod in listed.get("items") or []:
                        self.see_pod(pod)
                    version = listed["metadata"]["resourceVersion"]
                    self.pods_seen.set()
                stream = watch.Watch().stream(self.core.list_namespaced_pod, self.namespace,
                                              label_selector=self.selector, resource_version=version,
                                              timeout_seconds=300)
                async with stream:
                    async for event in stream:
                        pod = event["raw_object"]
                        version = pod["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self.see_pod(pod, deleted=event["type"] == "DELETED")
            except asyncio.CancelledError:
                raise
            except ApiException as error:
                if error.status == 410:  # too old a resourceVersion: list again
                    version = None
                    continue
                self.log.warning("gpupool Kubernetes job runner: watching pods: %s; again in 1 s", error)
                await asyncio.sleep(1)
            except Exception as error:  # noqa: BLE001 - the connection dropped: list again, it is cheap
                self.log.warning("gpupool Kubernetes job runner: watching pods: %s; again in 1 s", error)
                version = None
                await asyncio.sleep(1)

    async def _look(self, job_id: str) -> None:
        """Read the job's pods now (what the watch will tell, told sooner)."""
        listed = await read_answer(await self.core.list_namespaced_pod(
            self.namespace, label_selector=self.selector_of(job_id), _preload_content=False))
        for pod in listed.get("items") or []:
            self.see_pod(pod)

    def see_pod(self, pod: Mapping[str, Any], deleted: bool = False) -> None:
        """Note what a pod of a job says: when its container started, how it ended (the first end seen wins:
        a pod that failed and was then deleted failed)."""
        job_id = ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_ID_LABEL)
        if not job_id:
            return
        key = (job_id, _submission(pod), pod_retry(pod) or 0)
        since = running_since(pod)
        if since:
            self.started.setdefault(key, since)
        ended = pod_end(pod, deleted=deleted)
        if ended is not None:
            self.ends.setdefault(key, ended)
            if finished := finished_at(pod):
                self.finished.setdefault(key, finished)
        self.pod_logs.see(job_id, pod, ended)

    # --- one round -----------------------------------------------------------------------------------------

    @property
    def selector(self) -> str:
        """This release's jobs (and their pods): another release in the namespace has its own."""
        return self.selector_of(None)

    def selector_of(self, job_id: str | None) -> str:
        """This release's Volcano Jobs and pods of one job (`job_id`), or of all jobs (None)."""
        return f"{JOB_ID_LABEL}{'=' + job_id if job_id else ''},{INSTANCE_LABEL}={self.release.name}"

    async def volcano_jobs(self) -> dict[str, dict]:
        """This release's Volcano Jobs in the namespace, by job id (a label selector, as the API server serves it)."""
        listed = await self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                                 label_selector=self.selector)
        return {j["metadata"]["labels"][JOB_ID_LABEL]: j for j in listed.get("items") or []}

    async def look(self) -> None:
        """The round's Volcano Jobs; how running pods ended is known (the watch's first list) before any run is
        judged."""
        await self.pods_seen.wait()
        self.cluster = await self.volcano_jobs()
        for job_id in list(self.deleting):
            if job_id not in self.cluster:
                del self.deleting[job_id]

    async def tidy(self, live: Mapping[str, Job], policy: Policy) -> None:
        """Waiting jobs whose Volcano Job Volcano restarted (a new run), Volcano Jobs of jobs that are over, and what
        the watch told of the pods of jobs that are over."""
        for job in live.values():
            found = self.cluster.get(job.id)
            if job.state in ("queued", "restarting") and found is not None and job.id not in self.deleting:
                await self.runner.each(job.id, self._restarted(job, found, policy))
        for job_id, found in self.cluster.items():  # a job gpupool ended (or cancelled while no hub ran) that
            if job_id not in live and _phase_state(found) not in (*OVER, "unknown"):  # Volcano would still run
                await self.runner.each(job_id, self._delete(job_id))
        for key in [k for k in {*self.ends, *self.started} if k[0] not in live]:  # what the watch told of the
            self.ends.pop(key, None)  # pods of jobs that ended
            self.started.pop(key, None)
            self.finished.pop(key, None)
        self.pod_logs.forget(live)

    # --- starting ----------------------------------------------------------------------------------------

    async def submit(self, job: Job, policy: Policy) -> None:
        """Through the one door, then to Volcano: a waiting job without a Volcano Job (one with a Volcano Job
        Volcano restarted is the round's end's, `tidy`)."""
        from kubernetes_asyncio.client import ApiException

        if job.id in self.cluster or await self.runner.refused_by_policy(job, policy):
            return
        profile = policy.profiles[job.profile]
        now = periods.utcnow()
        holding, deprioritized = None, False
        if profile.gpu is not None:
            holding = job_run_key(job.id, now)
            decision = await self.runner.admit(job, policy, holding, now)
            if not decision.admitted:
                await self.runner.turned_away(job, decision, now)
                return
            deprioritized = decision.priority == LOWEST_PRIORITY
        image = job.image if job.image in profile.images else None
        try:
            storage = await self.storage_of(job) if self.storage_of is not None else None
            spec = JobSpec.from_job(job, policy, deprioritized=deprioritized, image=image, storage=storage,
                                    submission=job.runs + 1)
            manifest = volcano_job(spec, policy, self.release, self.namespace, default_image=self.default_image)
            run = await asyncio.to_thread(self.store.start_run, job.id, now, holding=holding, cluster_retry=0)
        except ValueError as error:
            await self.runner.give_back(holding)
            await self.runner.refuse(job, f"cannot run in the cluster: {error}")
            return
        except BaseException:  # nothing was made: the holding goes (the next round asks the door again)
            await asyncio.shield(self.runner.give_back(holding))
            raise
        if run is None:  # cancelled meanwhile
            await self.runner.give_back(holding)
            return
        try:
            await self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, manifest)
        except ApiException as error:
            if error.status != 409:  # 409: made before (a round cut short): it is this job's, follow it
                await self._refused_by_cluster(job, run, error, policy)
                return
        await asyncio.to_thread(self.store.set_reason, job.id, f"in Volcano's queue {team_queue(job.team)!r}",
                                ("running",))
        self.log.info("gpupool job %s (%s): Volcano Job %s submitted (run %d)", job.id, job.user,
                      job_name(job.id), run.attempt)

    async def _refused_by_cluster(self, job: Job, run: Run, error, policy: Policy) -> None:
        said = _api_message(error)
        if error.status not in (400, 422):  # the platform's trouble (5xx, throttling, rights, a missing CRD), not
            # the job's: it goes back to the queue, and the administrator sees why in the hub's log
            self.log.error("gpupool job %s: the Kubernetes API answered %s to its Volcano Job: %s", job.id,
                           error.status, said)
            await self._end(job, run, Ended(Event.PLATFORM_RESTART, None), periods.utcnow(), policy)
            return
        self.log.error("gpupool job %s: the Kubernetes API refused its Volcano Job (%s): %s", job.id,
                       error.status, said)
        await self._end(job, run, Ended(Event.FAILED, None), periods.utcnow(), policy)
        await self.runner.refuse(job, f"the Kubernetes API refused its Volcano Job ({error.status}): {said}")

    async def _restarted(self, job: Job, found: dict, policy: Policy) -> None:
        """A waiting job whose Volcano Job is still there: Volcano runs it again (its restart), a new run."""
        state = job_state(found)
        if state.state in OVER:  # it will not run again by itself: a new Volcano Job when its turn comes
            await self._delete(job.id)
            return
        if policy_problem(policy, job):
            await self._delete(job.id)
            await self.runner.refused_by_policy(job, policy)
            return
        profile = policy.profiles[job.profile]
        now = periods.utcnow()
        holding = None
        if profile.gpu is not None:  # a restart is a new run through the same door as any other
            holding = job_run_key(job.id, now)
            decision = await self.runner.admit(job, policy, holding, now)
            if not decision.admitted:  # its Volcano Job goes; the job waits (or fails) as a new submission would
                await self._delete(job.id)
                await self.runner.turned_away(job, decision, now)
                return
        try:
            run = await asyncio.to_thread(self.store.start_run, job.id, now, holding=holding,
                                          cluster_retry=state.retries)
        except BaseException:
            await asyncio.shield(self.runner.give_back(holding))
            raise
        if run is None:  # cancelled meanwhile
            await self.runner.give_back(holding)
        else:
            await asyncio.to_thread(self.store.set_reason, job.id, f"restarted by Volcano: {state.reason}",
                                    ("running",))
            self.log.info("gpupool job %s: run %d is Volcano's restart %d", job.id, run.attempt, state.retries)

    # --- following and ending ------------------------------------------------------------------------------

    async def stop(self, job: Job, run: Run, why: Event, policy: Policy) -> None:
        """Its Volcano Job deleted (its pod gets the grace period to save), billed until it is gone; the run ends
        once it is (or, a pod stuck in Terminating, `DELETE_WAIT_S` past the grace period)."""
        now = periods.utcnow()
        found = self.cluster.get(job.id)
        if found is not None:
            key = (job.id, _submission(found), run.cluster_retry or 0)
            if key not in self.started and job.id not in self.deleting:
                await self._look(job.id)  # whether its pod ran, told sooner than the watch may
            since = parse_time(self.started.get(key))
            if since is not None and run.holding is not None:  # billed from its start until the Job is gone
                await self._bill(job, run, since, policy)
            asked = self.deleting.get(job.id)
            if asked is not None and time.monotonic() - asked > policy.jobs.grace_seconds + DELETE_WAIT_S:
                # Its pod hangs in Terminating (its node lost, a finalizer): the run ends now, and is billed
                # no further; the Volcano Job goes when its pod does.
                self.log.warning("gpupool job %s: its Volcano Job is still not gone %d s after its deletion; "
                                 "its run ends now", job.id, time.monotonic() - asked)
                await self._end(job, run, Ended(why, None), now, policy)
                return
            await self._delete(job.id)  # the pods get their grace period to save
            return
        await self._end(job, run, Ended(why, None), now, policy)

    async def follow(self, job: Job, run: Run, policy: Policy) -> None:
        """How its Volcano Job stands: billed while its pod runs; ended, as its pod ended, once Volcano moved on
        (a restart or an ended phase)."""
        now = periods.utcnow()
        found = self.cluster.get(job.id)
        if found is None:
            # Deleted by someone else (an administrator's kubectl): not the job's failure; it is submitted again.
            self.log.warning("gpupool job %s: its Volcano Job is gone; it goes back to the queue", job.id)
            await self._end(job, run, Ended(Event.PLATFORM_RESTART, None), now, policy)
            return
        state = job_state(found)
        retry = run.cluster_retry or 0
        key = (job.id, _submission(found), retry)
        over = state.retries > retry or state.state in OVER
        if over and key not in self.ends:
            await self._look(job.id)  # the watch may not have told yet: the pod itself, if it is still there
            first = self.moved_on.setdefault(key, (time.monotonic(), now))
            if key not in self.ends and time.monotonic() - first[0] < END_WAIT_S:
                return  # the watch tells how its (deleted) pod ended within a round or two
        since = parse_time(self.started.get(key))
        if over:
            ended = self.ends.get(key) or _from_phase(state.state)
            at = self.moved_on.pop(key, (0.0, now))[1]  # when Volcano was seen to have moved on
            finished = parse_time(self.finished.get(key))
            if finished is not None:  # the container's own end, where it had one (a hub that was down saw it late)
                at = max(run.started_at, min(at, finished))
            if since is not None and run.holding is not None:  # billed from its start, however short it ran
                await self._bill(job, run, since, policy, again=True)
            following = await self._end(job, run, ended, at, policy)
            if following is None:  # that run had been ended already
                return
            if state.state in OVER or following.action not in (Action.RESTART, Action.REQUEUE):
                # Volcano is done with it (what it said is recorded; a job that goes on gets a new Volcano Job
                # when its turn comes), or gpupool ends a job Volcano would restart: the Volcano Job goes.
                await self._delete(job.id)
            return
        if state.state == "queued":
            await asyncio.to_thread(self.store.set_reason, job.id,
                                    f"in Volcano's queue {team_queue(job.team)!r}: {state.reason}", ("running",))
        if run.holding is not None:
            await self._bill(job, run, since, policy)

    async def _bill(self, job: Job, run: Run, since: datetime | None, policy: Policy, again: bool = False) -> None:
        """The run's ledger interval: held, not billed, while its pod waits; billed from when its container
        started once it runs; seen again every `HEARTBEAT_S` (`again`: now)."""
        profile = policy.profiles.get(job.profile)
        runs = since is not None and profile is not None and profile.gpu is not None
        last = self.billed.get(run.holding)
        if not again and last is not None and last[0] == runs and time.monotonic() - last[1] < HEARTBEAT_S:
            return
        now = periods.utcnow()
        if runs:
            since = max(since, run.started_at)
            await asyncio.to_thread(self.ledger.keep_run, run.holding, job.user, job.team, job.profile,
                                    profile.gpu.model, profile_share(profile, policy), since, now,
                                    queue_wait=since - run.started_at)
        else:
            await asyncio.to_thread(self.ledger.heartbeat_run, run.holding, now)
        self.billed[run.holding] = (runs, time.monotonic())

    async def _end(self, job: Job, run: Run, ended: Ended, at: datetime, policy: Policy) -> Next | None:
        """The run's end, recorded by the runner once its output is all in its log; what the watch told of its
        pods goes."""
        await self.pod_logs.settle(job.id)  # the run's output is all in its log before its end is told
        following = await self.runner.end(job, run, ended, at, policy)
        if run.holding:
            self.billed.pop(run.holding, None)
        for key in [k for k in {*self.ends, *self.started} if k[0] == job.id and k[2] <= (run.cluster_retry or 0)]:
            self.ends.pop(key, None)
            self.started.pop(key, None)
            self.finished.pop(key, None)
        return following

    async def _delete(self, job_id: str) -> None:
        from kubernetes_asyncio.client import ApiException

        if job_id in self.deleting:
            return
        try:
            await self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                              job_name(job_id), propagation_policy="Foreground")
        except ApiException as error:
            if error.status != 404:
                raise
        self.deleting[job_id] = time.monotonic()
        self.log.info("gpupool job %s: Volcano Job %s deleted", job_id, job_name(job_id))


def _phase_state(found: Mapping[str, Any]) -> str:
    """gpupool's state of a Volcano Job, `unknown` for a phase gpupool does not know (left alone)."""
    try:
        return job_state(found).state
    except ValueError:
        return "unknown"


def _submission(obj: Mapping[str, Any] | None) -> str:
    """Which Volcano Job of its job a Volcano Job or pod is (`volcano_objects.SUBMISSION_LABEL`)."""
    return (((obj or {}).get("metadata") or {}).get("labels") or {}).get(SUBMISSION_LABEL, "")


def _from_phase(state: str) -> Ended:
    """How a run ended when its pod's end was not seen (it ended and went while no hub watched)."""
    if state == "succeeded":
        return Ended(Event.SUCCEEDED, 0)
    if state == "suspended":
        return Ended(Event.SUSPENDED, None)
    if state in ("failed", "cancelled"):
        return Ended(Event.FAILED, None)
    return Ended(Event.NODE_LOST, None)  # Volcano replaced its pod: not known to be the job's fault


def _api_message(error) -> str:
    try:
        return json.loads(error.body).get("message") or str(error.reason)
    except (TypeError, ValueError, AttributeError):
        return str(getattr(error, "reason", error))


_: type[JobBackend] = VolcanoBackend  # conformance, as Kueue's adapters assert theirs (and the tests at run time)
