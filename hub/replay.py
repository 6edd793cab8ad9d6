"""`gpupool replay`: a workload replayed on a virtual clock through the platform's own admission, queue and placement.

The simulator owns only the clock, the event heap and the trace readers. Every decision is the platform's:
`admission.decide` (quotas wait, budgets follow `on_exhausted`, priorities), the embedded pool's queue pass
(`spawner.pool.admit_in_order`: priority then arrival, a waiting request is not overtaken by smaller ones of
its model) and its placement (`spawner.pool.place` under the policy's `settings.placement`, see
`policies.placement`), run per node when the cluster has nodes. `gpupool replay openb` measures placement
quality on Alibaba's openb trace as the FGD paper does. Nothing sleeps and nothing is started: a month of work
replays in seconds.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from fractions import Fraction
from pathlib import Path

from gpupool.hub.accounting.export import USAGE_HEADER, usage_rows
from gpupool.policies import admission, periods
from gpupool.policies import PolicyError, load_policy
from gpupool.policies.admission import (
    DIRECT_PROFILE, LOWEST_PRIORITY, AdmissionRequest, Holdings, Reason, Usage,
)
from gpupool.policies.model import PLACEMENTS, Policy
from gpupool.policies.periods import period_of
from gpupool.policies.placement import (
    ONE, FreeState, Placement, choose_cards, demands_of, node_score, placement_for,
)
from gpupool.policies.preemption import Holder, victims
from gpupool.spawner.pool import (
    BEST_FIT, Allocation, Card, Request, Verdict, admit_in_order, place,
)

SECONDS_PER_DAY = 86400.0


def _exact(value: Fraction | int | None) -> tuple[int, int] | None:
    """A share as a dictionary key: (numerator, denominator), cheaper to hash than the Fraction, and equal alike."""
    return None if value is None else (value.numerator, value.denominator)


def _less(held: Fraction, share: Fraction) -> Fraction:
    """held - share, whole numbers subtracted as integers (the same Fraction, without its general arithmetic)."""
    if held.denominator == 1 == share.denominator:
        return Fraction(held.numerator - share.numerator)
    return held - share


def _plus(held: Fraction | None, share: Fraction) -> Fraction:
    """held + share (nothing held: None), whole numbers added as integers."""
    if held is None:
        return Fraction(0) + share
    if held.denominator == 1 == share.denominator:
        return Fraction(held.numerator + share.numerator)
    return held + share


# --- the workload ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One request of the workload: who, what share of which model, when it arrives and how long it runs."""

    key: str
    user: str
    team: str
    model: str
    share: Fraction
    arrival: float  # seconds after the workload's start
    duration: float  # seconds it runs once placed
    profile: str | None = None  # a policy profile; None asks for the model and share directly (jobs)
    kind: str = "job"  # `job` or `server`: which requests may preempt (`jobs.preemption.by`); servers never are
    preemptible: bool = False  # a job others of higher priority may stop (it resumes later where it stopped)


@dataclass(frozen=True)
class Workload:
    jobs: list[Job]
    start: datetime  # the wall-clock time of arrival 0 (selects budget periods)
    source: str = ""
    skipped: int = 0  # rows that could not become jobs (said in the results)


def read_philly(path: str | Path, model: str = "P100", limit: int | None = None) -> Workload:
    """Microsoft Philly (`philly.csv`: timestamp, duration, num_gpus, gpu_time, cluster = virtual cluster).

    Each virtual cluster is a team; the trace names no users, so the team is also the user.
    """
    rows = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        try:
            when, long, gpus, vc = (header.index(column) for column in ("timestamp", "duration", "num_gpus", "cluster"))
        except ValueError:
            raise ValueError(f"{path}: not a Philly trace (its header is {','.join(header)!r}; accepted: "
                             f"{','.join(PHILLY_HEADER)})") from None
        for row in reader:
            if not row:
                continue  # a blank line, as csv.DictReader skips it
            rows.append((datetime.fromisoformat(row[when]).replace(tzinfo=timezone.utc), float(row[long]),
                         int(row[gpus]), row[vc]))
    rows.sort(key=lambda r: r[0])
    if limit is not None:
        rows = rows[:limit]
    start = rows[0][0] if rows else datetime(1970, 1, 1, tzinfo=timezone.utc)
    jobs, skipped, shares = [], 0, {}
    for n, (at, duration, gpus, vc) in enumerate(rows):
        if gpus <= 0:
            skipped += 1
            continue
        share = shares.get(gpus) or shares.setdefault(gpus, Fraction(gpus))  # one Fraction per size: they are values
        jobs.append(Job(f"philly-{n}", vc, vc, model, share, (at - start).total_seconds(), duration))
    return Workload(jobs, start, f"philly {path}", skipped)


def read_philly_vcs(path: str | Path) -> dict[str, int]:
    """`philly_vc.csv`: each virtual cluster's nodes (8 GPUs each)."""
    with open(path, newline="") as f:
        return {row["vc"]: int(row["node num"]) for row in csv.DictReader(f)}


def philly_policy(vcs: dict[str, int], *, dedicated: bool, model: str = "P100", node_cards: int = 8) -> Policy:
    """The Philly cluster as a policy: one team per virtual cluster, the total as the inventory.

    `dedicated`: each team may hold only its former cluster's GPUs (quota = nodes × 8, no borrowing).
    Pooled: no quota; what a team deserves (its former size) is its Volcano queue's `deserved`, and idle
    cards are borrowed by whoever waits.
    """
    teams = {}
    for vc, nodes in vcs.items():
        size = nodes * node_cards
        team: dict = {"queue": {"deserved": {"nvidia.com/gpu": str(size)}}}
        if dedicated:
            team["quota"] = {"gpus": size}
        teams[vc] = team
    return Policy.model_validate({
        "models": {model: {"vendor": "nvidia", "memory_gib": 16, "backends": ["whole"]}},
        # One entry per former cluster (an entry holds at most 1024 cards); pooled, they are one pool.
        "inventory": [{"model": model, "count": nodes * node_cards} for nodes in vcs.values()],
        "teams": teams,
    })


# --- the cluster: cards on nodes --------------------------------------------------------------------


def pool_cards(policy: Policy, capacity: dict[str, int] | None = None) -> list[Card]:
    """The policy's inventory as cards, or `capacity` cards of each model named there (`--capacity H200=16`)."""
    counts: dict[str, int] = {}
    for declared in policy.inventory:
        counts[declared.model] = counts.get(declared.model, 0) + declared.count
    for model, count in (capacity or {}).items():
        if model not in policy.models:
            raise ValueError(f"--capacity names model {model!r}, which the policies do not define "
                             f"(known: {', '.join(policy.models) or 'none'})")
        counts[model] = count
    cards = []
    for model, count in counts.items():
        memory = policy.models[model].memory_gib
        cards.extend(Card(f"GPU-replay-{model}-{i}", model, len(cards), memory) for i in range(count))
    return cards


class Cluster:
    """Cards grouped into nodes, and what each card holds; `reserve` is the pool's placement, per node.

    A share up to a node's size goes on one node: the node `policies.placement.node_score` prefers under the
    placement policy (ties: the first node), and the pool's own `place` picks the cards on it. Under best fit
    that is the fullest card with room among all cards of the model for a fraction (the pool's best fit), and
    the fullest node that still has enough free cards for whole ones (as Volcano's binpack plugin scores);
    with one node this is exactly the embedded pool. A job larger than a node is gang-placed, all or nothing
    as Volcano's gang plugin admits it: on the nodes with the most free cards, so that it spans as few as
    possible. `nodes` gives the nodes explicitly (a node list such as openb's); else each model's cards are
    cut into nodes of `node_cards` (default: one node).

    A node's score depends only on its state (the free shares of its cards), so scores are kept per state and
    share, and for each share asked a heap of (score, node) finds the best node without a pass over all of
    them. `scale`: count free shares in integer units of 1/scale card (every share must be one), which makes
    the scores' arithmetic integer; the choices are the same.
    """

    def __init__(self, cards: list[Card], node_cards: int | None = None, *,
                 nodes: list[list[Card]] | None = None,
                 placement: Callable[[str], Placement] = lambda model: BEST_FIT, scale: int | None = None):
        self.cards = cards
        self.by_model: dict[str, list[Card]] = {}
        for card in cards:
            self.by_model.setdefault(card.model, []).append(card)
        self.nodes: dict[str, list[list[Card]]] = {}
        if nodes is not None:
            for node in nodes:
                self.nodes.setdefault(node[0].model, []).append(node)
        else:
            for model, model_cards in self.by_model.items():
                size = node_cards or len(model_cards)
                self.nodes[model] = [model_cards[i:i + size] for i in range(0, len(model_cards), size)]
        self.node_of = {c.uuid: (c.model, n) for m, nodes in self.nodes.items() for n, node in enumerate(nodes)
                        for c in node}
        self.free_cards = {m: [len(node) for node in nodes] for m, nodes in self.nodes.items()}
        self.sizes = {m: max(len(node) for node in nodes) for m, nodes in self.nodes.items()}
        # One placement per model for the cluster's life (a replay's policies do not change under it).
        self.placements = {m: placement(m) for m in self.nodes}
        self.scale = scale
        self.unit = scale if scale is not None else ONE
        self.scoring = {m: p.scaled(scale) if scale is not None else p for m, p in self.placements.items()}
        self.card_free = {c.uuid: self.unit for c in cards}  # in units
        self.free: dict[str, list[Counter]] = {m: [Counter({self.unit: len(node)}) for node in nodes]
                                               for m, nodes in self.nodes.items()}
        self.state: dict[str, list[FreeState]] = {m: [((self.unit, len(node)),) for node in nodes]
                                                  for m, nodes in self.nodes.items()}
        self.version: dict[str, list[int]] = {m: [0] * len(nodes) for m, nodes in self.nodes.items()}
        self.scores: dict[tuple, tuple | None] = {}
        self.heaps: dict[tuple, list[tuple]] = {}  # (model, share) → (score, node, version of the node)
        # The nodes changed, in order, per model; each heap has taken in those before its mark (`_fresh`).
        self.changed: dict[str, list[int]] = {m: [] for m in self.nodes}
        self.marks: dict[tuple, int] = {}
        self.held: dict[str, Allocation] = {}
        self._per_card: dict[tuple, int | Fraction] = {}  # share → what it takes of each card it goes on, in units
        self._asked: dict[tuple, int | Fraction | None] = {}  # (model, share) → its units, None when above a node

    @property
    def used(self) -> dict[str, Fraction]:
        """What each card holds (cards holding nothing left out), in cards: the pool's store's `used`."""
        return self._used_of(self.cards)

    def _used_of(self, cards: Iterable[Card]) -> dict[str, Fraction]:
        unit, free = self.unit, self.card_free
        if self.scale is None:
            return {c.uuid: unit - free[c.uuid] for c in cards if free[c.uuid] != unit}
        return {c.uuid: Fraction(unit - free[c.uuid], unit) for c in cards if free[c.uuid] != unit}

    def capacity(self, model: str) -> int:
        return len(self.by_model.get(model, ()))

    def node_size(self, model: str) -> int:
        return self.sizes.get(model, 0)

    def _units(self, share: Fraction):
        if self.scale is None:
            return share
        scaled = share * self.scale
        if scaled.denominator != 1:
            raise ValueError(f"share {share} is not a whole number of 1/{self.scale} card")
        return scaled.numerator

    def _score(self, model: str, state: FreeState, share) -> tuple | None:
        asked = (model, state, share)
        if asked not in self.scores:
            self.scores[asked] = node_score(state, share, self.scoring[model])
        return self.scores[asked]

    def _heap(self, model: str, share) -> list[tuple]:
        heap = [(score, n, self.version[model][n]) for n, state in enumerate(self.state[model])
                if (score := self._score(model, state, share)) is not None]
        heapq.heapify(heap)
        self.heaps[model, share] = heap
        self.marks[model, share] = len(self.changed[model])
        return heap

    def _fresh(self, model: str, share) -> list[tuple]:
        """The heap of (score, node, version) for `share`, with an entry for the current state of every node that
        changed since it was last asked (older entries of those nodes are stale: their version has passed)."""
        heap = self.heaps.get((model, share))
        if heap is None:
            return self._heap(model, share)
        changed, mark = self.changed[model], self.marks[model, share]
        if mark == len(changed):
            return heap
        nodes = set(changed[mark:])
        if len(heap) + len(nodes) > 4 * len(self.nodes[model]) + 64:  # mostly stale entries: build it anew
            return self._heap(model, share)
        states, versions = self.state[model], self.version[model]
        for n in nodes:
            if (score := self._score(model, states[n], share)) is not None:
                heapq.heappush(heap, (score, n, versions[n]))
        self.marks[model, share] = len(changed)
        return heap

    def _card_changed(self, uuid: str, taken) -> tuple[str, int]:
        """`taken` units more of card `uuid` are held (fewer, when negative); its node, to rescore."""
        model, n = self.node_of[uuid]
        free = self.free[model][n]
        was = self.card_free[uuid]
        now = self.card_free[uuid] = was - taken
        free[was] -= 1
        if not free[was]:
            del free[was]
        free[now] += 1
        if was == self.unit or now == self.unit:
            self.free_cards[model][n] += 1 if now == self.unit else -1
        return model, n

    def _node_changed(self, model: str, n: int) -> None:
        self.state[model][n] = tuple(sorted(self.free[model][n].items()))
        self.version[model][n] += 1
        changed = self.changed[model]
        changed.append(n)
        if len(changed) > 8 * len(self.nodes[model]) + 1024:
            # Keep the log short: heaps that took in all of it start again at its new start; the others are
            # dropped, to be built anew when next asked.
            for asked in [asked for asked in self.heaps if asked[0] == model]:
                if self.marks[asked] == len(changed):
                    self.marks[asked] = 0
                else:
                    del self.heaps[asked], self.marks[asked]
            changed.clear()

    def _taken(self, share: Fraction):
        """The units `share` takes of each card it goes on (all of a card for a whole card or more)."""
        exact = (share.numerator, share.denominator)
        taken = self._per_card.get(exact)
        if taken is None:
            taken = self._per_card[exact] = self._units(share if share < 1 else Fraction(1))
        return taken

    def reserve(self, request: Request) -> Allocation | None:
        chosen = self._choose(request.model, request.share)
        if chosen is None:
            return None
        touched, taken = set(), self._taken(request.share)
        for uuid in chosen:
            touched.add(self._card_changed(uuid, taken))
        for node in touched:
            self._node_changed(*node)
        allocation = Allocation(request.key, request.user, request.team, request.profile, request.model,
                                request.share, chosen)
        self.held[request.key] = allocation
        return allocation

    def release(self, key: str) -> Allocation:
        allocation = self.held.pop(key)
        touched, taken = set(), self._taken(allocation.share)
        for uuid in allocation.cards:
            touched.add(self._card_changed(uuid, -taken))
        for node in touched:
            self._node_changed(*node)
        return allocation

    def _choose(self, model: str, share: Fraction) -> tuple[str, ...] | None:
        nodes = self.nodes.get(model)
        if not nodes:
            return None
        asked = (model, share.numerator, share.denominator)
        if asked in self._asked:
            units = self._asked[asked]
        else:
            if share >= 1 and share.denominator != 1:
                raise ValueError(f"a share above one card must be whole cards, not {share}")
            units = self._asked[asked] = self._units(share) if share <= self.node_size(model) else None
        if units is not None:
            heap = self._fresh(model, units)
            versions = self.version[model]
            while heap and heap[0][2] != versions[heap[0][1]]:
                heapq.heappop(heap)
            if not heap:
                return None
            # On that node, the cards as the pool's `place` chooses them (`choose_cards`), in the cluster's units.
            node = nodes[heap[0][1]]
            chosen = choose_cards([self.card_free[c.uuid] for c in node], units, self.scoring[model])
            return tuple(node[i].uuid for i in chosen)
        need, free = int(share), self.free_cards[model]
        if sum(free) < need:
            return None
        chosen: list[str] = []
        for n in sorted(range(len(nodes)), key=free.__getitem__, reverse=True):  # most free first; ties: first node
            take = min(free[n], need - len(chosen))
            if take:
                chosen.extend(place(nodes[n], self._used_of(nodes[n]), model, Fraction(take), self.placements[model])
                              or ())
            if len(chosen) == need:
                break
        return tuple(chosen)


# --- admission on the virtual clock -----------------------------------------------------------------


class Meter:
    """GPU-hours each team has used in the current budget period, kept up to the virtual clock."""

    def __init__(self, start: datetime):
        self.start = start
        self.period = period_of(start)
        self.period_start = 0.0
        self.closed: dict[str, float] = {}
        self.rate: dict[str, float] = {}  # shares running now
        self.anchor: dict[str, float] = {}  # sum of share × max(start, period start)
        self.until = self._until()

    def _until(self) -> float:
        # Up to a millisecond before the period's end, the clock is surely in it (the virtual clock only advances).
        return (periods.period_bounds(self.period)[1] - self.start).total_seconds() - 1e-3

    def roll(self, now: float) -> None:
        if self.period_start <= now < self.until:
            return
        period = period_of(self.start + timedelta(seconds=now))
        if period != self.period:
            begin = datetime.strptime(period, "%Y-%m").replace(tzinfo=timezone.utc)
            self.period, self.period_start = period, (begin - self.start).total_seconds()
            self.until = self._until()
            self.closed = {}
            self.anchor = {team: rate * self.period_start for team, rate in self.rate.items()}

    def started(self, team: str, share: float, now: float) -> None:
        self.rate[team] = self.rate.get(team, 0.0) + share
        self.anchor[team] = self.anchor.get(team, 0.0) + share * max(now, self.period_start)

    def ended(self, team: str, share: float, started: float, now: float) -> None:
        begun = max(started, self.period_start)
        self.rate[team] -= share
        self.anchor[team] -= share * begun
        self.closed[team] = self.closed.get(team, 0.0) + share * (now - begun) / 3600

    def usage(self, now: float) -> Usage:
        teams = set(self.closed) | set(self.rate)
        used = {t: Fraction(self.closed.get(t, 0.0) + (self.rate.get(t, 0.0) * now - self.anchor.get(t, 0.0)) / 3600)
                for t in teams}
        return Usage(self.period, used, {})


class Admission:
    """The pool's `Decide` on the virtual clock: `admission.decide` with the replay's own usage meter.

    A long queue asks the same question many times between two changes of holdings; the answer is kept until
    holdings or the clock change (the decision is a pure function of them). And as `Ledger.admit` decides
    against the team's own holdings (read under the team's lock), a request for a model and share is decided
    by the holdings of its team only (the team's, its share of the model, the member's): that answer is kept
    for as long as the usage stays the same (while the clock changes, when the teams have budgets; else until
    the period changes), and asked again of the same team in the same state it is not decided anew. `memo`:
    False decides every question (`tests/unit/hub/test_replay.py` checks that the results are the same).
    """

    def __init__(self, policy: Policy, meter: Meter, *, memo: bool = True):
        self.policy, self.meter, self.memo = policy, meter, memo
        self.budgets = any(t.budget.gpu_hours is not None or t.budget.per_model for t in policy.teams.values())
        self.now = 0.0
        self._at = meter.start
        self._usage: Usage | None = None
        self._cache: dict[tuple, Verdict] = {}
        self._holdings: Holdings | None = None
        self._known: dict[tuple, Verdict] = {}  # by the question and its team's holdings (`memo`)
        self.last: dict[str, Verdict] = {}  # the verdict each request was last given

    def at(self, now: float) -> None:
        if now != self.now or self._usage is None:
            self.now = now
            self._at = self.meter.start + timedelta(seconds=now)
            period = self.meter.period
            self.meter.roll(now)
            self._usage = self.meter.usage(now) if self.budgets else Usage(self.meter.period)
            self._cache = {}
            if self.budgets or self.meter.period != period:
                self._known = {}

    def __call__(self, request: Request, holdings: Holdings) -> Verdict:
        if holdings is not self._holdings:
            self._holdings, self._cache = holdings, {}
        asked = (request.team, request.user, request.profile, request.model, _exact(request.share))
        verdict = self._cache.get(asked)
        if verdict is not None:
            self.last[request.key] = verdict
            return verdict
        direct = request.profile == DIRECT_PROFILE
        if direct and self.memo:
            team = request.team
            known = asked + (_exact(holdings.team.get(team)), _exact(holdings.team_model.get((team, request.model))),
                             _exact(holdings.team_user.get((team, request.user))))
            verdict = self._known.get(known)
        if verdict is None:
            question = AdmissionRequest(
                user=request.user, team=request.team, at=self._at,
                profile=None if direct else request.profile,
                model=request.model if direct else None, share=request.share if direct else None,
            )
            decision = admission.decide(self.policy, question, holdings, self._usage)
            # As the embedded spawner's `admission()` turns a Decision into the pool's Verdict.
            verdict = Verdict(decision.action, "" if decision.admitted else decision.reason, decision.priority,
                              code=decision.code)
            if direct and self.memo:
                self._known[known] = verdict
        self._cache[asked] = verdict
        self.last[request.key] = verdict
        return verdict


def holding_plus(holdings: Holdings, allocation: Allocation) -> Holdings:
    """`holdings` and `allocation`: what the pool's `holding_more` gives (and `Holdings.of` for both), with whole
    numbers added as integers."""
    a = allocation
    team, team_model, team_user = dict(holdings.team), dict(holdings.team_model), dict(holdings.team_user)
    for counts, key in ((team, a.team), (team_model, (a.team, a.model)), (team_user, (a.team, a.user))):
        counts[key] = _plus(counts.get(key), a.share)
    return Holdings(team, team_model, team_user)


def holding_less(holdings: Holdings, allocation: Allocation) -> Holdings:
    """`holdings` without `allocation` (the inverse of the pool's `holding_more`)."""
    a = allocation
    team, team_model, team_user = dict(holdings.team), dict(holdings.team_model), dict(holdings.team_user)
    for counts, key in ((team, a.team), (team_model, (a.team, a.model)), (team_user, (a.team, a.user))):
        left = _less(counts[key], a.share)
        if left:
            counts[key] = left
        else:
            del counts[key]
    return Holdings(team, team_model, team_user)


# --- the replay --------------------------------------------------------------------------------------


@dataclass
class JobResult:
    job: Job
    started: float | None = None  # its first start
    ended: float | None = None
    cards: tuple[str, ...] = ()
    denied: str = ""
    deprioritized: bool = False
    #: Times it was preempted, and each stretch it ran (start, end): one without preemption.
    preempted: int = 0
    pieces: list[tuple[float, float]] = field(default_factory=list)

    @property
    def wait(self) -> float | None:
        return None if self.started is None else self.started - self.job.arrival

    def ran(self, until: float) -> list[tuple[float, float]]:
        """Its stretches of running, the one still running ending at `until`."""
        return self.pieces + ([(self._running_since, until)] if self._running_since is not None else [])

    _running_since: float | None = None


@dataclass
class Replay:
    """What happened to every job, in the order the pool placed them, and the cluster's shape."""

    results: dict[str, JobResult]
    placed_order: list[str]
    capacity: dict[str, int]
    start: datetime
    end: float  # the virtual time of the last event
    events: int
    unknown_team: int = 0
    timeline: list[tuple[float, float, int]] = field(default_factory=list)  # (t, GPUs held, queue length)
    aborted: bool = False  # stopped early: a team's p95 wait was sure to exceed `give_up_over`
    #: The GPU-hour budget per period (UTC month) of each team that has one, all models (`teams.T.budget`).
    budgets: dict[str, float] = field(default_factory=dict)


def preempt(policy: Policy, cluster: Cluster, outcomes: list, pending: dict[str, tuple[Request, int]],
            running: dict[str, bool], results: dict[str, JobResult], decide: Admission,
            done_for: set[str]) -> list[str]:
    """The jobs to stop for the first request of the queue that waits for room and may preempt
    (`accounting.preemption.victims`, as the embedded job runner asks it: one request at a time); [] for none.
    A stopped job loses nothing: it resumes where it stopped (a periodic checkpoint makes that nearly true).
    `running`: the preemptible jobs running (servers never are), and whether each runs deprioritized. A request
    preempts at its priority as admitted (an over-budget one at the lowest: it preempts nothing), and at most once
    an instant (`done_for`): what it stopped is not stopped again for it at once."""
    rules = policy.jobs.preemption
    if not rules.enabled or not running:
        return []
    # Per model, the head of the queue among those that wait for room: the queue lets no later request of that
    # model overtake it, so it is the one room would be made for.
    heads: dict[str, Request] = {}
    for outcome in outcomes:
        if outcome.action == "wait" and outcome.code is Reason.NO_CAPACITY and outcome.key in pending:
            request = pending[outcome.key][0]
            heads.setdefault(request.model, request)
    def admitted_priority(request: Request) -> int:
        verdict = decide.last.get(request.key)
        return LOWEST_PRIORITY if verdict is not None and verdict.priority == LOWEST_PRIORITY else request.priority

    for request in sorted(heads.values(), key=lambda r: (-admitted_priority(r), pending[r.key][1])):
        if request.key in done_for:
            continue
        kind = results[request.key].job.kind
        holders = []
        for key, deprioritized in running.items():
            held, job = cluster.held[key], results[key].job
            if held.model == request.model:
                holders.append(Holder(key, held.model, held.cards, min(held.share, Fraction(1)),
                                      policy.teams[job.team].priority, True, deprioritized,
                                      results[key]._running_since or 0.0))
        if not holders:
            continue
        nodes = cluster.nodes.get(request.model, [])
        cards = [c.uuid for node in nodes for c in node]
        placement = placement_for(policy, request.model)
        sizes = [len(node) for node in nodes]

        def fits(free: list[Fraction], share: Fraction, sizes=sizes, placement=placement):
            # The cluster's own rule: a share up to a node's size on one node, a larger one gang-placed.
            offset = 0
            if share <= max(sizes, default=0):
                for size in sizes:
                    chosen = choose_cards(free[offset:offset + size], share, placement)
                    if chosen is not None:
                        return [offset + i for i in chosen]
                    offset += size
                return None
            whole = [i for i, f in enumerate(free) if f >= 1]
            return whole[:int(share)] if len(whole) >= share else None

        chosen = victims(rules, kind, admitted_priority(request), request.model, request.share, cards,
                         dict(cluster.used), holders, fits)
        if chosen:
            done_for.add(request.key)
            return chosen
    return []


def replay(workload: Workload | Iterable[Job], policy: Policy, *, cards: list[Card] | None = None,
           node_cards: int | None = None, timeline_points: int = 0, give_up_over: float | None = None,
           memo: bool = True) -> Replay:
    """Replay `workload` through the platform's admission, queue and placement on a virtual clock.

    `give_up_over`: stop (`aborted`) as soon as some team's p95 queue wait must exceed this many seconds:
    more of its jobs have started later than that than 5% allow. Capacity searches use it, because an
    undersized pool's queue grows without end and each event then costs a pass over all of it. `memo`: see
    `Admission` (False decides every question afresh: the same results, slower).
    """
    if isinstance(workload, Workload):
        jobs, start = workload.jobs, workload.start
    else:
        jobs, start = list(workload), datetime(2026, 1, 1, tzinfo=timezone.utc)
    # Free shares counted in integer units fine enough for every share of the workload and the profiles.
    scale = math.lcm(1, *{job.share.denominator for job in jobs},
                     *{size.denominator for m in policy.models for size, _ in placement_for(policy, m).demands})
    cluster = Cluster(cards if cards is not None else pool_cards(policy), node_cards,
                      placement=lambda model: placement_for(policy, model), scale=scale)
    meter = Meter(start)
    decide = Admission(policy, meter, memo=memo)
    results = {job.key: JobResult(job) for job in jobs}
    requests: dict[str, tuple[Request, int]] = {}
    heap: list[tuple[float, int, int, str]] = []  # (time, 0 = release before 1 = arrival, seq, key)
    unknown = 0
    late: dict[str, int] = {}
    allowed: dict[str, int] = {}
    for job in jobs:
        allowed[job.team] = allowed.get(job.team, 0) + 1
    # Nearest-rank p95 of n waits is the ceil(0.95 n)-th smallest: the rest may be longer.
    allowed = {team: n - math.ceil(0.95 * n) for team, n in allowed.items()}
    aborted = False
    for seq, job in enumerate(jobs):
        if job.team not in policy.teams:
            results[job.key].denied = f"unknown team {job.team!r}"
            unknown += 1
            continue
        heap.append((job.arrival, 1, seq, job.key))
    heapq.heapify(heap)
    pending: dict[str, tuple[Request, int]] = {}
    requests_of: dict[str, Request] = {}
    seq_of: dict[str, int] = {}
    ends: dict[str, float] = {}  # when each running job's current stretch ends (later heap entries are stale)
    remaining: dict[str, float] = {}  # seconds a preempted job still has to run
    running: dict[str, bool] = {}  # running preemptible jobs, and whether each runs deprioritized (over budget)
    holdings = Holdings()  # what `Holdings.of` gives for the cluster's allocations, kept as they change
    placed_order: list[str] = []
    events, now = 0, 0.0
    step = None
    timeline: list[tuple[float, float, int]] = []
    held_gpus = 0.0
    if timeline_points and jobs:
        span = max(j.arrival for j in jobs) - min(j.arrival for j in jobs) or 1.0
        step, next_sample = span / timeline_points, 0.0
    while heap:
        now, kind, seq, key = heapq.heappop(heap)
        events += 1
        result = results[key]
        job = result.job
        if step is not None:
            while next_sample <= now:
                timeline.append((next_sample, held_gpus, len(pending)))
                next_sample += step
        if kind == 0:
            if ends.get(key) != now:
                continue  # the end of a stretch that a preemption cut short
            del ends[key]
            running.pop(key, None)
            holdings = holding_less(holdings, cluster.release(key))
            result.ended = now
            result.pieces.append((result._running_since, now))
            result._running_since = None
            gpus = float(job.share)
            held_gpus -= gpus
            meter.ended(job.team, gpus, result.pieces[-1][0], now)
        else:
            if job.share > cluster.capacity(job.model):  # as the pool refuses at once: it could never fit
                result.denied = (f"{job.share} × {job.model} can never fit: the pool has "
                                 f"{cluster.capacity(job.model)} {job.model} card(s)")
                continue
            profile = job.profile or DIRECT_PROFILE
            request = Request(key, job.user, job.team, profile, f"{job.share} × {job.model}", job.model,
                              job.share, policy.teams[job.team].priority)
            pending[key] = (request, seq)
            requests_of[key], seq_of[key] = request, seq
        if not pending:
            continue
        decide.at(now)
        preempted_for: set[str] = set()  # requests that preempted at this instant
        while True:
            outcomes, _ = admit_in_order(list(pending.values()), holdings, decide, cluster.reserve, cluster.capacity)
            for outcome in outcomes:
                if outcome.action == "wait":
                    continue
                done = results[outcome.key]
                arrived = pending.pop(outcome.key)[1]
                if outcome.action == "deny":
                    done.denied = outcome.reason
                    continue
                placed = done.job
                if done.started is None:
                    done.started, done.cards = now, outcome.allocation.cards
                    if give_up_over is not None and now - placed.arrival > give_up_over:
                        late[placed.team] = late.get(placed.team, 0) + 1
                        aborted = aborted or late[placed.team] > allowed[placed.team]
                    done.deprioritized = decide.last[outcome.key].priority == LOWEST_PRIORITY
                    placed_order.append(outcome.key)
                holdings = holding_plus(holdings, outcome.allocation)
                gpus = float(placed.share)
                held_gpus += gpus
                meter.started(placed.team, gpus, now)
                done._running_since = now
                ends[outcome.key] = now + remaining.pop(outcome.key, placed.duration)
                if placed.preemptible and placed.kind == "job":
                    running[outcome.key] = decide.last[outcome.key].priority == LOWEST_PRIORITY
                heapq.heappush(heap, (ends[outcome.key], 0, arrived, outcome.key))
            stopped = preempt(policy, cluster, outcomes, pending, running, results, decide, preempted_for)
            if not stopped:
                break
            # The preempted jobs go back to the queue, keeping their place, with the time they still had to run.
            for victim in stopped:
                gone = cluster.release(victim)
                holdings = holding_less(holdings, gone)
                done = results[victim]
                done.pieces.append((done._running_since, now))
                done._running_since = None
                done.preempted += 1
                remaining[victim] = ends.pop(victim) - now
                del running[victim]
                held_gpus -= float(done.job.share)
                meter.ended(done.job.team, float(done.job.share), done.pieces[-1][0], now)
                pending[victim] = (requests_of[victim], seq_of[victim])
        if aborted:
            break
    budgets = {name: float(team.budget.gpu_hours) for name, team in policy.teams.items()
               if team.budget.gpu_hours is not None}
    return Replay(results, placed_order, {m: cluster.capacity(m) for m in cluster.by_model}, start, now, events,
                  unknown, timeline, aborted, budgets)


# --- results ------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def over_budget(run: Replay, team: str, results: list[JobResult]) -> float:
    """GPU-hours `team` ran past its budget, summed over the periods (UTC months) the replay spans: what an
    `on_exhausted: alert` team overspends (a `deny` team's are refused, a `deprioritize` team's run late)."""
    budget = run.budgets.get(team)
    if budget is None:
        return 0.0
    used: dict[str, float] = {}
    for r in results:
        for start, end in r.ran(run.end):
            for piece in periods.split_by_month(run.start + timedelta(seconds=start), run.start + timedelta(seconds=end)):
                used[piece.period] = used.get(piece.period, 0.0) + float(r.job.share) * piece.duration.total_seconds() / 3600
    return sum(max(0.0, hours - budget) for hours in used.values())


def summary(run: Replay) -> dict:
    """Per team and overall: GPU-hours, utilisation, queue wait p50/p95/max, jobs per day, denied, deprioritized,
    GPU-hours over budget."""
    capacity = sum(run.capacity.values())
    arrivals = [r.job.arrival for r in run.results.values()]
    begin = min(arrivals, default=0.0)
    span = max(run.end - begin, 1.0)

    def block(results: list[JobResult]) -> dict:
        waits = [r.wait for r in results if r.wait is not None]
        finished = [r for r in results if r.ended is not None]
        hours = sum(float(r.job.share) * (end - start) for r in finished for start, end in r.pieces) / 3600
        return {
            "jobs": len(results),
            "completed": len(finished),
            "gpu_hours": round(hours, 2),
            "utilisation": round(hours / (capacity * span / 3600), 4) if capacity else 0.0,
            "wait_p50_s": round(percentile(waits, 50), 1),
            "wait_p95_s": round(percentile(waits, 95), 1),
            "wait_max_s": round(max(waits, default=0.0), 1),
            "completed_per_day": round(len(finished) / (span / SECONDS_PER_DAY), 2),
            "denied": sum(1 for r in results if r.denied),
            "deprioritized": sum(1 for r in results if r.deprioritized),
            "preempted": sum(r.preempted for r in results),
        }

    teams: dict[str, list[JobResult]] = {}
    for r in run.results.values():
        teams.setdefault(r.job.team, []).append(r)
    by_team = {team: {**block(rs), "over_budget_gpu_hours": round(over_budget(run, team, rs), 2)}
               for team, rs in sorted(teams.items())}
    overall = {**block(list(run.results.values())),
               "over_budget_gpu_hours": round(sum(b["over_budget_gpu_hours"] for b in by_team.values()), 2)}
    return {
        "capacity": dict(run.capacity),
        "days": round(span / SECONDS_PER_DAY, 2),
        "events": run.events,
        "not_in_policies": run.unknown_team,
        "overall": overall,
        "teams": by_team,
    }


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


#: Samples of the timeline an HTML report draws.
TIMELINE_POINTS = 400
COLUMNS = [("jobs", "jobs"), ("completed", "done"), ("gpu_hours", "GPU-h"), ("utilisation", "util"),
           ("wait_p50_s", "wait p50"), ("wait_p95_s", "wait p95"), ("wait_max_s", "wait max"),
           ("completed_per_day", "done/day"), ("denied", "denied"), ("deprioritized", "deprio"), ("preempted", "preempted"),
           ("over_budget_gpu_hours", "over budget GPU-h")]


def _cell(key: str, value) -> str:
    if key == "utilisation":
        return f"{value * 100:.1f}%"
    if key.startswith("wait"):
        return _duration(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def table(summaries: dict[str, dict]) -> str:
    """One table; with several policy sets, one row per team and set, the set named in the first column."""
    rows = [["policies", "team"] + [title for _, title in COLUMNS]]
    for name, s in summaries.items():
        for team, block in [("(all)", s["overall"])] + list(s["teams"].items()):
            rows.append([name, team] + [_cell(k, block[k]) for k, _ in COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    heads = [f"{name}: {', '.join(f'{n} {m}' for m, n in s['capacity'].items())}, {s['days']} days, "
             f"{s['events']} events"
             + (f", {s['not_in_policies']} jobs of teams the policies do not name (counted as denied)"
                if s["not_in_policies"] else "")
             for name, s in summaries.items()]
    return "\n".join(heads + [""] + lines)


def html_table(summaries: dict[str, dict]) -> str:
    """The results table as HTML, the cells where policy sets differ marked `differs`."""
    from html import escape

    def shown(s: dict, team: str, key: str) -> str | None:
        block = s["overall"] if team == "(all)" else s["teams"].get(team)
        return None if block is None else _cell(key, block[key])

    def cell(team: str, key: str, value) -> str:
        differs = len({shown(s, team, key) for s in summaries.values()}) > 1
        return f'<td class="num{" differs" if differs else ""}">{escape(_cell(key, value))}</td>'

    rows = []
    for name, s in summaries.items():
        for team, block in [("(all)", s["overall"])] + list(s["teams"].items()):
            rows.append(f"<tr><td>{escape(name)}</td><td>{escape(team)}</td>"
                        + "".join(cell(team, k, block[k]) for k, _ in COLUMNS) + "</tr>")
    return ('<table class="table table-sm gpupool" id="replay"><thead><tr><th>policies</th><th>team</th>'
            + "".join(f'<th class="num">{escape(title)}</th>' for _, title in COLUMNS) + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def timeline_charts(runs: dict[str, Replay]) -> list[str]:
    """Each policy set's timeline chart (SVG): utilisation and requests waiting over time."""
    from gpupool.hub.accounting.charts import timeline_chart

    return [timeline_chart(f"{name}: utilisation and queue over time", run.timeline, sum(run.capacity.values()))
            for name, run in runs.items()]


def html_report(summaries: dict[str, dict], runs: dict[str, Replay], workload: str) -> str:
    """A page: the table, cells where policy sets differ highlighted, and each set's timeline chart (SVG)."""
    from html import escape

    charts = "".join(f"<figure>{chart}</figure>" for chart in timeline_charts(runs))
    heads = "".join(f"<li>{escape(line)}</li>" for line in table(summaries).split("\n\n")[0].splitlines())
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>gpupool replay</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse}"
            "td,th{padding:.2em .6em;border-bottom:1px solid #dee2e6}td.num{text-align:right}"
            "td.differs{background:#fff3cd;font-weight:bold}figure{margin:1em 0}</style></head><body>"
            f"<h1>gpupool replay</h1><p>{escape(workload)}</p><ul>{heads}</ul>" + html_table(summaries)
            + ("<p>Highlighted: where the policy sets differ.</p>" if len(summaries) > 1 else "")
            + charts + "</body></html>\n")


# --- capacity planning --------------------------------------------------------------------------------


def _serves(run: Replay, target: float) -> bool:
    """Every team's p95 wait within `target`, and nothing refused for want of cards."""
    if run.aborted:
        return False
    s = summary(run)
    refused = sum(1 for r in run.results.values() if r.denied.endswith("card(s)"))
    return not refused and all(block["wait_p95_s"] <= target for block in s["teams"].values())


def _smallest(work: Workload, policy: Policy, model: str, target: float, unit: int, most: int,
              node_cards: int | None) -> tuple[int, Replay] | None:
    """The fewest cards (a multiple of `unit`, at most `most`) that serve `work`: a bisection, since more cards
    never make a wait longer in these workloads (the check at the answer is a replay, not an assumption)."""
    others = {m: c for m, c in _counts(policy).items() if m != model}

    def run(units: int) -> Replay:
        return replay(work, policy, cards=pool_cards(policy, {**others, model: units * unit}), node_cards=node_cards,
                      give_up_over=target)

    need = max((math.ceil(j.share) for j in work.jobs if j.model == model), default=1)
    low, high = max(1, math.ceil(need / unit)), max(1, most // unit)
    best = run(high)
    if not _serves(best, target):
        return None
    while low < high:
        middle = (low + high) // 2
        attempt = run(middle)
        if _serves(attempt, target):
            high, best = middle, attempt
        else:
            low = middle + 1
    return high * unit, best


def _counts(policy: Policy) -> dict[str, int]:
    counts: dict[str, int] = {}
    for declared in policy.inventory:
        counts[declared.model] = counts.get(declared.model, 0) + declared.count
    return counts


def find_capacity(work: Workload, policy: Policy, model: str, target: float, *, node_cards: int | None = None,
                  most: int | None = None) -> dict:
    """The smallest pool of `model` cards serving every team within a p95 wait of `target` seconds, pooled
    (the policies as they are) and dedicated (each team alone on cards of its own, no borrowing).

    Sizes are whole nodes when the cluster has nodes. `most` bounds the search (default: 4 × the inventory).
    """
    unit = node_cards or 1
    most = most or 4 * max(_counts(policy).get(model, 0), unit)
    begin = min((j.arrival for j in work.jobs), default=0.0)
    found = _smallest(work, policy, model, target, unit, most, node_cards)
    pooled = None
    if found:
        cards, run = found
        pooled = {"cards": cards, "utilisation": summary(run)["overall"]["utilisation"],
                  "wait_p95_s": summary(run)["overall"]["wait_p95_s"]}
    teams, hours, end, unserved = {}, 0.0, begin, []
    for team in sorted({j.team for j in work.jobs if j.team in policy.teams and j.model == model}):
        own = Workload([j for j in work.jobs if j.team == team], work.start, work.source)
        found = _smallest(own, policy, model, target, unit, most, node_cards)
        if found is None:
            unserved.append(team)
            continue
        cards, run = found
        s = summary(run)
        teams[team] = {"cards": cards, "wait_p95_s": s["overall"]["wait_p95_s"],
                       "utilisation": round(s["overall"]["gpu_hours"] / (cards * max(run.end - begin, 1) / 3600), 4)}
        hours += s["overall"]["gpu_hours"]
        end = max(end, run.end)
    total = sum(t["cards"] for t in teams.values())
    dedicated = {"cards": total, "teams": teams, "unserved": unserved,
                 "utilisation": round(hours / (total * max(end - begin, 1) / 3600), 4) if total else 0.0}
    return {"model": model, "wait_p95_target_s": target, "pooled": pooled, "dedicated": dedicated}


def capacity_table(found: dict) -> str:
    model, target = found["model"], _duration(found["wait_p95_target_s"])
    lines = [f"smallest pool of {model} with every team's p95 queue wait within {target}:"]
    pooled = found["pooled"]
    lines.append(f"  pooled:    {pooled['cards']} {model}, utilisation {pooled['utilisation'] * 100:.1f}%, "
                 f"p95 wait {_duration(pooled['wait_p95_s'])}" if pooled else "  pooled:    not within the search")
    d = found["dedicated"]
    lines.append(f"  dedicated: {d['cards']} {model}, utilisation {d['utilisation'] * 100:.1f}%"
                 + (f" (not served within the search: {', '.join(d['unserved'])})" if d["unserved"] else ""))
    for team, t in d["teams"].items():
        lines.append(f"    {team}: {t['cards']}, utilisation {t['utilisation'] * 100:.1f}%, "
                     f"p95 wait {_duration(t['wait_p95_s'])}")
    return "\n".join(lines)


def parse_duration(text: str) -> float:
    """`10m`, `90s`, `2h` or seconds, for `--wait-p95`."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a duration such as 10m, 90s, 2h or seconds") from None


# --- placement quality: Alibaba openb, the FGD paper's method ------------------------------------------

OPENB_PODS_HEADER = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"]
OPENB_NODES = "openb_node_list_gpu_node.csv"
OPENB_PODS = "openb_pod_list_default.csv"
#: openb's pods name no GPU model (`gpu_spec` is empty), so any card serves any pod: one model for all.
OPENB_MODEL = "openb"
DEMAND_POINTS = (1.0, 1.3)


@dataclass(frozen=True)
class Openb:
    """The openb trace as the placement experiment needs it: the GPU pods' shares and the GPU nodes."""

    shares: list[Fraction]  # of each pod asking for GPU: gpu_milli / 1000 of one card, or whole cards
    nodes: list[list[Card]]
    without_gpu: int  # pods asking for no GPU (left out: they place nothing on cards)
    source: str = ""

    @property
    def capacity(self) -> int:
        return sum(len(node) for node in self.nodes)


def default_openb_dir() -> Path:
    """`../shared/data/traces/openb` beside the working folder, else beside the repository."""
    here = Path("..") / "shared" / "data" / "traces" / "openb"
    beside_repository = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces" / "openb"
    return here if here.is_dir() else beside_repository


def read_openb(pods: str | Path, nodes: str | Path | None = None) -> Openb:
    """Alibaba's openb pod list (`num_gpu`, `gpu_milli`) and node list (`sn`, `gpu`, `model`).

    A pod of one GPU holds `gpu_milli`/1000 of a card (1000: the whole card); a pod of several GPUs holds
    that many whole cards, on one node. Every GPU node becomes a node of cards, its model in the card names.
    """
    pods = Path(pods)
    nodes = Path(nodes) if nodes is not None else pods.with_name(OPENB_NODES)
    shares, without_gpu = [], 0
    with open(pods, newline="") as f:
        for row in csv.DictReader(f):
            gpus, milli = int(row["num_gpu"]), int(row["gpu_milli"])
            if gpus == 0 or milli == 0:
                without_gpu += 1
            elif gpus == 1:
                shares.append(Fraction(milli, 1000))
            elif milli == 1000:
                shares.append(Fraction(gpus))
            else:
                raise ValueError(f"{pods}: pod {row['name']} asks for {gpus} GPUs of {milli} milli each; "
                                 "several GPUs are whole cards")
    node_cards: list[list[Card]] = []
    index = 0
    with open(nodes, newline="") as f:
        for row in csv.DictReader(f):
            count = int(row["gpu"])
            if count:
                node_cards.append([Card(f"{row['sn']}-{row['model']}-{i}", OPENB_MODEL, index + i, 0)
                                   for i in range(count)])
                index += count
    return Openb(shares, node_cards, without_gpu, f"openb {pods}")


def openb_allocation(trace: Openb, placement: str, seed: int,
                     points: tuple[float, ...] = DEMAND_POINTS) -> list[float]:
    """The GPU allocation ratio (GPU allocated / GPU capacity) when the GPU requested reaches each of `points`
    (fractions of capacity), as the FGD paper measures it: pods drawn at random from the trace (with
    replacement, seeded) arrive one by one, nothing leaves, and a pod that does not fit when it arrives is
    refused. Placement is the cluster's, and so the pool's, under `placement`, whose expected request sizes
    are the trace's own (FGD's target workload)."""
    demands = demands_of(trace.shares)
    cards = [card for node in trace.nodes for card in node]
    cluster = Cluster(cards, nodes=trace.nodes, placement=lambda model: Placement(placement, demands), scale=1000)
    rng = random.Random(seed)
    capacity = trace.capacity
    targets = sorted(points)
    requested = allocated = Fraction(0)
    ratios: list[float] = []
    n = 0
    while targets:
        share = rng.choice(trace.shares)
        requested += share
        n += 1
        request = Request(f"pod-{n}", "openb", "openb", DIRECT_PROFILE, f"{share} GPU", OPENB_MODEL, share)
        if cluster.reserve(request) is not None:
            allocated += share
        while targets and requested >= targets[0] * capacity:
            ratios.append(float(allocated / capacity))
            targets.pop(0)
    return ratios


def openb_experiment(trace: Openb, placements: Iterable[str], seeds: int,
                     points: tuple[float, ...] = DEMAND_POINTS) -> dict:
    """`openb_allocation` for each placement policy and seed 0 … seeds-1; mean and sd per demand point."""
    results = {}
    for name in placements:
        runs = [openb_allocation(trace, name, seed, points) for seed in range(seeds)]
        results[name] = {}
        for i, point in enumerate(sorted(points)):
            ratios = [run[i] for run in runs]
            mean = sum(ratios) / len(ratios)
            sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1)) if len(ratios) > 1 else 0.0
            results[name][f"{point:.0%}"] = {"mean": round(mean, 5), "sd": round(sd, 5),
                                            "runs": [round(r, 5) for r in ratios]}
    return results


def openb_table(trace: Openb, results: dict, seeds: int, seconds: float) -> str:
    multi = sum(1 for s in trace.shares if s > 1)
    lines = [f"{trace.source}: {len(trace.nodes)} GPU nodes, {trace.capacity} GPUs; {len(trace.shares)} GPU pods "
             f"({sum(1 for s in trace.shares if s < 1)} fractional, {multi} multi-GPU), {trace.without_gpu} "
             f"without GPU left out",
             f"pods drawn at random (seeds 0-{seeds - 1}), nothing leaves; GPU allocation ratio = GPU allocated "
             f"/ GPU capacity when the GPU requested reaches the demand; {seconds:.1f} s", ""]
    rows = [["placement", "demand", "allocation ratio (mean ± sd)"]]
    for name, points in results.items():
        for point, r in points.items():
            rows.append([name, point, f"{r['mean'] * 100:.2f}% ± {r['sd'] * 100:.2f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


# --- the command ----------------------------------------------------------------------------------------

PHILLY_HEADER = ["timestamp", "duration", "num_gpus", "gpu_time", "cluster"]


def usage_workload(rows: Iterable[dict[str, str]], source: str, limit: int | None = None) -> Workload:
    """The platform's own history (rows of `gpupool usage export`): each run arrives when it was asked for and
    runs as long as it ran, as its user in its team, asking for its model and share directly (so a policy set
    with other profiles replays it too). Servers and jobs alike are batch work here: they wait without a queue
    timeout. ValueError naming the first row that is not such a row."""
    runs = []
    for n, row in enumerate(rows):
        try:
            arrival, start, end = (datetime.fromisoformat(row[k].replace("Z", "+00:00"))
                                   for k in ("arrival", "start", "end"))
            share = Fraction(row["share"])
        except (KeyError, ValueError, ZeroDivisionError) as error:
            raise ValueError(f"{source}: row {n + 2} is not a usage export's row ({error})") from None
        kind = row.get("kind") or "server"
        runs.append((arrival, (end - start).total_seconds(), row["user"], row["team"], row["model"], share,
                     kind if kind in ("server", "job") else "server"))
    runs.sort(key=lambda r: r[0])
    if limit is not None:
        runs = runs[:limit]
    begin = runs[0][0] if runs else datetime(1970, 1, 1, tzinfo=timezone.utc)
    jobs = [Job(f"usage-{n}", user, team, model, share, (arrival - begin).total_seconds(), max(duration, 0.0),
                kind=kind)
            for n, (arrival, duration, user, team, model, share, kind) in enumerate(runs)]
    return Workload(jobs, begin, f"usage {source}")


def preemptible(work: Workload, teams: set[str]) -> Workload:
    """`work` with the jobs (not servers) of `teams` preemptible."""
    if not teams:
        return work
    return Workload([replace(j, preemptible=True) if j.team in teams and j.kind == "job" else j for j in work.jobs],
                    work.start, work.source, work.skipped)


def replay_usage(ledger, period: str, policies: dict[str, Policy], now: datetime | None = None
                 ) -> tuple[Workload, dict[str, dict], dict[str, Replay]]:
    """The ledger's runs of `period` (`gpupool usage export`'s rows) replayed under each policy set of
    `policies` (name → policy) on its own inventory: the workload, the summaries and the runs (with their
    timelines). Blocking (SQL, then the replays): from a thread in a service."""
    start, end = periods.period_bounds(period)
    rows = usage_rows(ledger.intervals_overlapping(start, end), now or periods.utcnow(), (start, end))
    work = usage_workload(rows, f"the ledger's runs of {period}")
    runs = {name: replay(work, policy, cards=pool_cards(policy), timeline_points=TIMELINE_POINTS)
            for name, policy in policies.items()}
    return work, {name: summary(run) for name, run in runs.items()}, runs


def read_usage(path: str | Path, limit: int | None = None) -> Workload:
    """A `gpupool usage export` CSV (see `usage_workload`)."""
    with open(path, newline="") as f:
        return usage_workload(csv.DictReader(f), str(path), limit)


def read_workload(path: str | Path, limit: int | None = None) -> Workload:
    """The workload at `path`, by its header; ValueError naming the formats accepted."""
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    if header == PHILLY_HEADER:
        return read_philly(path, limit=limit)
    if header == USAGE_HEADER:
        return read_usage(path, limit=limit)
    raise ValueError(f"{path}: not a workload this replay reads (its header is {','.join(header)!r}); accepted: "
                     f"a Philly trace ({','.join(PHILLY_HEADER)}) or `gpupool usage export`'s ({','.join(USAGE_HEADER)})")


def _capacity(text: str) -> tuple[str, int]:
    model, _, count = text.partition("=")
    if not model or not count.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give MODEL=N, e.g. H200=16")
    return model, int(count)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", help="a workload CSV: a Philly trace (philly.csv); or `openb` (or an openb pod "
                                         "list) for the placement experiment of the FGD paper")
    parser.add_argument("--policies", help="policy directory to replay under")
    parser.add_argument("--against", help="a second policy directory, replayed beside the first")
    parser.add_argument("--capacity", type=_capacity, action="append", default=[], metavar="MODEL=N",
                        help="cards of a model instead of the policies' inventory (repeatable)")
    parser.add_argument("--node-cards", type=int, metavar="N",
                        help="cards per node: multi-card jobs need theirs on one node, or are gang-placed "
                             "across nodes when larger than one (default: one node, the embedded pool)")
    parser.add_argument("--limit", type=int, metavar="N", help="only the first N jobs of the workload")
    parser.add_argument("--preemptible", action="append", default=[], metavar="TEAM",
                        help="the training jobs of TEAM are preemptible (repeatable): a waiting request of "
                             "higher priority may stop them, as `jobs.preemption` allows, and they resume later "
                             "where they stopped (a trace's rows are jobs; a usage export's say server or job)")
    parser.add_argument("--format", default="table", choices=["table", "json", "html"],
                        help="table (default), json, or html: a page with the table and each set's timeline "
                             "chart (utilisation and queue length over time, SVG)")
    parser.add_argument("--find-capacity", metavar="MODEL",
                        help="find the fewest MODEL cards serving every team within --wait-p95, pooled and dedicated")
    parser.add_argument("--wait-p95", type=parse_duration, default=600.0, metavar="DURATION",
                        help="the p95 queue wait target of --find-capacity (default: 10m)")
    parser.add_argument("--write-philly-policies", metavar="DIR",
                        help="write DIR/pooled and DIR/dedicated, the Philly cluster as policies, and stop")
    parser.add_argument("--philly-vcs", metavar="CSV",
                        help="philly_vc.csv (default: beside the workload)")
    parser.add_argument("--seeds", type=int, default=10, metavar="N",
                        help="openb: random arrival orders, seeds 0 … N-1 (default: 10)")
    parser.add_argument("--placement", action="append", choices=PLACEMENTS,
                        help="openb: the placement policy to measure (repeatable; default: all)")
    parser.add_argument("--openb-nodes", metavar="CSV",
                        help=f"openb: the node list (default: {OPENB_NODES} beside the pod list)")


def _write_policy(policy: Policy, folder: Path) -> None:
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    data = policy.model_dump(mode="json", exclude_defaults=True)
    (folder / "policy.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _is_openb(workload: str) -> bool:
    if workload == "openb":
        return True
    try:
        with open(workload, newline="") as f:
            return next(csv.reader(f), [])[:5] == OPENB_PODS_HEADER
    except OSError:
        return False


def openb_main(args: argparse.Namespace) -> int:
    pods = default_openb_dir() / OPENB_PODS if args.workload == "openb" else Path(args.workload)
    if args.seeds < 1:
        print("gpupool replay: --seeds must be at least 1", file=sys.stderr)
        return 2
    try:
        trace = read_openb(pods, args.openb_nodes)
    except (OSError, ValueError, KeyError) as error:
        print(f"gpupool replay: {error}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    results = openb_experiment(trace, args.placement or PLACEMENTS, args.seeds)
    seconds = time.perf_counter() - began
    if args.format == "json":
        print(json.dumps({"source": trace.source, "gpus": trace.capacity, "seeds": args.seeds,
                          "seconds": round(seconds, 2), "allocation_ratio": results}, indent=2))
    else:
        print(openb_table(trace, results, args.seeds, seconds))
    return 0


def main(args: argparse.Namespace) -> int:
    if _is_openb(args.workload):
        return openb_main(args)
    try:
        if args.write_philly_policies:
            vcs = read_philly_vcs(args.philly_vcs or Path(args.workload).with_name("philly_vc.csv"))
            for name, dedicated in (("pooled", False), ("dedicated", True)):
                _write_policy(philly_policy(vcs, dedicated=dedicated), Path(args.write_philly_policies) / name)
            print(f"wrote {args.write_philly_policies}/pooled and {args.write_philly_policies}/dedicated")
            return 0
        if not args.policies:
            print("gpupool replay: give --policies DIR (or --write-philly-policies DIR)", file=sys.stderr)
            return 2
        sets = [args.policies] + ([args.against] if args.against else [])
        policies = {}
        for name in sets:
            try:
                policies[name] = load_policy(name)
            except PolicyError as error:
                print(error.report(name, "nothing was replayed"), file=sys.stderr)
                return 2
        capacity = dict(args.capacity)
        cards = {name: pool_cards(policy, capacity) for name, policy in policies.items()}
        work = preemptible(read_workload(args.workload, args.limit), set(args.preemptible))
    except (OSError, ValueError) as error:
        print(f"gpupool replay: {error}", file=sys.stderr)
        return 2
    if args.find_capacity:
        results = {}
        for name, policy in policies.items():
            if args.find_capacity not in policy.models:
                print(f"gpupool replay: --find-capacity names model {args.find_capacity!r}, which {name} does "
                      f"not define (known: {', '.join(policy.models) or 'none'})", file=sys.stderr)
                return 2
            results[name] = find_capacity(work, policy, args.find_capacity, args.wait_p95,
                                          node_cards=args.node_cards)
        if args.format == "json":
            print(json.dumps(results, indent=2))
        else:
            print("\n\n".join(f"{name}: {capacity_table(found)}" for name, found in results.items()))
        return 0
    summaries, runs = {}, {}
    for name, policy in policies.items():
        runs[name] = replay(work, policy, cards=cards[name], node_cards=args.node_cards,
                            timeline_points=TIMELINE_POINTS if args.format == "html" else 0)
        summaries[name] = summary(runs[name])
    if args.format == "json":
        print(json.dumps(summaries, indent=2))
    elif args.format == "html":
        print(html_report(summaries, runs, work.source), end="")
    else:
        print(table(summaries))
    return 0
