"""Which running jobs a waiting request may preempt (pure: no I/O).

A request that cannot fit may stop the lowest-priority *preemptible* jobs, when the policy's `jobs.preemption`
lets its kind (`server` or `job`) preempt and each of them is at least `min_priority_gap` below it. Notebook
servers are never preempted, and nothing of a priority at or above the request's is. Over-budget
(deprioritized) work goes first, then the lowest priority, then the most recently started (it has lost
the least). Taken in that order until the request fits by the same placement the pool uses, then any that
turned out unnecessary is given back, so none is preempted for nothing; none when even all of them would not
make room.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from gpupool.policies.model import Preemption

#: Given each candidate card's free share (in card order) and the share asked for: the chosen cards'
#: positions, or None when it does not fit (`policies.placement.choose_cards` with the model's placement).
Fits = Callable[[list[Fraction], Fraction], Sequence[int] | None]


@dataclass(frozen=True)
class Holder:
    """A running job as preemption sees it: what it holds, of which cards, and how it ranks."""

    key: str
    model: str
    cards: tuple[str, ...]
    per_card: Fraction  # its share of each of its cards (1 for whole cards)
    priority: int
    preemptible: bool
    deprioritized: bool = False
    started: float = 0.0


def _eviction_order(holder: Holder) -> tuple[bool, int, float]:
    return (not holder.deprioritized, holder.priority, -holder.started)


def may_preempt(rules: Preemption, kind: str, request_priority: int, holder: Holder, model: str) -> bool:
    """Whether a request of `kind` at `request_priority` for `model` may preempt `holder`."""
    return (rules.enabled and kind in rules.by and holder.preemptible and holder.model == model
            and (holder.deprioritized or holder.priority <= request_priority - rules.min_priority_gap))


def victims(rules: Preemption, kind: str, request_priority: int, model: str, share: Fraction,
            cards: Sequence[str], used: dict[str, Fraction], holders: Sequence[Holder], fits: Fits) -> list[str]:
    """The keys of the jobs to preempt so that `share` of `model` fits on `cards` (that model's cards, in
    order), given what each card has `used`; [] when nothing may or needs to be preempted, or when even every
    job it may preempt would not make room."""
    candidates = sorted((h for h in holders if may_preempt(rules, kind, request_priority, h, model)),
                        key=_eviction_order)

    def fit_without(gone: list[Holder]) -> bool:
        free = dict(used)
        for holder in gone:
            for card in holder.cards:
                free[card] = free.get(card, Fraction(0)) - holder.per_card
        return fits([1 - free.get(card, Fraction(0)) for card in cards], share) is not None

    if not candidates or fit_without([]):
        return []
    chosen: list[Holder] = []
    for holder in candidates:
        chosen.append(holder)
        if fit_without(chosen):
            break
    else:
        return []
    # Keep only those that are needed: a later, larger one may have made an earlier one unnecessary.
    for holder in list(chosen):
        rest = [h for h in chosen if h is not holder]
        if fit_without(rest):
            chosen = rest
    return [h.key for h in chosen]
