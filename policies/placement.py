"""Which cards of a node a share goes on: the pool's placement policies (`settings.placement`), pure.

`best-fit` puts a fraction on the fullest card that still has room, whole cards on free cards.
`fragmentation-aware` is the FGD measure (Weng et al., "Beware of Fragmentation", USENIX ATC'23): the free
share of a card is useful only if a later request fits it, so a node's *fragmentation* is the free GPU that a
request drawn from the expected request sizes could not use, and a share goes where that expected
fragmentation grows least (ties: best fit). The embedded pool (`spawner.pool.place`) and `gpupool replay`'s
cluster call these same functions.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from gpupool.policies.model import DEFAULT_PLACEMENT, PLACEMENTS, Policy
from gpupool.policies.resources import profile_share

#: Request sizes and how often each is asked for (the weights sum to 1): FGD's target workload.
Demands = tuple[tuple[Fraction, Fraction], ...]
#: A node's free shares as (free share of a card, how many cards have it), sorted: the order of cards is
#: irrelevant to every measure here, so nodes in the same state share one answer.
FreeState = tuple[tuple[Fraction, int], ...]

ONE = Fraction(1)


@dataclass(frozen=True)
class Placement:
    """A placement policy and, for `fragmentation-aware`, the request sizes it expects.

    `unit` is the free share of a whole card: 1 with shares as fractions (the pool); a replay may count in
    integer units (1000 for milli-GPUs) with sizes and weights scaled alike, which orders every choice the
    same and costs a fraction of the arithmetic.
    """

    policy: str = DEFAULT_PLACEMENT
    demands: Demands = ()
    unit: Fraction | int = ONE

    def __post_init__(self):
        if self.policy not in PLACEMENTS:
            raise ValueError(f"no placement policy {self.policy!r} (accepted: {', '.join(PLACEMENTS)})")
        fractional = sorted((size, weight) for size, weight in self.demands if size < self.unit)
        suffix = [0] * (len(fractional) + 1)
        for i in range(len(fractional) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + fractional[i][1]
        object.__setattr__(self, "_sizes", [size for size, _ in fractional])
        object.__setattr__(self, "_larger", suffix)  # weight of the fractional sizes from index i on
        object.__setattr__(self, "_whole", [(size, weight) for size, weight in self.demands if size >= self.unit])

    def scaled(self, units: int) -> Placement:
        """The same placement counted in integer units of 1/`units` card (weights as integer counts)."""
        if not self.demands:
            return Placement(self.policy, (), units)
        common = math.lcm(*(w.denominator for _, w in self.demands))
        demands = tuple((_units(size, units), int(weight * common)) for size, weight in self.demands)
        return Placement(self.policy, demands, units)

    def unusable(self, free) -> Fraction | int:
        """The expected share of a card with `free` left that no fractional request fits (FGD, per card)."""
        return free * self._larger[bisect_right(self._sizes, free)]


def _units(share: Fraction, units: int) -> int:
    scaled = Fraction(share) * units
    if scaled.denominator != 1:
        raise ValueError(f"share {share} is not a whole number of 1/{units} card")
    return scaled.numerator


def demands_of(shares: Iterable[Fraction]) -> Demands:
    """The distribution of request sizes in `shares` (each size weighted by how often it occurs)."""
    counts = Counter(Fraction(s) for s in shares if s > 0)
    total = sum(counts.values())
    return tuple((size, Fraction(n, total)) for size, n in sorted(counts.items()))


def placement_for(policy: Policy, model: str) -> Placement:
    """The embedded pool's placement for `model`: the policy's `settings.placement`, and as expected request
    sizes the shares of the profiles offering that model (each profile equally likely)."""
    shares = [profile_share(p, policy) for p in policy.profiles.values() if p.gpu and p.gpu.model == model]
    return Placement(policy.settings.placement, demands_of(shares))


def free_state(free: Iterable[Fraction]) -> FreeState:
    return tuple(sorted(Counter(free).items()))


def fragmentation(state: FreeState, placement: Placement):
    """FGD's expected fragmentation of a node: the free GPU a request drawn from the demands could not use.

    A fraction cannot use a card with less free than it asks (all of the node's free GPU when no card has
    room); `k` whole cards can use only free cards, and nothing when fewer than `k` are free.
    """
    unit = placement.unit
    total = sum(v * n for v, n in state)
    free_cards = sum(n for v, n in state if v == unit)
    lost = sum(n * placement.unusable(v) for v, n in state)
    for size, weight in placement._whole:
        lost += weight * (total - free_cards * unit if free_cards * unit >= size else total)
    return lost


def growth(state: FreeState, free, taken, cards: int, placement: Placement):
    """How much `fragmentation` grows when `taken` is taken from each of `cards` cards with `free` left: the
    gradient FGD descends. Only those cards change, so it is their per-card terms and the node's whole-card
    terms, without recounting the node."""
    unit = placement.unit
    grown = cards * (placement.unusable(free - taken) - placement.unusable(free))
    if placement._whole:
        total = sum(v * n for v, n in state)
        free_cards = sum(n for v, n in state if v == unit)
        partial = total - free_cards * unit
        after_total = total - cards * taken
        after_cards, after_partial = ((free_cards - cards, partial + cards * (unit - taken)) if free == unit
                                      else (free_cards, partial - cards * taken))
        for size, weight in placement._whole:
            before = partial if free_cards * unit >= size else total
            after = after_partial if after_cards * unit >= size else after_total
            grown += weight * (after - before)
    return grown


def node_score(state: FreeState, share, placement: Placement) -> tuple | None:
    """How well `share` fits a node in `state` (lower is better); None when it does not fit.

    Best fit: a fraction prefers the node holding the fullest card with room, whole cards the node with the
    fewest free cards that suffice. Fragmentation-aware: the growth of the node's expected fragmentation, then
    best fit. A cluster picks the node with the lowest score (ties: the first node), then `choose_cards` on it.
    """
    unit = placement.unit
    if share < unit:
        room = [v for v, _ in state if v >= share]
        if not room:
            return None
        if placement.policy == "best-fit":
            return (min(room),)
        return min((growth(state, v, share, 1, placement), v) for v in room)
    free_cards = sum(n for v, n in state if v == unit)
    if free_cards * unit < share:
        return None
    if placement.policy == "best-fit":
        return (free_cards,)
    return (growth(state, unit, unit, share // unit, placement), free_cards)


def choose_cards(free: Sequence, share, placement: Placement) -> tuple[int, ...] | None:
    """Positions in `free` (one node's cards in order, each card's free share, in `placement.unit`s) that
    `share` goes on; None if it does not fit. A fraction goes on one card; whole cards on the first free ones
    (free cards are alike)."""
    unit = placement.unit
    if share < unit:
        fitting = [i for i, f in enumerate(free) if f >= share]
        if not fitting:
            return None
        if placement.policy == "best-fit":
            return (min(fitting, key=lambda i: (free[i], i)),)
        state = free_state(free)
        grown = {v: growth(state, v, share, 1, placement) for v in {free[i] for i in fitting}}
        return (min(fitting, key=lambda i: (grown[free[i]], free[i], i)),)
    if share % unit:
        raise ValueError(f"a share above one card must be whole cards, not {share}")
    whole = [i for i, f in enumerate(free) if f == unit]
    if len(whole) < share // unit:
        return None
    return tuple(whole[: share // unit])
