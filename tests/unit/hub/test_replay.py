"""`gpupool replay`: the replay agrees with the real embedded pool, reads the public traces, and answers per team."""

from __future__ import annotations

import asyncio
import heapq
import json
import random
import re
import subprocess
import sys
from datetime import datetime, timezone
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest

from gpupool.hub import replay as R
from gpupool.policies.model import Policy
from gpupool.policies.placement import placement_for
from gpupool.spawner.pool import AllocationStore, Card, Denied, LocalPool, Request

REPO = Path(__file__).resolve().parents[3]
TRACES = REPO.parent / "shared" / "data" / "traces"
START = datetime(2026, 3, 31, 22, 0, tzinfo=timezone.utc)  # two hours before a budget period ends

POLICY = Policy.model_validate({
    "models": {"H200": {"vendor": "nvidia", "memory_gib": 141, "backends": ["hami", "whole"]}},
    "inventory": [{"model": "H200", "count": 3}],
    "teams": {
        "vision": {"priority": 100, "quota": {"gpus": 2, "per_user_gpus": 1},
                   "budget": {"gpu_hours": 1, "on_exhausted": "deprioritize"}},
        "nlp": {"priority": 50, "quota": {"gpus": 2}, "budget": {"gpu_hours": 2, "on_exhausted": "deny"}},
        "audio": {"quota": {}},
    },
})
SHARES = [Fraction(1, 4), Fraction(1, 2), Fraction(1), Fraction(1), Fraction(2), Fraction(3), Fraction(4)]


def workload(seed: int, n: int = 28) -> R.Workload:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        team = rng.choice(["vision", "nlp", "audio"])
        # Whole minutes, so that arrivals and ends often fall on the same instant.
        jobs.append(R.Job(f"job{i}", f"{team}-u{rng.randrange(3)}", team, "H200", rng.choice(SHARES),
                          60.0 * rng.randrange(0, 240), 60.0 * rng.randrange(1, 90)))
    return R.Workload(sorted(jobs, key=lambda j: j.arrival), START)


class RecordingStore(AllocationStore):
    """The real allocation store, noting the order in which placements succeed (within one queue pass too)."""

    def __init__(self, path):
        super().__init__(path)
        self.order: list[str] = []

    def reserve(self, request, cards, *placement):
        allocation = super().reserve(request, cards, *placement)
        if allocation is not None:
            self.order.append(request.key)
        return allocation


async def run_the_real_pool(work: R.Workload, policy: Policy, tmp_path: Path) -> dict:
    """The workload through `LocalPool` (SQLite allocations, asyncio queue) on a virtual clock of our own."""
    store = RecordingStore(tmp_path / "allocations.sqlite")
    meter = R.Meter(work.start)
    decide = R.Admission(policy, meter)
    cards = R.pool_cards(policy)
    pool = LocalPool(cards, store, decide, lambda model: placement_for(policy, model))  # as `get_pool` wires it
    heap = [(job.arrival, 1, seq, job) for seq, job in enumerate(work.jobs)]
    heapq.heapify(heap)
    tasks: dict[str, asyncio.Task] = {}
    started: dict[str, tuple[float, tuple[str, ...]]] = {}
    denied: set[str] = set()
    while heap:
        now, kind, seq, job = heapq.heappop(heap)
        decide.at(now)
        if kind == 0:
            pool.release(job.key)
            meter.ended(job.team, float(job.share), started[job.key][0], now)
        else:
            request = Request(job.key, job.user, job.team, R.DIRECT_PROFILE, job.key, job.model, job.share,
                              policy.teams[job.team].priority)
            task = tasks[job.key] = asyncio.create_task(pool.acquire(request))
            while pool.ticket(job.key) is None and not task.done():
                await asyncio.sleep(0)
        # Whatever this event let start: let those acquires return before the clock moves on.
        await asyncio.sleep(0)  # a new acquire reaches the queue
        await pool.settled()
        settled = [(key, t) for key, t in tasks.items() if key not in started and key not in denied
                   and (t.done() or (pool.ticket(key) is not None and pool.ticket(key).future.done()))]
        for key, task in settled:
            try:
                allocation = await task
            except Denied:
                denied.add(key)
                continue
            index, placed = next((i, j) for i, j in enumerate(work.jobs) if j.key == key)
            started[key] = (now, allocation.cards)
            meter.started(placed.team, float(placed.share), now)
            heapq.heappush(heap, (now + placed.duration, 0, index, placed))
    return {"order": store.order, "started": started, "denied": denied}


#: POLICY with profiles of a quarter and a half card, whose shares fragmentation-aware placement keeps usable.
PROFILED = {
    placement: Policy.model_validate({
        **POLICY.model_dump(mode="json", exclude_defaults=True),
        "profiles": {name: {"display_name": name, "gpu": {"model": "H200", "share": share}, "teams": ["vision"]}
                     for name, share in (("quarter", 0.25), ("half", 0.5))},
        "settings": {"placement": placement},
    })
    for placement in ("best-fit", "fragmentation-aware")
}


# Seeds 5 and 9 place 8 and 9 jobs on other cards under fragmentation-aware placement than under best fit.
@pytest.mark.parametrize("seed, policy", [(1, POLICY), (2, POLICY), (3, POLICY), (4, PROFILED["best-fit"]),
                                          (5, PROFILED["fragmentation-aware"]), (9, PROFILED["fragmentation-aware"])])
def test_the_replay_agrees_with_the_real_pool(seed, policy, tmp_path):
    work = workload(seed)
    real = asyncio.run(run_the_real_pool(work, policy, tmp_path))
    run = R.replay(work, policy)
    assert run.placed_order == real["order"]
    assert {k: (r.started, r.cards) for k, r in run.results.items() if r.started is not None} == real["started"]
    assert {k for k, r in run.results.items() if r.denied} == real["denied"]
    # The workload exercises what it claims to: waits, denials and deprioritized work.
    assert any(r.wait for r in run.results.values())
    assert real["denied"]


def test_placement_is_the_pools_on_one_node_and_packs_nodes():
    cards = [Card(f"c{i}", "H200", i, 141) for i in range(8)]
    one = R.Cluster(cards)
    r = lambda key, share: Request(key, "u", "t", "direct", key, "H200", Fraction(share))  # noqa: E731
    assert one.reserve(r("a", Fraction(1, 2))).cards == ("c0",)
    assert one.reserve(r("b", 2)).cards == ("c1", "c2")
    nodes = R.Cluster(cards, node_cards=4)
    assert nodes.reserve(r("a", 1)).cards == ("c0",)
    assert nodes.reserve(r("b", 3)).cards == ("c1", "c2", "c3")  # the fullest node that fits
    assert nodes.reserve(r("c", 2)).cards == ("c4", "c5")
    nodes.release("a")
    assert nodes.reserve(r("d", 3)) is None  # one node has 1 free, the other 2: three do not fit on one
    gang = R.Cluster(cards, node_cards=2)
    gang.reserve(r("x", 1))
    assert sorted(gang.reserve(r("y", 5)).cards) == ["c2", "c3", "c4", "c5", "c6"]  # gang: all or nothing
    assert gang.reserve(r("z", 3)) is None


def test_budgets_deprioritize_and_deny_on_the_virtual_clock():
    jobs = [R.Job(f"v{i}", "vision-a", "vision", "H200", Fraction(1), 3600.0 * i, 3600.0) for i in range(3)]
    jobs += [R.Job(f"n{i}", "nlp-a", "nlp", "H200", Fraction(1), 3600.0 * i, 3600.0) for i in range(4)]
    run = R.replay(R.Workload(jobs, datetime(2026, 3, 1, tzinfo=timezone.utc)), POLICY)
    s = R.summary(run)
    assert s["teams"]["vision"]["deprioritized"] == 2  # its one GPU-hour is used after the first job
    assert s["teams"]["nlp"]["denied"] == 2  # two GPU-hours, then on_exhausted: deny
    assert "budget of 2 GPU-hours for 2026-03 used" in run.results["n2"].denied
    # Deprioritized work still runs, past the budget: vision's three GPU-hours against its one; nlp's refusals
    # keep it within its two; audio has no budget.
    assert s["teams"]["vision"]["over_budget_gpu_hours"] == 2.0
    assert s["teams"]["nlp"]["over_budget_gpu_hours"] == 0.0
    assert s["overall"]["over_budget_gpu_hours"] == 2.0


ONE_CARD = Policy.model_validate({
    "models": {"H200": {"vendor": "nvidia", "memory_gib": 141, "backends": ["hami", "whole"]}},
    "inventory": [{"model": "H200", "count": 1}],
    "teams": {"vision": {"priority": 100}, "nlp": {"priority": 10}, "audio": {"priority": 10}},
})


def test_a_higher_priority_request_preempts_a_preemptible_job_which_resumes_where_it_stopped():
    jobs = [R.Job("train", "nlp-a", "nlp", "H200", Fraction(1), 0.0, 7200.0, preemptible=True),
            R.Job("notebook", "vision-a", "vision", "H200", Fraction(1, 2), 3600.0, 3600.0, kind="server")]
    run = R.replay(R.Workload(jobs, START), ONE_CARD)
    train, notebook = run.results["train"], run.results["notebook"]
    assert notebook.started == 3600.0 and notebook.wait == 0  # it made room at once
    assert train.preempted == 1 and train.pieces == [(0.0, 3600.0), (7200.0, 10800.0)]  # 1 h left, after it
    s = R.summary(run)
    assert s["teams"]["nlp"]["preempted"] == 1 and s["teams"]["nlp"]["gpu_hours"] == 2.0  # the 2 h it ran
    assert s["overall"]["preempted"] == 1
    # Not preemptible, of a team of the same priority, or with preemption off: the notebook waits instead.
    for jobs_now, policy in (
            ([replace(jobs[0], preemptible=False), jobs[1]], ONE_CARD),
            ([replace(jobs[0], team="audio"), replace(jobs[1], team="nlp")], ONE_CARD),
            (jobs, ONE_CARD.model_copy(update={"jobs": ONE_CARD.jobs.model_copy(update={
                "preemption": ONE_CARD.jobs.preemption.model_copy(update={"enabled": False})})}))):
        waited = R.replay(R.Workload(jobs_now, START), policy)
        assert waited.results["notebook"].wait == 3600.0 and waited.results["train"].preempted == 0
    # Only what is needed: a quarter card asked, one of two preemptible halves stopped (the latest started).
    halves = [R.Job(f"half{i}", "nlp-a", "nlp", "H200", Fraction(1, 2), 60.0 * i, 7200.0, preemptible=True)
              for i in range(2)]
    run = R.replay(R.Workload(halves + [R.Job("q", "vision-a", "vision", "H200", Fraction(1, 4), 600.0, 60.0,
                                                  kind="server")], START), ONE_CARD)
    assert [run.results[f"half{i}"].preempted for i in range(2)] == [0, 1]


def test_an_over_budget_request_preempts_nothing_and_the_replay_ends():
    # vision's one GPU-hour is spent: its next request is admitted deprioritized (the lowest priority), behind
    # nlp's preemptible job, which it must not preempt (nor, re-admitted ahead of it, again and again).
    budget = ONE_CARD.model_copy(update={"teams": {**ONE_CARD.teams, "vision": ONE_CARD.teams["vision"].model_copy(
        update={"budget": POLICY.teams["vision"].budget})}})
    jobs = [R.Job("spent", "vision-a", "vision", "H200", Fraction(1), 0.0, 3600.0),
            R.Job("train", "nlp-a", "nlp", "H200", Fraction(1), 3600.0, 7200.0, preemptible=True),
            R.Job("late", "vision-a", "vision", "H200", Fraction(1), 4000.0, 600.0)]
    run = R.replay(R.Workload(jobs, datetime(2026, 3, 1, tzinfo=timezone.utc)), budget)
    assert run.results["train"].preempted == 0 and run.results["late"].deprioritized
    assert run.results["late"].started == 3600.0 + 7200.0  # after nlp's job, as the lowest priority


def test_marking_teams_preemptible(tmp_path):
    jobs = [R.Job("a", "nlp-a", "nlp", "H200", Fraction(1), 0.0, 60.0),
            R.Job("b", "nlp-a", "nlp", "H200", Fraction(1), 0.0, 60.0, kind="server"),
            R.Job("c", "vision-a", "vision", "H200", Fraction(1), 0.0, 60.0)]
    marked = R.preemptible(R.Workload(jobs, START), {"nlp"})
    assert [j.preemptible for j in marked.jobs] == [True, False, False]  # servers never are


def test_budget_overruns_are_counted_per_period():
    # An `alert` team's one GPU-hour a month: its work past it, month by month (START is 2 h before April).
    alert = POLICY.model_copy(update={"teams": {"audio": POLICY.teams["audio"].model_copy(update={
        "budget": POLICY.teams["vision"].budget.model_copy(update={"on_exhausted": "alert"})})}})
    split = [R.Job(f"a{i}", "audio-a", "audio", "H200", Fraction(1), 0.0, 7200.0 + 7200.0 * i) for i in range(2)]
    # a0 runs 22:00–24:00 (2 h in March), a1 22:00–02:00 (2 h in March, 2 h in April): March 4 h, April 2 h.
    run = R.replay(R.Workload(split, START), alert)
    assert R.summary(run)["teams"]["audio"]["over_budget_gpu_hours"] == 3.0 + 1.0
    # Half a card for 4 h across the month's end: 1 GPU-h in each month, within both budgets.
    across = [R.Job("b", "audio-a", "audio", "H200", Fraction(1, 2), 0.0, 3600.0 * 4)]
    assert R.summary(R.replay(R.Workload(across, START), alert))["teams"]["audio"]["over_budget_gpu_hours"] == 0.0
    # The same 2 GPU-h inside March: one over.
    inside = R.Workload(across, datetime(2026, 3, 1, tzinfo=timezone.utc))
    assert R.summary(R.replay(inside, alert))["teams"]["audio"]["over_budget_gpu_hours"] == 1.0


PHILLY = TRACES / "philly" / "philly.csv"
PHILLY_VC = TRACES / "philly" / "philly_vc.csv"


def decided(run: R.Replay) -> dict:
    """Everything a replay decided and reports, to compare two replays of the same workload."""
    return {"order": run.placed_order, "end": run.end, "events": run.events, "timeline": run.timeline,
            "results": {k: (r.started, r.ended, r.cards, r.denied, r.deprioritized, r.preempted, r.pieces)
                        for k, r in run.results.items()},
            "summary": R.summary(run)}


#: POLICY's quotas without its budgets: with no budget the usage stands all month, and so do remembered verdicts.
QUOTAS = Policy.model_validate({"models": POLICY.model_dump(mode="json")["models"], "inventory": [
    {"model": "H200", "count": 3}], "teams": {name: {"priority": team.priority, "quota": team.quota.model_dump(
        mode="json", exclude_none=True)} for name, team in POLICY.teams.items()}})


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", [POLICY, QUOTAS], ids=["budgets", "quotas"])
def test_a_remembered_verdict_is_the_verdict_decide_gives(seed, policy):
    # The replay keeps a verdict per question and team holdings while the usage stands (`Admission`'s memo);
    # deciding every question afresh replays the same: quotas per team and member, budgets that deprioritize
    # and deny across a period's end, and preemption (nlp and audio's jobs are preemptible).
    work = R.preemptible(workload(seed, n=80), {"nlp", "audio"})
    remembered = R.replay(work, policy, timeline_points=50)
    assert decided(remembered) == decided(R.replay(work, policy, timeline_points=50, memo=False))
    assert any(r.wait for r in remembered.results.values())
    assert any(r.denied for r in remembered.results.values())
    if policy is POLICY:
        assert any(r.deprioritized for r in remembered.results.values())


@pytest.mark.parametrize("dedicated", [True, False])
def test_philly_slice_replays_the_same_with_and_without_remembered_verdicts(dedicated):
    # The whole trace was compared byte for byte before and after the replay's speed-ups (docs/replay.md); this
    # keeps the part of that which the memo could break, on a slice in which dedicated quotas make teams wait.
    work = R.read_philly(PHILLY, limit=8000)  # dedicated, a cluster is full from job 5,337 on
    policy = R.philly_policy(R.read_philly_vcs(PHILLY_VC), dedicated=dedicated)
    fast = R.replay(work, policy, node_cards=8)
    assert decided(fast) == decided(R.replay(work, policy, node_cards=8, memo=False))
    assert (R.summary(fast)["overall"]["wait_max_s"] > 0) == dedicated


@pytest.mark.parametrize("policy", ["best-fit", "fragmentation-aware"])
def test_the_clusters_node_is_the_best_scored_node_after_thousands_of_changes(policy):
    # The cluster finds the best node from heaps it brings up to date only when asked; a pass over every node
    # finds the same one, through more changes than the cluster keeps in its log.
    from gpupool.policies.placement import Placement, choose_cards, free_state, node_score

    rng = random.Random(3)
    cards = [Card(f"c{i}", "H200", i, 141) for i in range(48)]
    shares = [Fraction(1, 4), Fraction(1, 2), Fraction(1), Fraction(1), Fraction(2), Fraction(3), Fraction(4)]
    placement = Placement(policy, tuple((s, Fraction(1, len(shares))) for s in shares))
    cluster = R.Cluster(cards, node_cards=4, placement=lambda model: placement, scale=4)
    nodes, scoring = cluster.nodes["H200"], cluster.scoring["H200"]
    changes = 0
    for n in range(2500):
        share = rng.choice(shares)
        units = int(share * 4)
        scores = [(node_score(free_state([cluster.card_free[c.uuid] for c in node]), units, scoring), i)
                  for i, node in enumerate(nodes)]
        best = min(((score, i) for score, i in scores if score is not None), default=None)
        expected = None
        if best is not None:
            node = nodes[best[1]]
            expected = tuple(node[i].uuid for i in choose_cards([cluster.card_free[c.uuid] for c in node], units,
                                                                 scoring))
        allocation = cluster.reserve(Request(f"r{n}", "u", "t", "direct", "", "H200", share))
        assert (allocation.cards if allocation else None) == expected
        changes += allocation is not None
        while cluster.held and rng.random() < 0.5:
            cluster.release(rng.choice(sorted(cluster.held)))
            changes += 1
    assert changes > 8 * len(nodes) + 1024  # the log of changed nodes was cut at least once


def test_philly_dedicated_against_pooled_on_the_first_jobs():
    work = R.read_philly(PHILLY, limit=3000)
    vcs = R.read_philly_vcs(PHILLY_VC)
    assert sum(vcs.values()) * 8 == 2816
    dedicated = R.summary(R.replay(work, R.philly_policy(vcs, dedicated=True), node_cards=8))
    pooled = R.summary(R.replay(work, R.philly_policy(vcs, dedicated=False), node_cards=8))
    assert dedicated["overall"]["jobs"] == pooled["overall"]["jobs"] == 3000
    # Borrowing idle cards never makes the slowest wait longer here, and never loses work.
    assert pooled["overall"]["wait_max_s"] <= dedicated["overall"]["wait_max_s"]
    assert pooled["overall"]["completed"] >= dedicated["overall"]["completed"]


def test_the_cli_from_another_folder(tmp_path):
    pooled, dedicated = tmp_path / "pooled", tmp_path / "dedicated"
    done = subprocess.run(
        [sys.executable, "-m", "gpupool.hub.cli", "replay", str(PHILLY), "--write-philly-policies", str(tmp_path),
         "--philly-vcs", str(PHILLY_VC)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "gpupool.hub.cli", "replay", str(PHILLY), "--policies", str(pooled),
         "--against", str(dedicated), "--node-cards", "8", "--limit", "500", "--format", "json"],
        capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == {str(pooled), str(dedicated)}
    assert result[str(pooled)]["overall"]["jobs"] == 500
    table = subprocess.run(
        [sys.executable, "-m", "gpupool.hub.cli", "replay", str(PHILLY), "--policies", str(pooled),
         "--node-cards", "8", "--limit", "200", "--capacity", "P100=64"], capture_output=True, text=True, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "64 P100" in table.stdout and "wait p95" in table.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "gpupool.hub.cli", "replay", str(PHILLY), "--policies", str(pooled),
         "--capacity", "H100=4"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "H100" in bad.stderr and "P100" in bad.stderr


def test_find_capacity_pooled_needs_fewer_cards_than_dedicated():
    # Two teams whose busy hours do not overlap: pooled, they share one set of cards.
    jobs = [R.Job(f"a{i}", "a", "vision", "H200", Fraction(1), 600.0 * i, 3000.0) for i in range(6)]
    jobs += [R.Job(f"b{i}", "b", "audio", "H200", Fraction(1), 86400.0 + 600.0 * i, 3000.0) for i in range(6)]
    policy = Policy.model_validate({**POLICY.model_dump(), "teams": {"vision": {}, "audio": {}}})
    found = R.find_capacity(R.Workload(jobs, START), policy, "H200", 0.0)
    assert found["pooled"]["cards"] == 5  # jobs 0..4 of a team overlap; the sixth starts as the first ends
    assert found["dedicated"]["cards"] == 10
    assert {t: v["cards"] for t, v in found["dedicated"]["teams"].items()} == {"vision": 5, "audio": 5}
    assert found["pooled"]["utilisation"] > found["dedicated"]["utilisation"]
    assert "pooled:    5 H200" in R.capacity_table(found)


def test_a_replay_gives_up_once_a_team_is_sure_to_miss_its_wait_target():
    jobs = [R.Job(f"a{i}", "a", "vision", "H200", Fraction(1), 0.0, 3600.0) for i in range(40)]
    full = R.replay(R.Workload(jobs, START), POLICY.model_copy(update={"teams": {"vision": POLICY.teams["audio"]}}))
    assert not full.aborted and full.results["a39"].started == 13 * 3600.0
    short = R.replay(R.Workload(jobs, START), POLICY.model_copy(update={"teams": {"vision": POLICY.teams["audio"]}}),
                     give_up_over=600.0)
    # 40 jobs allow 2 waits above p95; three cards start the 4th to 6th jobs an hour late: the 3rd late one stops it.
    assert short.aborted and short.results["a5"].started == 3600.0 and short.results["a6"].started is None


def test_the_platforms_own_history_is_exported_and_replayed(tmp_path):
    """`gpupool usage export` from another folder writes a month's runs; `gpupool replay` reads them back and
    replays exactly the work the ledger recorded."""
    from datetime import timedelta

    from gpupool.hub.accounting.ledger import INTERVALS, Ledger, job_run_key

    url = f"sqlite:///{tmp_path / 'usage.sqlite'}"
    ledger = Ledger(url)
    t0 = datetime(2026, 11, 2, 9, 0, tzinfo=timezone.utc)
    minutes = lambda n: t0 + timedelta(minutes=n)  # noqa: E731
    # alice's server: asked for at 9:00, waited 10 min, ran 2 h on a quarter card.
    ledger.keep_run("alice/@1", "alice", "vision", "h200-quarter", "H200", Fraction(1, 4), minutes(10), minutes(10),
                    queue_wait=timedelta(minutes=10))
    ledger.close_run("alice/@1", minutes(130), "stopped")
    # bob's training job: a whole card for an hour, no wait.
    job = job_run_key("0123456789ab", minutes(30))
    ledger.keep_run(job, "bob", "vision", "h200", "H200", Fraction(1), minutes(30), minutes(30))
    ledger.close_run(job, minutes(90), "stopped")
    # carol's holding, admitted but never run (as the door leaves it): not usage, not exported.
    ledger.open_interval("carol-held", "carol", "vision", "h200", "H200", Fraction(1), minutes(40))
    with ledger.engine.begin() as connection:
        connection.execute(INTERVALS.update().where(INTERVALS.c.key == "carol-held").values(state="reserved"))
    ledger.close_interval("carol-held", minutes(41), "failed")
    ledger.dispose()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = elsewhere / "november.csv"
    done = subprocess.run([sys.executable, "-m", "gpupool.hub.cli", "usage", "export", "--period", "2026-11",
                           "--ledger", url, "--output", out.name], capture_output=True, text=True, cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert "2 runs of 2026-11" in done.stderr
    lines = out.read_text().splitlines()
    assert lines == [
        "arrival,start,end,user,team,profile,model,share,kind,how",
        "2026-11-02T09:00:00Z,2026-11-02T09:10:00Z,2026-11-02T11:10:00Z,alice,vision,h200-quarter,H200,1/4,server,stopped",
        "2026-11-02T09:30:00Z,2026-11-02T09:30:00Z,2026-11-02T10:30:00Z,bob,vision,h200,H200,1,job,stopped",
    ]

    # A run across the end of the month is counted in each month for its part, as the bills count it.
    ledger = Ledger(url)
    late = datetime(2026, 11, 30, 23, 0, tzinfo=timezone.utc)
    ledger.keep_run("dave/@1", "dave", "vision", "h200", "H200", Fraction(1), late, late)
    ledger.close_run("dave/@1", late + timedelta(hours=2), "stopped")
    ledger.dispose()
    for period, expected in (("2026-11", "2026-11-30T23:00:00Z,2026-11-30T23:00:00Z,2026-12-01T00:00:00Z,dave,"
                                          "vision,h200,H200,1,server,running"),
                             ("2026-12", "2026-12-01T00:00:00Z,2026-12-01T00:00:00Z,2026-12-01T01:00:00Z,dave,"
                                          "vision,h200,H200,1,server,stopped")):
        done = subprocess.run([sys.executable, "-m", "gpupool.hub.cli", "usage", "export", "--period", period,
                               "--ledger", url], capture_output=True, text=True, cwd=elsewhere)
        assert done.returncode == 0 and expected in done.stdout.splitlines(), done.stdout + done.stderr

    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "policy.yaml").write_text(
        "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami, whole]}\n"
        "inventory: [{model: H200, count: 2}]\nteams:\n  vision: {}\n")
    done = subprocess.run([sys.executable, "-m", "gpupool.hub.cli", "replay", out.name, "--policies", str(policies),
                           "--format", "json"], capture_output=True, text=True, cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    overall = json.loads(done.stdout)[str(policies)]["overall"]
    # The same work: 0.25 × 2 h + 1 × 1 h = 1.5 GPU-hours, both runs done, on two cards neither waits.
    assert (overall["jobs"], overall["completed"], overall["gpu_hours"]) == (2, 2, 1.5)
    assert overall["wait_max_s"] == 0

    bad = elsewhere / "bad.csv"
    bad.write_text(lines[0] + "\nyesterday,,,alice,vision,x,H200,1/4,server,stopped\n")
    done = subprocess.run([sys.executable, "-m", "gpupool.hub.cli", "replay", bad.name, "--policies", str(policies)],
                          capture_output=True, text=True, cwd=elsewhere)
    assert done.returncode != 0 and "row 2 is not a usage export's row" in done.stderr


def test_the_html_report_has_the_table_with_differences_marked_and_a_timeline_per_policy_set():
    work = workload(3)
    bigger = Policy.model_validate({**POLICY.model_dump(), "inventory": [{"model": "H200", "count": 6}]})
    runs = {name: R.replay(work, policy, timeline_points=50) for name, policy in (("three", POLICY), ("six", bigger))}
    summaries = {name: R.summary(run) for name, run in runs.items()}
    page = R.html_report(summaries, runs, "synthetic")
    assert page.startswith("<!doctype html>") and page.count("<svg ") == 2
    assert 'aria-label="three: utilisation and queue over time"' in page
    # Six cards serve the same work with shorter waits: the overall waits differ, the job counts do not.
    (three_all,) = re.findall(r"<tr><td>three</td><td>\(all\)</td>(.*?)</tr>", page)
    cells = re.findall(r'<td class="num( differs)?">([^<]*)</td>', three_all)
    assert cells[0] == ("", "28")  # jobs: the same in both
    assert any(flag for flag, _ in cells[4:7]), cells  # a wait column differs
    assert len(runs["three"].timeline) >= 50 and max(n for _, _, n in runs["three"].timeline) > 0
