"""Placement policies (`settings.placement`): hand-computed fragmentation-aware choices, the embedded pool using
the setting through the same functions as `gpupool replay`, and the openb experiment being deterministic."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from fractions import Fraction as F

import pytest

from gpupool.hub import replay as R
from gpupool.hub.accounting.ledger import Ledger
from gpupool.policies import PolicyError, load_policy
from gpupool.policies.model import Policy
from gpupool.policies.placement import (
    Placement, choose_cards, demands_of, fragmentation, free_state, growth, node_score, placement_for,
)
from gpupool.spawner import local
from gpupool.spawner.pool import Card, Request, admit_all, place

#: A later request is a quarter or a half card, equally often.
QUARTER_HALF = ((F(1, 4), F(1, 2)), (F(1, 2), F(1, 2)))
FGD = Placement("fragmentation-aware", QUARTER_HALF)
BEST = Placement("best-fit")


def request(key: str, share, model: str = "H200") -> Request:
    return Request(key, "alice", "vision", "direct", f"{share} × {model}", model, F(share))


def test_fragmentation_is_the_free_share_later_requests_cannot_use():
    # 0.35 free: a quarter fits it, a half does not: half of the time 0.35 is lost.
    assert fragmentation(free_state([F(35, 100)]), FGD) == F(35, 100) / 2
    assert fragmentation(free_state([F(1, 2), F(3, 4)]), FGD) == 0
    # Two whole cards asked for: a node with one free card loses all its free share; with two, the partial one.
    two = Placement("fragmentation-aware", ((F(2), F(1)),))
    assert fragmentation(free_state([F(1), F(1, 2)]), two) == F(3, 2)
    assert fragmentation(free_state([F(1), F(1), F(1, 2)]), two) == F(1, 2)
    # The gradient is the difference of the fragmentation before and after, without recounting the node.
    state = free_state([F(1), F(1), F(6, 10), F(3, 10)])
    for placement in (FGD, two, Placement("fragmentation-aware", QUARTER_HALF + ((F(1), F(1, 3)),))):
        for free, taken, cards in ((F(1), F(1, 4), 1), (F(6, 10), F(1, 2), 1), (F(1), F(1), 2)):
            after = [F(1)] * 2 + [F(6, 10), F(3, 10)]
            after.remove(free)
            if cards == 2:
                after.remove(free)
            after += [free - taken] * cards
            assert growth(state, free, taken, cards, placement) == (
                fragmentation(free_state(after), placement) - fragmentation(state, placement))
        # Counted in integer milli-units (weights as counts) the gradient is the same, scaled.
        milli, common = placement.scaled(1000), math.lcm(*(w.denominator for _, w in placement.demands))
        assert growth(free_state([1000, 1000, 600, 300]), 600, 500, 1, milli) == (
            growth(state, F(6, 10), F(1, 2), 1, placement) * 1000 * common)

    assert demands_of([F(1, 4), F(1, 2), F(1, 4), F(1, 4)]) == ((F(1, 4), F(3, 4)), (F(1, 2), F(1, 4)))


def test_fragmentation_aware_keeps_the_free_share_usable_where_best_fit_strands_it():
    free = [F(6, 10), F(3, 4), F(1)]
    # Best fit: the fullest card with room, leaving 0.35, which no half fits.
    assert choose_cards(free, F(1, 4), BEST) == (0,)
    # Fragmentation-aware: card 0 would grow fragmentation by 0.35 × ½; cards 1 and 2 by nothing (0.5 and 0.75
    # left stay usable); of those, best fit: card 1.
    assert choose_cards(free, F(1, 4), FGD) == (1,)
    assert node_score(free_state(free), F(1, 4), FGD) == (0, F(3, 4))
    assert node_score(free_state([F(6, 10)]), F(1, 4), FGD) == (F(35, 100) / 2, F(6, 10))
    assert choose_cards(free, F(2), FGD) is None and choose_cards(free, F(1), FGD) == (2,)


def test_the_replay_cluster_places_by_hand_on_nodes():
    # Three nodes of one card: 0.4, then two quarters.
    cards = [Card(f"c{i}", "H200", i, 141) for i in range(3)]
    nodes = [[c] for c in cards]
    fgd = R.Cluster(cards, nodes=nodes, placement=lambda model: FGD)
    assert [fgd.reserve(request(k, s)).cards for k, s in (("a", "0.4"), ("b", "0.25"), ("c", "0.25"))] == [
        ("c0",),  # every node alike (0.6 left is usable by both sizes): the first
        ("c1",),  # c0 would keep 0.35, useless to a half; c1 keeps 0.75
        ("c1",),  # c1's 0.75 → 0.5, still usable; c2 would do as well, but is emptier
    ]
    best = R.Cluster(cards, nodes=nodes)
    assert [best.reserve(request(k, s)).cards for k, s in (("a", "0.4"), ("b", "0.25"), ("c", "0.25"))] == [
        ("c0",), ("c0",), ("c0",)]
    # Multi-card requests need their cards on one node.
    pairs = [Card(f"p{i}", "H200", i, 141) for i in range(4)]
    cluster = R.Cluster(pairs, nodes=[pairs[:2], pairs[2:]],
                        placement=lambda model: Placement("fragmentation-aware", ((F(1, 2), F(1, 2)), (F(2), F(1, 2)))))
    assert cluster.reserve(request("half", "0.5")).cards == ("p0",)
    assert cluster.reserve(request("two", 2)).cards == ("p2", "p3")
    assert cluster.reserve(request("again", 2)) is None


def test_best_fit_on_nodes_is_the_pools_best_fit_over_all_cards():
    rng = random.Random(7)
    cards = [Card(f"c{i}", "H200", i, 141) for i in range(24)]
    nodes = [cards[i:i + size] for i, size in ((0, 8), (8, 4), (12, 2), (14, 2), (16, 8))]
    cluster = R.Cluster(cards, nodes=nodes)
    for n in range(300):
        share = rng.choice([F(1, 10), F(1, 4), F(1, 3), F(1, 2), F(7, 10)])
        expected = place(cards, cluster.used, "H200", share)
        allocation = cluster.reserve(request(f"r{n}", share))
        assert (allocation.cards if allocation else None) == expected
        if cluster.held and rng.random() < 0.3:
            cluster.release(rng.choice(sorted(cluster.held)))


POLICY = {
    "models": {"H200": {"vendor": "nvidia", "memory_gib": 141, "backends": ["hami"]}},
    "inventory": [{"model": "H200", "count": 3, "uuids": ["c0", "c1", "c2"]}],
    "profiles": {
        "quarter": {"display_name": "0.25 × H200", "gpu": {"model": "H200", "share": 0.25}, "teams": ["vision"]},
        "half": {"display_name": "0.5 × H200", "gpu": {"model": "H200", "share": 0.5}, "teams": ["vision"]},
    },
    "teams": {"vision": {"members": ["alice"]}},
}


@pytest.mark.parametrize("setting, cards", [("fragmentation-aware", ["c0", "c1", "c1"]),
                                            ("best-fit", ["c0", "c0", "c0"])])
def test_the_embedded_pool_places_as_the_setting_says_and_the_replay_agrees(tmp_path, setting, cards):
    policy = Policy.model_validate({**POLICY, "settings": {"placement": setting}})
    assert placement_for(policy, "H200") == Placement(setting, QUARTER_HALF)  # the profiles' shares
    asked = [("u/a", "0.4"), ("u/b", "0.25"), ("u/c", "0.25")]

    async def live() -> list[str]:
        ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
        pool = local.get_pool(str(tmp_path), lambda: policy, ledger, logging.getLogger("test"))
        try:
            assert pool.placement("H200") == placement_for(policy, "H200")
            pool.decide, pool.hold = admit_all, None  # admission is not what this test is about
            return [(await pool.acquire(request(key, share), timeout=5)).cards[0] for key, share in asked]
        finally:
            local._pools.pop(str(tmp_path), None)
            ledger.dispose()

    assert asyncio.run(live()) == cards
    # a 0.4 leaves 0.6 on c0; b on c0 would leave 0.35, which no half fits: fragmentation-aware puts it on
    # c1 (0.75 left), and c on c1 again (0.5 left, still a half). The replay, through the same functions:
    work = [R.Job(key, "alice", "vision", "H200", F(share), float(n), 3600.0) for n, (key, share) in enumerate(asked)]
    run = R.replay(work, policy)
    assert [run.results[key].cards[0] for key, _ in asked] == [f"GPU-replay-H200-{c[1]}" for c in cards]


def test_an_unknown_placement_is_refused_with_file_and_line(tmp_path):
    (tmp_path / "settings.yaml").write_text("settings:\n  queue_timeout_seconds: 60\n  placement: worst-fit\n")
    with pytest.raises(PolicyError) as error:
        load_policy(tmp_path)
    report = str(error.value.report(str(tmp_path), "nothing was changed"))
    assert "settings.yaml:3" in report and "best-fit" in report and "fragmentation-aware" in report


def tiny_openb() -> R.Openb:
    nodes = [[R.Card(f"n{n}-{i}", R.OPENB_MODEL, 4 * n + i, 0) for i in range(size)]
             for n, size in enumerate([4, 2, 2, 1])]
    shares = [F(1), F(1), F(1, 2), F(3, 10), F(7, 10), F(2), F(1, 4), F(4)]
    return R.Openb(shares, nodes, 0, "tiny")


def test_the_openb_experiment_is_deterministic_and_measures_allocated_over_capacity():
    trace = tiny_openb()
    first = R.openb_experiment(trace, ["best-fit", "fragmentation-aware"], seeds=3)
    assert first == R.openb_experiment(trace, ["best-fit", "fragmentation-aware"], seeds=3)
    for points in first.values():
        assert set(points) == {"100%", "130%"}
        for r in points.values():
            assert len(r["runs"]) == 3 and all(0 < x <= 1 for x in r["runs"])
    # By hand: two one-card nodes, every pod 0.6: one pod per card, 1.2 of 2 GPUs allocated; the requested
    # GPU reaches 100% (2.4 ≥ 2) with the 4th pod, 130% (3.0 ≥ 2.6) with the 5th.
    cards = [R.Card(f"n{i}", R.OPENB_MODEL, i, 0) for i in range(2)]
    sixty = R.Openb([F(6, 10)], [[c] for c in cards], 0, "sixty")
    for placement in ("best-fit", "fragmentation-aware"):
        assert R.openb_allocation(sixty, placement, seed=5) == [0.6, 0.6]


def test_replay_openb_command_prints_the_table(tmp_path, capsys):
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
                    "p0,1000,1024,1,500\np1,1000,1024,1,1000\np2,1000,1024,2,1000\np3,1000,1024,0,0\n")
    (tmp_path / R.OPENB_NODES).write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,2,T4\nn1,1,1,4,V100M16\n"
                                          "n2,1,1,0,CPU\n")
    from gpupool.hub.cli import main

    assert main(["replay", str(pods), "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 GPU nodes, 6 GPUs; 3 GPU pods (1 fractional, 1 multi-GPU), 1 without GPU" in out
    assert "best-fit" in out and "fragmentation-aware" in out and "130%" in out
