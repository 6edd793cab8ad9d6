"""The job frame (`gpupool.spawner.jobs`): each engine's adapter is a `JobBackend`, method for method, and the
runner written once hands each job to its backend (submit what waits, follow what runs, stop what its user
cancelled) and records each run's end by the restart rules in the jobs table and the ledger, on a real database.
"""

from __future__ import annotations

import asyncio
import inspect
import logging

import pytest
import yaml

from gpupool.hub.accounting.jobs import JobStore, JobSubmission, resolve
from gpupool.hub.accounting.ledger import Ledger, job_run_key
from gpupool.policies import periods
from gpupool.policies.model import Policy
from gpupool.policies.restarts import Ended, Event
from gpupool.spawner.jobs.local import LocalBackend
from gpupool.spawner.jobs.runner import JobBackend, JobRunner
from gpupool.spawner.jobs.volcano import VolcanoBackend
from gpupool.spawner.volcano import Release

POLICY = """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 2}]
teams:
  vision: {members: [alice], quota: {gpus: 1}, budget: {gpu_hours: 100}}
profiles:
  cpu: {display_name: CPU only, teams: [vision]}
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision]}
jobs: {restarts: {max_restarts: 1, backoff_seconds: 0}}
billing: {prices: {H200: '3.20'}}
"""

#: The protocol's methods, as it declares them.
METHODS = sorted(name for name, value in vars(JobBackend).items() if inspect.isfunction(value)
                 and not name.startswith("_"))


def adapters() -> list:
    """One of each engine's adapter, as the hub makes them (nothing is started by making one)."""
    return [LocalBackend(None, "/nonexistent", None, None, None, "http://127.0.0.1:8081/hub/api"),
            VolcanoBackend(None, None, "gpupool", Release(), "quay.io/jupyterhub/singleuser:5.3")]


def test_the_protocol_names_what_the_runner_calls():
    assert METHODS == ["adopt", "bind", "close", "follow", "look", "stop", "submit", "tidy"]


@pytest.mark.parametrize("backend", adapters(), ids=lambda b: type(b).__name__)
def test_each_engine_adapter_is_a_job_backend_method_for_method(backend):
    assert isinstance(backend, JobBackend)
    for name in METHODS:
        declared, implemented = getattr(JobBackend, name), getattr(type(backend), name)
        assert list(inspect.signature(implemented).parameters) == list(inspect.signature(declared).parameters), name
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), name


class Recorder:
    """An engine that records what the runner hands it: it runs a submitted job at once (through the door for a
    GPU profile), stops a run the moment it is asked, and ends a followed run as `ends` says."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.ends: dict[str, Ended] = {}

    def bind(self, runner: JobRunner) -> None:
        self.runner = runner

    async def adopt(self) -> None:
        self.calls.append(("adopt",))

    async def look(self) -> None:
        self.calls.append(("look",))

    async def submit(self, job, policy) -> None:
        self.calls.append(("submit", job.id))
        now = periods.utcnow()
        holding = None
        if policy.profiles[job.profile].gpu is not None:
            holding = job_run_key(job.id, now)
            decision = await self.runner.admit(job, policy, holding, now)
            if not decision.admitted:
                await self.runner.turned_away(job, decision, now)
                return
        await asyncio.to_thread(self.runner.store.start_run, job.id, now, holding=holding)

    async def follow(self, job, run, policy) -> None:
        self.calls.append(("follow", job.id, run.attempt))
        if job.id in self.ends:
            await self.runner.end(job, run, self.ends.pop(job.id), periods.utcnow(), policy)

    async def stop(self, job, run, why, policy) -> None:
        self.calls.append(("stop", job.id, why))
        await self.runner.end(job, run, Ended(why, None), periods.utcnow(), policy)

    async def tidy(self, live, policy) -> None:
        self.calls.append(("tidy", sorted(live)))

    async def close(self) -> None:
        self.calls.append(("close",))


@pytest.fixture
def frame(database_url):
    ledger = Ledger(database_url)
    policy = Policy.model_validate(yaml.safe_load(POLICY))
    backend = Recorder()
    runner = JobRunner(JobStore(ledger.engine), ledger, lambda: policy, backend, logging.getLogger("test-jobs"))
    yield runner, backend, policy
    ledger.dispose()


def submit(runner: JobRunner, policy: Policy, profile: str):
    submission = JobSubmission(profile=profile, team="vision", command=["python", "train.py"])
    return runner.store.submit("alice", resolve(policy, "alice", ["vision"], submission), submission,
                               periods.utcnow())


async def rounds(runner: JobRunner, backend: Recorder, count: int = 1) -> list[tuple]:
    """What the backend was handed in `count` rounds."""
    backend.calls.clear()
    for _ in range(count):
        await runner.step()
    return list(backend.calls)


@pytest.mark.asyncio
async def test_the_runner_submits_what_waits_follows_what_runs_and_stops_what_is_cancelled(frame):
    runner, backend, policy = frame
    job = submit(runner, policy, "h200-quarter")
    assert await rounds(runner, backend) == [("look",), ("submit", job.id), ("tidy", [job.id])]
    run = runner.store.runs(job.id)[-1]
    assert runner.store.get(job.id).state == "running"
    assert [i.run or i.key for i in runner.ledger.open_intervals()] == [run.holding]  # held through the door

    assert await rounds(runner, backend) == [("look",), ("follow", job.id, 1), ("tidy", [job.id])]

    runner.store.cancel(job.id, periods.utcnow())
    # (the round's jobs are those of its start: the job was live then)
    assert await rounds(runner, backend) == [("look",), ("stop", job.id, Event.CANCELLED), ("tidy", [job.id])]
    assert runner.store.get(job.id).state == "cancelled"
    assert runner.ledger.open_intervals() == []  # its holding closed as the run ended
    assert await rounds(runner, backend) == [("look",), ("tidy", [])]


@pytest.mark.asyncio
async def test_a_run_ended_through_the_runner_moves_its_job_on_by_the_restart_rules(frame):
    runner, backend, policy = frame
    job = submit(runner, policy, "cpu")
    await rounds(runner, backend)
    backend.ends[job.id] = Ended(Event.FAILED, 1)  # one restart allowed: it restarts (no back-off), run 2
    assert await rounds(runner, backend, 2) == [("look",), ("follow", job.id, 1), ("tidy", [job.id]),
                                                ("look",), ("submit", job.id), ("tidy", [job.id])]
    assert [(r.attempt, r.event, r.exit_code) for r in runner.store.runs(job.id)] == [(1, "failed", 1), (2, None, None)]
    backend.ends[job.id] = Ended(Event.FAILED, 1)  # its restart used up: the job fails
    await rounds(runner, backend)
    assert runner.store.get(job.id).state == "failed"

    other = submit(runner, policy, "cpu")
    await rounds(runner, backend)
    runner.store.suspend(other.id, periods.utcnow())
    assert ("stop", other.id, Event.SUSPENDED) in await rounds(runner, backend)
    assert runner.store.get(other.id).state == "suspended"


@pytest.mark.asyncio
async def test_a_job_the_policy_can_no_longer_run_is_refused_saying_why(frame):
    runner, backend, policy = frame
    job = submit(runner, policy, "cpu")
    assert await runner.refused_by_policy(job, Policy.model_validate(
        yaml.safe_load(POLICY.replace("  cpu: {display_name: CPU only, teams: [vision]}\n", ""))))
    refused = runner.store.get(job.id)
    assert refused.state == "failed" and "cpu" in refused.reason
    assert not await runner.refused_by_policy(submit(runner, policy, "cpu"), policy)
