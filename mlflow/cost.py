"""What a finished MLflow run cost: its user's ledger intervals over the run's time window, priced as bills are."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from fractions import Fraction

from gpupool.hub.accounting.bills import round_half_up, unit_price
from gpupool.hub.accounting.ledger import Interval
from gpupool.policies import periods
from gpupool.policies.model import Policy

#: Run tags written by the server when a run ends (clients may not set them).
COST_TAGS = ("gpupool.gpu_hours", "gpupool.gpu_seconds", "gpupool.cost", "gpupool.currency")
#: Decimals of the GPU-hours and cost tags: finer than one ledger second of a 1/7 share (0.00004 GPU-h), so a
#: run of a few seconds shows what it used. Bills round each line to the cent; a run's cost is not a bill line.
GPU_HOURS_PLACES = 6
COST_PLACES = 4


@dataclass(frozen=True)
class RunCost:
    gpu_hours: Fraction
    cost: Fraction
    currency: str

    def tags(self) -> dict[str, str]:
        return {"gpupool.gpu_hours": str(round_half_up(self.gpu_hours, GPU_HOURS_PLACES)),
                # Exact: share × ledger seconds, e.g. "5/4" for 5 s of a quarter card.
                "gpupool.gpu_seconds": str(self.gpu_hours * periods.SECONDS_PER_HOUR),
                "gpupool.cost": str(round_half_up(self.cost, COST_PLACES)), "gpupool.currency": self.currency}


def _ledger_second(moment: datetime) -> datetime:
    """`moment` at the ledger's precision: whole seconds, rounded down, as every ledger time is."""
    return periods.from_epoch_seconds(periods.to_epoch_seconds(moment))


def run_cost(policy: Policy, intervals: Iterable[Interval], start: datetime, end: datetime,
             profile: str | None = None) -> RunCost:
    """GPU-hours and cost of the parts of `intervals` inside [start, end), per model at the policy's price.

    The run's window is taken at the ledger's precision (whole seconds, rounded down, like the intervals'
    own times), so each overlap is a whole number of the seconds the ledger bills and runs that follow each
    other share out their server's interval exactly. An interval still open counts up to `end`. With
    `profile`, only intervals of that profile count (a run started in a server of that profile).
    """
    start, end = _ledger_second(start), _ledger_second(end)
    per_model: dict[str, Fraction] = {}
    for interval in intervals:
        if (profile is not None and interval.profile != profile) or interval.is_reserved:
            continue
        lo = max(interval.start, start)
        hi = min(interval.end or end, end)
        if hi <= lo:
            continue
        per_model[interval.model] = per_model.get(interval.model, Fraction(0)) + periods.gpu_hours(
            interval.share, (hi - lo) // timedelta(seconds=1))
    total = sum(per_model.values(), Fraction(0))
    cost = sum((hours * Fraction(unit_price(policy, model)) for model, hours in per_model.items()), Fraction(0))
    return RunCost(total, cost, policy.billing.currency)
