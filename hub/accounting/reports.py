"""Reports for the admin and team pages: utilisation per model per day, queue waits, top consumers, and their charts.

Data comes from the ledger (JSON-able dicts, exact numbers as text); charts are self-contained inline SVG
rendered here on the server: no JavaScript, nothing fetched from anywhere, every label escaped.
"""

from __future__ import annotations

import html
from collections import Counter
from datetime import datetime, timedelta
from fractions import Fraction

from gpupool.hub.accounting import periods
from gpupool.hub.accounting.admission import format_hours
from gpupool.hub.accounting.bills import amount, unit_price
from gpupool.hub.accounting.ledger import Ledger
from gpupool.policies.model import Policy
from gpupool.spawner.pool import discover_cards

#: The most consumers a report lists.
MAX_TOP = 100


def capacity_of(policy: Policy) -> dict[str, int]:
    """Cards per GPU model: NVML's when a driver is present here, else the policy's declared inventory."""
    cards, _source = discover_cards(policy)
    found = Counter(card.model for card in cards)
    return {model: found.get(model, 0) for model in policy.models}


def days_of(period: str, now: datetime) -> list[tuple[datetime, datetime]]:
    """The UTC days of `period` that have begun by `now`, as [start, end) (the last one cut at `now`)."""
    start, end = periods.period_bounds(period)
    days = []
    cursor = start
    while cursor < min(end, now):
        days.append((cursor, min(cursor + timedelta(days=1), end, now)))
        cursor += timedelta(days=1)
    return days


def _ratio(used: Fraction, capacity: Fraction) -> str:
    return f"{float(used / capacity):.4f}" if capacity else "0"


def daily_utilisation(ledger: Ledger, policy: Policy, capacity: dict[str, int], period: str,
                      now: datetime | None = None) -> dict[str, list[dict[str, str]]]:
    """Per model, per day of `period` so far: allocated GPU-hours / capacity GPU-hours (cards × hours)."""
    now = now or periods.utcnow()
    result: dict[str, list[dict[str, str]]] = {model: [] for model in policy.models}
    for start, end in days_of(period, now):
        allocated = ledger.gpu_hours_between(start, end, ("model",), now=now)
        hours = Fraction(int((end - start).total_seconds()), periods.SECONDS_PER_HOUR)
        for model in policy.models:
            used, cap = allocated.get((model,), Fraction(0)), capacity.get(model, 0) * hours
            result[model].append({"day": start.date().isoformat(), "allocated_gpu_hours": format_hours(used),
                                  "capacity_gpu_hours": format_hours(cap), "utilisation": _ratio(used, cap)})
    return result


def queue_waits(ledger: Ledger, period: str, team: str | None = None) -> dict[str, dict[str, str | int]]:
    """Per team: how many runs of `period` waited, their mean and longest wait in seconds."""
    return {name: {"runs": waits.count, "mean_seconds": f"{float(waits.mean_s):.1f}",
                   "longest_seconds": waits.longest_s}
            for name, waits in sorted(ledger.queue_waits(period, team=team).items())}


def top_consumers(ledger: Ledger, period: str, limit: int, team: str | None = None) -> list[dict[str, str]]:
    """The users with the most GPU-hours in `period` (of one team, or of all), most first."""
    sums = ledger.gpu_hours(period, ("team", "user"), team=team)
    ranked = sorted(sums.items(), key=lambda item: (-item[1], item[0]))[:limit]
    return [{"team": t, "user": u, "gpu_hours": format_hours(hours)} for (t, u), hours in ranked]


def running_servers(ledger: Ledger, policy: Policy, user: str, now: datetime | None = None) -> list[dict[str, str]]:
    """`user`'s running servers: share, since when, GPU-hours and cost so far, over the whole run.

    A run continued after a crash is several intervals; the user sees one server since its start.
    """
    now = now or periods.utcnow()
    running = []
    for interval in ledger.open_intervals():
        if interval.user != user:
            continue
        pieces = ledger.run_intervals(interval.run) if interval.run else [interval]
        seconds = sum(int(((p.end or max(now, p.start)) - p.start).total_seconds()) for p in pieces)
        hours = periods.gpu_hours(interval.share, seconds)
        price = Fraction(unit_price(policy, interval.model)) if interval.model in policy.billing.prices else Fraction(0)
        running.append({
            "key": interval.run or interval.key, "team": interval.team, "profile": interval.profile,
            "model": interval.model, "share": str(interval.share), "since": pieces[0].start.isoformat(),
            "gpu_hours": format_hours(hours), "cost": str(amount(hours, price)),
        })
    return running


def team_daily(ledger: Ledger, team: str, period: str, now: datetime | None = None) -> list[dict[str, str]]:
    """One team's GPU-hours per day of `period` so far."""
    now = now or periods.utcnow()
    return [{"day": start.date().isoformat(),
             "gpu_hours": format_hours(ledger.gpu_hours_between(start, end, (), team=team, now=now)[()])}
            for start, end in days_of(period, now)]


# --- charts --------------------------------------------------------------------------------------------------


def bar_chart(title: str, bars: list[tuple[str, float]], unit: str, limit: float | None = None) -> str:
    """Horizontal bars, one per label (a budget line where `limit` is given)."""
    width, row = 560, 26
    height = 40 + row * max(1, len(bars))
    top = max([v for _, v in bars] + [limit or 0, 1e-9])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(title)}"><text x="0" y="16" font-weight="bold">{html.escape(title)}</text>']
    for i, (label, value) in enumerate(bars):
        y = 30 + i * row
        length = 300 * value / top
        parts.append(f'<text x="0" y="{y + 15}">{html.escape(label)}</text>'
                     f'<rect x="150" y="{y}" width="{length:.1f}" height="18" fill="#3b7dd8"/>'
                     f'<text x="{156 + length:.1f}" y="{y + 14}">{value:.2f} {html.escape(unit)}</text>')
    if limit:
        x = 150 + 300 * limit / top
        parts.append(f'<line x1="{x:.1f}" y1="26" x2="{x:.1f}" y2="{height}" stroke="#c0392b" '
                     f'stroke-dasharray="4"/><text x="{x + 3:.1f}" y="{height - 2}" fill="#c0392b">budget</text>')
    return "".join(parts) + "</svg>"


def column_chart(title: str, columns: list[tuple[str, float]], unit: str, top: float | None = None) -> str:
    """Vertical columns over days (labels are dates; every 7th is written), scaled to `top` or the largest."""
    width, height, base = 620, 200, 170
    step = (width - 60) / max(1, len(columns))
    scale = top or max([v for _, v in columns] + [1e-9])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(title)}"><text x="0" y="16" font-weight="bold">{html.escape(title)}</text>'
             f'<line x1="50" y1="{base}" x2="{width - 10}" y2="{base}" stroke="#888"/>'
             f'<text x="0" y="34">{scale:.2f} {html.escape(unit)}</text>']
    for i, (label, value) in enumerate(columns):
        h = 130 * min(value, scale) / scale
        x = 50 + i * step
        parts.append(f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{max(1.0, step - 2):.1f}" height="{h:.1f}" '
                     f'fill="#3b7dd8"><title>{html.escape(label)}: {value:.4f} {html.escape(unit)}</title></rect>')
        if i % 7 == 0:
            parts.append(f'<text x="{x:.1f}" y="{base + 16}" font-size="11">{html.escape(label)}</text>')
    return "".join(parts) + "</svg>"
