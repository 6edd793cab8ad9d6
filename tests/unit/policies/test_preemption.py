"""Which running jobs a waiting request may preempt: only preemptible jobs, only of a lower priority (by the
policy's gap), over-budget work first, none that is not needed to make room by the pool's own placement."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from gpupool.policies.model import Preemption
from gpupool.policies.placement import Placement, choose_cards
from gpupool.policies.preemption import Holder, victims

RULES = Preemption()
BEST_FIT = Placement("best-fit")
CARDS = ["c0", "c1"]


def fits(free, share):
    return choose_cards(free, share, BEST_FIT)


def used_by(holders, extra=None):
    used = dict(extra or {})
    for h in holders:
        for card in h.cards:
            used[card] = used.get(card, Fraction(0)) + h.per_card
    return used


def job(key, card, share="1", priority=0, preemptible=True, deprioritized=False, started=0.0):
    return Holder(key, "H200", (card,), Fraction(share), priority, preemptible, deprioritized, started)


def test_the_fewest_lowest_priority_preemptible_jobs_that_make_room():
    holders = [job("low", "c0", priority=0), job("normal", "c1", priority=10)]
    assert victims(RULES, "job", 20, "H200", Fraction(1), CARDS, used_by(holders), holders, fits) == ["low"]
    # In eviction order (the most recently started first) until a card is free: the four quarters, then any
    # taken that turned out unnecessary is given back (here none); the older whole-card job stays.
    quarters = [job(f"q{i}", "c0", "1/4", priority=0, started=i + 1) for i in range(4)] + [job("w", "c1", priority=0)]
    chosen = victims(RULES, "job", 10, "H200", Fraction(1), CARDS, used_by(quarters), quarters, fits)
    assert chosen == ["q3", "q2", "q1", "q0"]
    # An unnecessary one is given back: the newer half on c0 goes first, but a notebook holds c0's other half,
    # so only the whole card c1 makes the room.
    mixed = [job("half", "c0", "1/2", priority=0, started=9), job("whole", "c1", priority=0, started=1)]
    notebook = {"c0": Fraction(1, 2)}
    assert victims(RULES, "job", 10, "H200", Fraction(1), CARDS, used_by(mixed, notebook), mixed, fits) == ["whole"]


def test_nothing_of_the_same_or_higher_priority_and_nothing_not_preemptible():
    holders = [job("same", "c0", priority=10), job("fixed", "c1", priority=0, preemptible=False)]
    assert victims(RULES, "job", 10, "H200", Fraction(1), CARDS, used_by(holders), holders, fits) == []
    # The gap of the policy: 10 above is not enough when 11 is asked for.
    gap = Preemption(min_priority_gap=11)
    assert victims(gap, "job", 10, "H200", Fraction(1), ["c0"], used_by(holders[:1]), [job("low", "c0")], fits) == []


def test_over_budget_work_goes_first_then_the_most_recently_started():
    halves = [job("over", "c0", "1/2", priority=50, deprioritized=True), job("low", "c0", "1/2", priority=0, started=5)]
    # Half a card: the over-budget half goes, though its team's priority is high.
    assert victims(RULES, "job", 10, "H200", Fraction(1, 2), ["c0"], used_by(halves), halves, fits) == ["over"]
    wholes = [job("old", "c0", priority=0, started=1), job("new", "c1", priority=0, started=2)]
    assert victims(RULES, "job", 10, "H200", Fraction(1), CARDS, used_by(wholes), wholes, fits) == ["new"]


def test_who_may_preempt_is_policy_and_notebooks_are_never_preempted():
    holders = [job("low", "c0")]
    only_jobs = Preemption(by=["job"])
    assert victims(only_jobs, "server", 10, "H200", Fraction(1), ["c0"], used_by(holders), holders, fits) == []
    assert victims(Preemption(enabled=False), "job", 10, "H200", Fraction(1), ["c0"], used_by(holders), holders,
                   fits) == []
    # A notebook holding the other card is in `used` only: nothing may take it away.
    notebook = {"c1": Fraction(1)}
    assert victims(RULES, "job", 10, "H200", Fraction(2), CARDS, used_by(holders, notebook), holders, fits) == []


def test_no_victim_when_it_fits_already_or_never_would():
    holders = [job("low", "c0", "1/2")]
    assert victims(RULES, "job", 10, "H200", Fraction(1, 2), ["c0"], used_by(holders), holders, fits) == []
    assert victims(RULES, "job", 10, "H200", Fraction(3), CARDS, used_by(holders), holders, fits) == []


@given(st.lists(st.tuples(st.sampled_from(CARDS), st.sampled_from(["1/4", "1/2", "1"]), st.integers(0, 20),
                          st.booleans()), max_size=6),
       st.sampled_from(["1/4", "1/2", "1", "2"]), st.integers(0, 30))
def test_the_chosen_make_room_and_follow_the_rules(specs, share, priority):
    holders, used = [], {}
    for i, (card, part, prio, preemptible) in enumerate(specs):
        if used.get(card, Fraction(0)) + Fraction(part) > 1:
            continue  # the pool never over-commits a card
        used[card] = used.get(card, Fraction(0)) + Fraction(part)
        holders.append(job(f"j{i}", card, part, prio, preemptible, started=i))
    chosen = victims(RULES, "job", priority, "H200", Fraction(share), CARDS, used, holders, fits)
    by_key = {h.key: h for h in holders}
    for key in chosen:
        assert by_key[key].preemptible and by_key[key].priority <= priority - RULES.min_priority_gap
    if chosen:
        left = used_by([h for h in holders if h.key not in chosen])
        assert fits([1 - left.get(c, Fraction(0)) for c in CARDS], Fraction(share)) is not None
        for key in chosen:  # none of them is needed without the others
            rest = used_by([h for h in holders if h.key not in chosen or h.key == key])
            assert fits([1 - rest.get(c, Fraction(0)) for c in CARDS], Fraction(share)) is None
    else:
        assert fits([1 - used.get(c, Fraction(0)) for c in CARDS], Fraction(share)) is not None or not [
            h for h in holders if h.preemptible and h.priority <= priority - 1] or fits(
            [1 - used_by([h for h in holders if not (h.preemptible and h.priority <= priority - 1)]).get(
                c, Fraction(0)) for c in CARDS], Fraction(share)) is None
