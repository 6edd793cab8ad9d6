"""What a finished MLflow run cost: its user's ledger intervals over the run's time window, priced as bills are."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from fractions import Fraction

from gpupool.hub.accounting import periods
from gpupool.hub.accounting.bills import amount, hours_text, unit_price
from gpupool.hub.accounting.ledger import Interval
from gpupool.policies.model import Policy

#: Run tags written by the server when a run ends (clients may not set them).
COST_TAGS = ("gpupool.gpu_hours", "gpupool.cost", "gpupool.currency")


@dataclass(frozen=True)
class RunCost:
    gpu_hours: Fraction
    cost: Decimal
    currency: str

    def tags(self) -> dict[str, str]:
        return {"gpupool.gpu_hours": hours_text(self.gpu_hours), "gpupool.cost": str(self.cost),
                "gpupool.currency": self.currency}


def run_cost(policy: Policy, intervals: Iterable[Interval], start: datetime, end: datetime,
             profile: str | None = None) -> RunCost:
    """GPU-hours and cost of the parts of `intervals` inside [start, end), per model at the policy's price.

    An interval still open counts up to `end`. With `profile`, only intervals of that profile count (a run
    started in a server of that profile). Cost is rounded per model, as the bill rounds its lines.
    """
    per_model: dict[str, Fraction] = {}
    for interval in intervals:
        if profile is not None and interval.profile != profile:
            continue
        lo = max(interval.start, start)
        hi = min(interval.end or end, end)
        if hi <= lo:
            continue
        seconds = Fraction(int((hi - lo).total_seconds()))
        per_model[interval.model] = per_model.get(interval.model, Fraction(0)) + periods.gpu_hours(
            interval.share, seconds)
    total = sum(per_model.values(), Fraction(0))
    cost = sum((amount(hours, Fraction(unit_price(policy, model))) for model, hours in sorted(per_model.items())),
               Decimal("0.00"))
    return RunCost(total, cost, policy.billing.currency)
