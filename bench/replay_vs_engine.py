"""Benchmark (issue 38, item 4): `gpupool replay` against the real engine it models, on one slice of Philly.

    .venv/bin/python bench/replay_vs_engine.py [--jobs 500] [--offset 40000] [--compress 180] [--nodes 16]
                                               [--max-hours 6]

The same jobs, a slice of Microsoft's Philly trace (--jobs consecutive arrivals from the --offset-th, durations
clipped at --max-hours, each virtual cluster a team), go

(a) through `gpupool replay` with the pooled Philly policy (`replay.philly_policy`: no quotas; each team's
    former share of the cluster, scaled to --nodes nodes of 8 cards, is its queue's `deserved`), and
(b) through the real Volcano v1.14.4 on --nodes KWOK fake nodes of 8 cards (tests/kube_cluster.py, built by
    `make kube-tools`), with the Queues and PriorityClasses `gpupool render` writes for that policy and the
    scheduler configuration gpupool's chart ships. Each job is a Volcano Job as the Kubernetes mode makes one
    (its team's queue and priority class, gang of its pods, not preemptable: the pooled policy has no
    deprioritized work), created at its arrival time divided by --compress; a KWOK stage of this benchmark
    completes each pod --compress times sooner than the trace says (the duration is the pod's annotation).

Per team, in trace hours: mean and p95 queue wait (arrival to all of a job's pods running) and utilisation (the
GPU-time the team ran within the arrivals' window over the pool's), side by side with their differences. Every
engine figure is measured on the engine's clock and multiplied by --compress; so is the engine's own latency,
printed first: the wait of a job that arrives at an idle pool (the pod's creation, its PodGroup, one scheduling
cycle, the bind and KWOK's Running), which the replay does not model and which is in every engine wait: the
`net` columns are the engine's waits less that floor, and the differences are theirs from the replay's.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import requests
import yaml

from gpupool.hub import replay as R
from gpupool.spawner.kube import volcano_binding
from gpupool.spawner.volcano import team_queue

from testhelpers import load

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "philly"

NAMESPACE = "bench"
JOB_LABEL = "gpupool.bench/job"
#: How long a pod runs once Running, on the engine's clock (a Go duration): the benchmark's KWOK stage reads it.
RUNS_FOR = "gpupool.bench/runs-for"
NODE_CARDS = 8
MODEL = "P100"


def completing_stage(stages: Path) -> dict:
    """KWOK's own `pod-complete` stage (phase Succeeded, exit code 0), for the pods that carry `RUNS_FOR`, after
    that long Running."""
    stage = copy.deepcopy(yaml.safe_load((stages / "pod" / "fast" / "pod-complete.yaml").read_text()))
    stage["metadata"]["name"] = "bench-pod-complete-after-runs-for"
    stage["spec"]["selector"]["matchExpressions"] = [
        {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
        {"key": ".status.phase", "operator": "In", "values": ["Running"]},
        {"key": f'.metadata.annotations["{RUNS_FOR}"]', "operator": "Exists"},
    ]
    stage["spec"]["delay"] = {"durationMilliseconds": 1000,
                              "durationFrom": {"expressionFrom": f'.metadata.annotations["{RUNS_FOR}"]'}}
    return stage


# --- the workload and the policy --------------------------------------------------------------------------------


def scaled_teams(vcs: dict[str, int], teams: set[str], nodes: int) -> dict[str, int]:
    """Each team's former nodes scaled so that they sum to `nodes` (largest remainder, at least one each)."""
    sizes = {team: vcs[team] for team in sorted(teams)}
    if nodes < len(sizes):
        raise SystemExit(f"--nodes {nodes}: the slice has {len(sizes)} teams, each needs a node at least")
    total = sum(sizes.values())
    exact = {team: nodes * size / total for team, size in sizes.items()}
    given = {team: max(1, math.floor(value)) for team, value in exact.items()}
    for team in sorted(exact, key=lambda t: exact[t] - math.floor(exact[t]), reverse=True):
        if sum(given.values()) >= nodes:
            break
        given[team] += 1
    while sum(given.values()) > nodes:  # the at-least-one rounded some up: take from the largest
        given[max(given, key=given.get)] -= 1
    return given


def the_slice(args) -> tuple[R.Workload, int]:
    """The jobs (arrivals from 0, durations clipped, sizes the pool can hold in whole nodes or within one),
    and how many rows were left out for their size."""
    work = R.read_philly(TRACES / "philly.csv", model=MODEL)
    rows = work.jobs[args.offset:args.offset + args.jobs]
    first = rows[0].arrival
    kept, left_out = [], 0
    for job in rows:
        gpus = int(job.share)
        if job.share != gpus or gpus > args.nodes * NODE_CARDS or (gpus > NODE_CARDS and gpus % NODE_CARDS):
            left_out += 1
            continue
        kept.append(R.Job(job.key, job.user, job.team, job.model, job.share, job.arrival - first,
                          min(job.duration, args.max_hours * 3600)))
    return R.Workload(kept, work.start, f"philly jobs {args.offset}..{args.offset + args.jobs}"), left_out


# --- the engine -------------------------------------------------------------------------------------------------


def volcano_job(job: R.Job, compress: float) -> dict:
    """The job as the Kubernetes mode submits one to Volcano: its team's queue and priority class, all its pods
    a gang; whole nodes' worth of cards per pod beyond one node."""
    gpus = int(job.share)
    pods, per_pod = (gpus // NODE_CARDS, NODE_CARDS) if gpus > NODE_CARDS else (1, gpus)
    binding = volcano_binding(job.team, preemptible=False, deprioritized=False)
    name = job.key.replace("philly-", "p")
    labels = {JOB_LABEL: name}
    resources = {"nvidia.com/gpu": str(per_pod)}
    pod = {"metadata": {"labels": labels, "annotations": {**binding.annotations,
                                                          RUNS_FOR: f"{job.duration / compress:.3f}s"}},
           "spec": {"schedulerName": binding.scheduler_name, "priorityClassName": binding.priority_class_name,
                    "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "train", "image": "bench", "command": ["train"],
                                    "resources": {"limits": resources, "requests": resources}}]}}
    return {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels, "annotations": binding.annotations},
            "spec": {"schedulerName": binding.scheduler_name, "queue": team_queue(job.team),
                     "priorityClassName": binding.priority_class_name, "minAvailable": pods, "maxRetry": 100,
                     "policies": [{"event": "PodEvicted", "action": "RestartJob"}],
                     "tasks": [{"name": "train", "replicas": pods, "minAvailable": pods, "template": pod}]}}


@dataclass
class Seen:
    """One job on the engine's clock (seconds from the first submission)."""

    pods: int
    submitted: float | None = None
    running: dict | None = None  # pod name → when it was first seen Running
    done: dict | None = None  # pod name → when it was seen Succeeded
    evicted: int = 0

    @property
    def started(self) -> float | None:
        return max(self.running.values()) if self.running and len(self.running) >= self.pods else None

    @property
    def ended(self) -> float | None:
        return max(self.done.values()) if self.done and len(self.done) >= self.pods else None


class Watcher(threading.Thread):
    """The benchmark's pods, watched (list, then watch from its resourceVersion): when each was first Running and
    when it Succeeded, on the clock `now()`."""

    def __init__(self, cluster, seen: dict[str, Seen], now):
        super().__init__(daemon=True, name="bench-pod-watch")
        self.cluster, self.seen, self.now = cluster, seen, now
        self.stopping = threading.Event()

    def note(self, kind: str, pod: dict) -> None:
        job = self.seen.get(pod["metadata"].get("labels", {}).get(JOB_LABEL, ""))
        if job is None:
            return
        name, phase, at = pod["metadata"]["name"], pod["status"].get("phase"), self.now()
        if kind == "DELETED" and phase == "Running" and name in (job.running or {}):
            job.evicted += 1
        elif phase == "Running" and not pod["metadata"].get("deletionTimestamp"):
            job.running = job.running or {}
            job.running.setdefault(name, at)
        elif phase == "Succeeded":
            job.done = job.done or {}
            job.done.setdefault(name, at)

    def run(self) -> None:
        session, version = self.cluster.api(), ""
        url = f"{self.cluster.url}/api/v1/namespaces/{NAMESPACE}/pods"
        while not self.stopping.is_set():
            try:
                if not version:
                    listed = session.get(url, params={"labelSelector": JOB_LABEL}, timeout=30).json()
                    for pod in listed["items"]:
                        self.note("ADDED", pod)
                    version = listed["metadata"]["resourceVersion"]
                with session.get(url, params={"labelSelector": JOB_LABEL, "watch": "1", "resourceVersion": version,
                                              "timeoutSeconds": "60"}, stream=True, timeout=(5, 90)) as reply:
                    for line in reply.iter_lines():
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            version = ""
                            break
                        version = event["object"]["metadata"]["resourceVersion"]
                        self.note(event["type"], event["object"])
            except (requests.RequestException, ValueError, KeyError):
                version = ""
                self.stopping.wait(0.2)


def run_engine(work: R.Workload, policy, args) -> tuple[dict[str, Seen], float]:
    """The slice through the real Volcano: what the watch saw of each job, and the engine's latency floor (the
    median wait, engine seconds, of three one-card jobs that arrive one at a time at the idle pool)."""
    kc = load("kube_cluster")
    with tempfile.TemporaryDirectory() as tmp, \
            kc.running_cluster(stages=(completing_stage(kc.tools_dir() / "kwok-stages"),)) as cluster:
        for i in range(args.nodes):
            cluster.add_node(f"gpu-{MODEL.lower()}-{i}", {"nvidia.com/gpu.product": MODEL},
                             {**kc.NODE_BASICS, "nvidia.com/gpu": str(NODE_CARDS)})
        cluster.kubectl("create", "namespace", NAMESPACE)
        folder = Path(tmp) / "policies"
        folder.mkdir()
        R._write_policy(policy, folder)
        gpupool = Path(sys.executable).with_name("gpupool")
        manifest = subprocess.run([str(gpupool), "render", "--policies", str(folder), "--namespace", NAMESPACE],
                                  capture_output=True, text=True, check=True).stdout
        cluster.kubectl("apply", "--server-side", "-f", "-", input=manifest)
        session = cluster.api()
        jobs_url = f"{cluster.url}/apis/batch.volcano.sh/v1alpha1/namespaces/{NAMESPACE}/jobs"
        began = time.monotonic()
        seen: dict[str, Seen] = {}
        watcher = Watcher(cluster, seen, lambda: time.monotonic() - began)
        watcher.start()

        # The floor: one-card jobs at the idle pool, one at a time.
        team = next(iter(policy.teams))
        floor = []
        for n in range(3):
            probe = R.Job(f"philly-probe{n}", team, team, MODEL, Fraction(1), 0.0, 0.5 * args.compress)
            body = volcano_job(probe, args.compress)
            seen[body["metadata"]["name"]] = entry = Seen(1)
            entry.submitted = time.monotonic() - began
            session.post(jobs_url, json=body, timeout=30).raise_for_status()
            deadline = time.monotonic() + 60
            while entry.ended is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if entry.started is not None:
                floor.append(entry.started - entry.submitted)
        for name in list(seen):
            del seen[name]

        # The slice, each job at its arrival on the compressed clock.
        began = time.monotonic()
        watcher.now = lambda: time.monotonic() - began
        bodies = [(job, volcano_job(job, args.compress)) for job in work.jobs]
        for job, body in bodies:
            seen[body["metadata"]["name"]] = Seen(body["spec"]["minAvailable"])
        last_end = max(job.arrival / args.compress for job in work.jobs)
        for n, (job, body) in enumerate(bodies):
            wait = job.arrival / args.compress - (time.monotonic() - began)
            if wait > 0:
                time.sleep(wait)
            entry = seen[body["metadata"]["name"]]
            entry.submitted = time.monotonic() - began
            session.post(jobs_url, json=body, timeout=30).raise_for_status()
            if n % 50 == 49:
                done = sum(1 for s in seen.values() if s.ended is not None)
                print(f"  engine: {n + 1}/{len(bodies)} submitted at {entry.submitted:.0f} s "
                      f"(due at {job.arrival / args.compress:.0f} s), {done} done", flush=True)
        longest = max(job.duration for job in work.jobs) / args.compress
        deadline = time.monotonic() + last_end + longest + args.grace
        while time.monotonic() < deadline and any(s.ended is None for s in seen.values()):
            time.sleep(0.5)
        watcher.stopping.set()
        unfinished = sum(1 for s in seen.values() if s.ended is None)
        if unfinished:
            print(f"  engine: {unfinished} jobs had not finished when the benchmark stopped waiting")
        return seen, statistics.median(floor) if floor else math.nan


# --- the comparison ---------------------------------------------------------------------------------------------


def figures(records: list[tuple[str, int, float, float | None, float | None]], capacity: int,
            window: float) -> dict[str, dict]:
    """Per team and `all`, from (team, cards, arrival, start, end) in trace seconds: jobs, mean and p95 wait
    (hours; jobs that never started are left out and counted), and utilisation within [0, window]."""
    by_team: dict[str, list] = {}
    for record in records:
        by_team.setdefault(record[0], []).append(record)
    by_team["all"] = records
    out = {}
    for team, rows in by_team.items():
        waits = [start - arrival for _, _, arrival, start, _ in rows if start is not None]
        used = sum(cards * max(0.0, min(end if end is not None else window, window) - start)
                   for _, cards, _, start, end in rows if start is not None and start < window)
        out[team] = {"jobs": len(rows), "never_started": len(rows) - len(waits),
                     "wait_mean_h": statistics.fmean(waits) / 3600 if waits else 0.0,
                     "wait_p95_h": R.percentile(waits, 95) / 3600 if waits else 0.0,
                     "utilisation": used / (capacity * window)}
    return out


def difference(replayed: float, engine: float) -> str:
    if replayed == 0:
        return f"{engine - replayed:+.2f}"
    return f"{(engine - replayed) / replayed * 100:+.0f} %"


def table(replayed: dict, engine: dict, net: dict) -> str:
    """Waits: the replay's, the engine's, the engine's net of its latency floor, and the difference of the last
    from the replay's; utilisation: the replay's, the engine's and their difference."""
    lines = [f"{'team':<8} {'jobs':>5} | {'mean wait h':^34} | {'p95 wait h':^34} | {'utilisation %':^25}",
             f"{'':<8} {'':>5} | " + " | ".join([f"{'replay':>7} {'engine':>7} {'net':>7} {'diff':>8}"] * 2)
             + f" | {'replay':>7} {'engine':>7} {'diff':>8}"]
    for team in [*sorted(t for t in replayed if t != "all"), "all"]:
        a, b, n = replayed[team], engine[team], net[team]
        cells = [f"{a[key]:>7.2f} {b[key]:>7.2f} {n[key]:>7.2f} {difference(a[key], n[key]):>8}"
                 for key in ("wait_mean_h", "wait_p95_h")]
        cells.append(f"{a['utilisation'] * 100:>7.2f} {b['utilisation'] * 100:>7.2f} "
                     f"{difference(a['utilisation'], b['utilisation']):>8}")
        lines.append(f"{team:<8} {a['jobs']:>5} | " + " | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500, help="how many consecutive jobs of the trace")
    parser.add_argument("--offset", type=int, default=40000, help="the first job's index in arrival order")
    parser.add_argument("--compress", type=float, default=180.0, help="trace seconds per engine second")
    parser.add_argument("--nodes", type=int, default=16, help="nodes of 8 cards, in both")
    parser.add_argument("--max-hours", type=float, default=6.0, help="durations clipped at this many hours")
    parser.add_argument("--grace", type=float, default=120.0, help="engine seconds to wait past the last end")
    args = parser.parse_args()

    work, left_out = the_slice(args)
    vcs = R.read_philly_vcs(TRACES / "philly_vc.csv")
    teams = scaled_teams(vcs, {job.team for job in work.jobs}, args.nodes)
    policy = R.philly_policy(teams, dedicated=False, model=MODEL)
    capacity = args.nodes * NODE_CARDS
    window = max(3600.0, max(job.arrival for job in work.jobs))  # utilisation over the arrivals, an hour at least
    print(f"{len(work.jobs)} jobs of {work.source} ({left_out} left out for their size), over "
          f"{window / 3600:.1f} h of arrivals, {sum(float(j.share) * j.duration for j in work.jobs) / 3600:,.0f} "
          f"GPU-hours; {args.nodes} nodes of {NODE_CARDS} cards ({capacity}); teams (nodes deserved): "
          f"{', '.join(f'{t} {n}' for t, n in teams.items())}; compressed {args.compress:g}×")

    began = time.process_time()
    run = R.replay(work, policy, node_cards=NODE_CARDS)
    replay_s = time.process_time() - began
    replayed = figures([(r.job.team, int(r.job.share), r.job.arrival, r.started, r.ended)
                        for r in run.results.values()], capacity, window)

    began = time.perf_counter()
    seen, floor = run_engine(work, policy, args)
    engine_s = time.perf_counter() - began
    c = args.compress
    records = []
    for job in work.jobs:
        s = seen[job.key.replace("philly-", "p")]
        start = s.started * c if s.started is not None else None
        records.append((job.team, int(job.share), s.submitted * c, start, s.ended * c if s.ended else None))
    engine = figures(records, capacity, window)
    lag = floor * c  # the engine's own latency, in trace seconds, which the replay does not model
    net = figures([(team, cards, arrival, None if start is None else max(arrival, start - lag), end)
                   for team, cards, arrival, start, end in records], capacity, window)
    late = statistics.fmean(s.submitted - j.arrival / c for j, s in
                            ((j, seen[j.key.replace("philly-", "p")]) for j in work.jobs))
    print(f"\nreplay: {replay_s:.2f} s of CPU; engine: {engine_s:.0f} s of wall-clock time; submissions "
          f"{late * 1000:.0f} ms late on average; evictions {sum(s.evicted for s in seen.values())}")
    print(f"the engine's latency floor: {floor:.2f} s per job at an idle pool = {floor * c / 60:.1f} trace minutes "
          f"(in every engine wait)\n")
    print(table(replayed, engine, net))
    never = engine["all"]["never_started"], replayed["all"]["never_started"]
    if any(never):
        print(f"\nnever started: engine {never[0]}, replay {never[1]} (left out of the waits)")


if __name__ == "__main__":
    main()
