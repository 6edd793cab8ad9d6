"""Bills: one team's GPU-hours in one month, priced per model, as CSV, JSON or a printable HTML page.

How the money adds up (and why it reconciles with the ledger):

- GPU-hours are exact (`Fraction`, from the ledger's integer sums); the hours shown are rounded to
  4 decimals for reading only, every amount is computed from the exact hours.
- Each **line** (one GPU model and profile) costs exact hours × unit price, rounded to the cent
  (ROUND_HALF_UP). The bill's **total is the sum of its lines**, so it equals what the lines say.
- The **per-user breakdown** shows each user's exact hours per model and profile; their hours add up
  exactly to the lines' hours. Each user amount is rounded on its own, so the user amounts may differ
  from the total by a few cents: they explain the bill, the lines make it.
- A bill for a period that has not ended yet is *provisional*: open intervals count up to `as_of`.
"""

from __future__ import annotations

import csv
import html
import io
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from fractions import Fraction
from typing import Any, Literal

from gpupool.hub.accounting.ledger import Ledger, UsageRow
from gpupool.policies import periods
from gpupool.policies.model import Policy

Format = Literal["csv", "json", "html"]
FORMATS: tuple[str, ...] = ("csv", "json", "html")
HOURS_PLACES = 4


@dataclass(frozen=True)
class BillLine:
    """GPU-hours of one model under one profile, its unit price, and the amount (rounded to cents)."""

    model: str
    profile: str
    gpu_hours: Fraction
    unit_price: Decimal
    amount: Decimal


@dataclass(frozen=True)
class UserLine:
    """One user's part of a line."""

    user: str
    model: str
    profile: str
    gpu_hours: Fraction
    amount: Decimal


@dataclass(frozen=True)
class Bill:
    team: str
    team_name: str
    period: str
    currency: str
    start: datetime
    end: datetime
    as_of: datetime
    lines: tuple[BillLine, ...]
    users: tuple[UserLine, ...]

    @property
    def provisional(self) -> bool:
        return self.as_of < self.end

    @property
    def gpu_hours(self) -> Fraction:
        return sum((line.gpu_hours for line in self.lines), Fraction(0))

    @property
    def total(self) -> Decimal:
        return sum((line.amount for line in self.lines), Decimal("0.00"))


# --- money ---------------------------------------------------------------------------------------------


def round_half_up(value: Fraction, places: int) -> Decimal:
    """`value` (≥ 0) rounded half up to `places` decimals, exactly (no float on the way)."""
    if value < 0:
        raise ValueError(f"cannot bill a negative quantity ({value})")
    return _half_up(value.numerator, value.denominator, places)


def _half_up(numerator: int, denominator: int, places: int) -> Decimal:
    # floor(n/d × 10^places + 1/2) in integers: a bill has thousands of lines, Fraction arithmetic is slow.
    scaled = numerator * 10**places
    return Decimal((2 * scaled + denominator) // (2 * denominator)).scaleb(-places)


def amount(hours: Fraction, price: Fraction) -> Decimal:
    """hours × price rounded half up to the cent."""
    return _half_up(hours.numerator * price.numerator, hours.denominator * price.denominator, 2)


def hours_text(hours: Fraction) -> str:
    return str(round_half_up(hours, HOURS_PLACES))


def unit_price(policy: Policy, model: str) -> Decimal:
    """The price of one GPU-hour of `model`. A policy without any price bills GPU-hours at 0."""
    prices = policy.billing.prices
    if not prices:
        return Decimal("0.00")
    if model not in prices:
        raise ValueError(
            f"no price for {model} in billing.prices (priced: {', '.join(sorted(prices))}); "
            "add one to the policy (0 for free use)"
        )
    return prices[model]


# --- making bills (pure) -----------------------------------------------------------------------------------


def make_bill(policy: Policy, team: str, period: str, rows: Iterable[UsageRow], as_of: datetime) -> Bill:
    """The bill of `team` for `period` from the ledger's usage rows (rows of other teams are ignored)."""
    start, end = periods.period_bounds(period)
    as_of = min(periods.ensure_utc(as_of, "as_of"), end)
    lines: dict[tuple[str, str], Fraction] = {}
    prices: dict[str, Fraction] = {}
    users = []
    for row in rows:
        if row.team != team:
            continue
        if row.model not in prices:
            prices[row.model] = Fraction(unit_price(policy, row.model))
        lines[row.model, row.profile] = lines.get((row.model, row.profile), Fraction(0)) + row.gpu_hours
        user_amount = amount(row.gpu_hours, prices[row.model])
        users.append(UserLine(row.user, row.model, row.profile, row.gpu_hours, user_amount))
    bill_lines = tuple(
        BillLine(model, profile, hours, unit_price(policy, model), amount(hours, prices[model]))
        for (model, profile), hours in sorted(lines.items())
    )
    users.sort(key=lambda u: (u.user, u.model, u.profile))
    known = policy.teams.get(team)
    name = known.display_name if known is not None and known.display_name else team
    return Bill(team, name, period, policy.billing.currency, start, end, as_of, bill_lines, tuple(users))


def bill_for(ledger: Ledger, policy: Policy, team: str, period: str, now: datetime | None = None) -> Bill:
    """`team`'s bill for `period` from `ledger`; provisional while the period runs."""
    as_of = now or periods.utcnow()
    return make_bill(policy, team, period, ledger.usage_rows(period, team=team, now=as_of), as_of)


def bills_for_period(ledger: Ledger, policy: Policy, period: str, now: datetime | None = None) -> dict[str, Bill]:
    """Every team's bill for `period`, from one aggregate query: the policy's teams and any team in the ledger."""
    as_of = now or periods.utcnow()
    rows = ledger.usage_rows(period, now=as_of)
    by_team: dict[str, list[UsageRow]] = {team: [] for team in policy.teams}
    for row in rows:
        by_team.setdefault(row.team, []).append(row)
    return {team: make_bill(policy, team, period, team_rows, as_of) for team, team_rows in sorted(by_team.items())}


# --- rendering -------------------------------------------------------------------------------------------------


def bill_dict(bill: Bill) -> dict[str, Any]:
    """The bill as JSON-able data: decimals as strings, exact GPU-hours as a fraction string too."""
    return {
        "team": bill.team,
        "team_name": bill.team_name,
        "period": bill.period,
        "start": bill.start.isoformat(),
        "end": bill.end.isoformat(),
        "as_of": bill.as_of.isoformat(),
        "provisional": bill.provisional,
        "currency": bill.currency,
        "lines": [
            {"model": line.model, "profile": line.profile, "gpu_hours": hours_text(line.gpu_hours),
             "gpu_hours_exact": str(line.gpu_hours), "unit_price": str(line.unit_price),
             "amount": str(line.amount)}
            for line in bill.lines
        ],
        "users": [
            {"user": u.user, "model": u.model, "profile": u.profile, "gpu_hours": hours_text(u.gpu_hours),
             "gpu_hours_exact": str(u.gpu_hours), "amount": str(u.amount)}
            for u in bill.users
        ],
        "gpu_hours": hours_text(bill.gpu_hours),
        "gpu_hours_exact": str(bill.gpu_hours),
        "total": str(bill.total),
    }


def _cell(value: str) -> str:
    # Spreadsheets run cells that start like a formula; user names come from users.
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def render_csv(bill: Bill) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["section", "team", "period", "user", "model", "profile", "gpu_hours", "unit_price",
                     "amount", "currency"])
    team, period, currency = _cell(bill.team), bill.period, _cell(bill.currency)
    for line in bill.lines:
        writer.writerow(["line", team, period, "", _cell(line.model), _cell(line.profile),
                         hours_text(line.gpu_hours), line.unit_price, line.amount, currency])
    for u in bill.users:
        writer.writerow(["user", team, period, _cell(u.user), _cell(u.model), _cell(u.profile),
                         hours_text(u.gpu_hours), "", u.amount, currency])
    writer.writerow(["total", team, period, "", "", "", hours_text(bill.gpu_hours), "", bill.total, currency])
    return out.getvalue()


def render_json(bill: Bill) -> str:
    return json.dumps(bill_dict(bill), indent=2) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 60rem; color: #111; }
h1 { font-size: 1.5rem; margin-bottom: 0.25rem; }
.meta { color: #444; margin-top: 0; }
.provisional { color: #8a4b00; font-weight: 600; }
table { border-collapse: collapse; width: 100%; margin: 1rem 0 2rem; }
th, td { border-bottom: 1px solid #ccc; padding: 0.35rem 0.5rem; text-align: left; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
tfoot td { font-weight: 700; border-top: 2px solid #111; }
@page { size: A4; margin: 18mm; }
@media print {
  body { margin: 0; max-width: none; font-size: 10pt; }
  table { page-break-inside: auto; }
  tr { page-break-inside: avoid; }
  thead { display: table-header-group; }
  .download { display: none; }
}
"""


def render_html(bill: Bill, csv_href: str | None = None) -> str:
    """A self-contained printable page; every string from the policy or the ledger is escaped. `csv_href`: where
    the same bill is as CSV (the accounting service's page links it; a page printed by the CLI has no such place)."""
    e = html.escape
    download = (f'<p class="download"><a href="{e(csv_href)}" download="{e(csv_filename(bill.team, bill.period))}">'
                f"Download as CSV</a> (for a spreadsheet)</p>\n" if csv_href else "")
    money = f" ({e(bill.currency)})"
    status = (f'<p class="provisional">Provisional: the period runs until {e(_when(bill.end))}; '
              f"usage counted up to {e(_when(bill.as_of))}.</p>" if bill.provisional else "")
    line_rows = "".join(
        f"<tr><td>{e(line.model)}</td><td>{e(line.profile)}</td><td class=n>{hours_text(line.gpu_hours)}</td>"
        f"<td class=n>{line.unit_price}</td><td class=n>{line.amount}</td></tr>"
        for line in bill.lines
    ) or '<tr><td colspan="5">No GPU use in this period.</td></tr>'
    user_rows = "".join(
        f"<tr><td>{e(u.user)}</td><td>{e(u.model)}</td><td>{e(u.profile)}</td>"
        f"<td class=n>{hours_text(u.gpu_hours)}</td><td class=n>{u.amount}</td></tr>"
        for u in bill.users
    ) or '<tr><td colspan="5">No GPU use in this period.</td></tr>'
    title = f"GPU bill {bill.period}: {bill.team_name}"
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{e(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>{e(title)}</h1>
<p class="meta">Team <code>{e(bill.team)}</code> · {e(_when(bill.start))} to {e(_when(bill.end))} ·
prices per GPU-hour in {e(bill.currency)}</p>
{download}{status}
<h2>Lines</h2>
<table>
<thead><tr><th>GPU model</th><th>Profile</th><th class=n>GPU-hours</th><th class=n>Unit price{money}</th>
<th class=n>Amount{money}</th></tr></thead>
<tbody>{line_rows}</tbody>
<tfoot><tr><td colspan="2">Total</td><td class=n>{hours_text(bill.gpu_hours)}</td><td></td>
<td class=n>{bill.total}</td></tr></tfoot>
</table>
<h2>By user</h2>
<table>
<thead><tr><th>User</th><th>GPU model</th><th>Profile</th><th class=n>GPU-hours</th>
<th class=n>Amount{money}</th></tr></thead>
<tbody>{user_rows}</tbody>
</table>
<p class="meta">Amounts are exact GPU-hours × unit price, rounded to the cent per line; the total is the sum
of the lines. Per-user amounts are rounded on their own.</p>
</body>
</html>
"""


def _when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def csv_filename(team: str, period: str) -> str:
    """The name a bill's CSV is saved under: `gpupool-bill-TEAM-YYYY-MM.csv`. Team names are DNS labels (the
    policies' rule), safe in a file name and a header; anything else would be replaced."""
    return "gpupool-bill-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{team}-{period}") + ".csv"


def render_bill(bill: Bill, fmt: str) -> str:
    """`bill` as ``csv``, ``json`` or ``html``."""
    renderers = {"csv": render_csv, "json": render_json, "html": render_html}
    if fmt not in renderers:
        raise ValueError(f"unknown bill format {fmt!r} (accepted: {', '.join(FORMATS)})")
    return renderers[fmt](bill)


def bill_command(ledger_url: str, policy: Policy, team: str, period: str, fmt: str,
                 now: datetime | None = None) -> str:
    """What ``gpupool bill --team TEAM --period YYYY-MM --format csv|html|json`` prints.

    ValueError (with the accepted values) for an unknown team, period or format, or a missing ledger.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown bill format {fmt!r} (accepted: {', '.join(FORMATS)})")
    periods.parse_period(period)
    if team not in policy.teams:
        raise ValueError(f"unknown team {team!r} (known: {', '.join(sorted(policy.teams)) or 'none'})")
    ledger = Ledger(ledger_url, migrate=False)
    try:
        return render_bill(bill_for(ledger, policy, team, period, now), fmt)
    finally:
        ledger.dispose()
