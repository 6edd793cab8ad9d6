"""Reports for the usage, team and admin pages: my usage and its cost, utilisation per model per day, queue
waits, top consumers.

Data comes from the ledger (JSON-able dicts, exact numbers as text); the charts of these figures are drawn
by `charts.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from decimal import Decimal
from fractions import Fraction

from gpupool.hub.accounting.bills import amount, unit_price
from gpupool.hub.accounting.culls import IdleServer, IdleStore
from gpupool.hub.accounting.ledger import Ledger, run_key, run_server
from gpupool.policies import periods
from gpupool.policies.admission import format_hours, format_share
from gpupool.policies.model import Policy
from gpupool.policies.resources import profile_share

#: The most consumers a report lists.
MAX_TOP = 100


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
    """Per team: how many runs of `period` waited (a second or more), their mean and longest wait in seconds.

    Runs placed at once are not counted: "1 run waited, 63 s" is what a queue of one 63 s wait and three
    immediate placements looks like, not "4 runs waited, 15.8 s on average".
    """
    return {name: {"runs": waits.count, "mean_seconds": f"{float(waits.mean_s):.1f}",
                   "longest_seconds": waits.longest_s}
            for name, waits in sorted(ledger.queue_waits(period, team=team).items())}


def top_consumers(ledger: Ledger, period: str, limit: int, team: str | None = None) -> list[dict[str, str]]:
    """The users with the most GPU-hours in `period` (of one team, or of all), most first."""
    sums = ledger.gpu_hours(period, ("team", "user"), team=team)
    ranked = sorted(sums.items(), key=lambda item: (-item[1], item[0]))[:limit]
    return [{"team": t, "user": u, "gpu_hours": format_hours(hours)} for (t, u), hours in ranked]


def money(value: Decimal | str, currency: str) -> str:
    """An amount for people: `1,234.50 EUR`."""
    return f"{Decimal(value):,.2f} {currency}"


def server_label(server: str | None) -> str:
    """A server's name for people: the default server (name "") is `default`; None: not known (hashed run key)."""
    if server is None:
        return "—"
    return server or "default"


def run_label(entry: Mapping[str, str | None]) -> str:
    """What a running entry of `running_servers` is, for people: `job ID` for a training job, else the server."""
    if entry.get("kind") == "job":
        return "job " + str(entry["key"]).removeprefix("job:").partition("@")[0]
    return server_label(entry["server"])


def running_servers(ledger: Ledger, policy: Policy, user: str, now: datetime | None = None) -> list[dict[str, str]]:
    """`user`'s running servers: which server, share, since when, GPU-hours and cost so far, over the whole run.

    A run continued after a crash is several intervals; the user sees one server since its start. The server
    is the one its run key names (`""` for the default server, None when the key is hashed: names too long).
    """
    now = now or periods.utcnow()
    running = []
    for interval in ledger.open_intervals():
        if interval.user != user or interval.is_reserved:  # admitted, not running yet: nothing to show or bill
            continue
        pieces = [p for p in (ledger.run_intervals(interval.run) if interval.run else [interval]) if not p.is_reserved]
        seconds = sum(int(((p.end or max(now, p.start)) - p.start).total_seconds()) for p in pieces)
        hours = periods.gpu_hours(interval.share, seconds)
        price = Fraction(unit_price(policy, interval.model)) if interval.model in policy.billing.prices else Fraction(0)
        running.append({
            "key": interval.run or interval.key, "kind": interval.kind,
            "server": run_server(interval.run) if interval.run else None,
            "team": interval.team, "profile": interval.profile,
            "model": interval.model, "share": str(interval.share), "since": pieces[0].start.isoformat(),
            "gpu_hours": format_hours(hours), "cost": str(amount(hours, price)),
        })
    return running


def job_usage(ledger: Ledger, policy: Policy, holdings: Iterable[str], now: datetime | None = None
              ) -> tuple[Fraction, Decimal]:
    """GPU-hours and cost so far of a training job whose runs held `holdings` (their ledger run keys)."""
    now = now or periods.utcnow()
    hours, cost = Fraction(0), Decimal(0)
    for holding in holdings:
        for piece in ledger.run_intervals(holding):
            if piece.is_reserved:
                continue
            seconds = int(((piece.end or max(now, piece.start)) - piece.start).total_seconds())
            piece_hours = periods.gpu_hours(piece.share, seconds)
            price = Fraction(unit_price(policy, piece.model)) if piece.model in policy.billing.prices else Fraction(0)
            hours += piece_hours
            cost += amount(piece_hours, price)
    return hours, cost


def home_servers(ledger: Ledger, policy: Policy, user: str, servers: Iterable[tuple[str, datetime | None, Mapping]],
                 now: datetime | None = None) -> list[dict[str, str]]:
    """The hub home page's table: each of `user`'s active `servers` (name, the hub's `started`, its checked
    `user_options`) with its profile, team, GPU share and, from the ledger, its GPU-hours and cost so far, and how
    idle the idle culler saw it last (`idle`: "idle for 12 min", "in use", or "" before its first look).

    A server is found in the ledger by its run key, as the spawner wrote it; CPU-only servers cost nothing.
    """
    servers = list(servers)
    running = {entry["key"]: entry for entry in running_servers(ledger, policy, user, now)}
    seen = IdleStore(ledger.engine).runs([run_key(user, name, started) for name, started, _ in servers
                                          if started is not None])
    currency = policy.billing.currency
    rows = []
    for name, started, options in servers:
        slug = options.get("profile") if isinstance(options, Mapping) else None
        profile = policy.profiles.get(slug) if isinstance(slug, str) else None
        share = profile_share(profile, policy) if profile is not None else 0
        entry = running.get(run_key(user, name, started)) if started is not None else None
        rows.append({
            "server": server_label(name), "name": name,
            "profile": profile.display_name if profile is not None else str(slug or "—"),
            "team": str(options.get("team") or "") if isinstance(options, Mapping) else "",
            "gpu": f"{format_share(Fraction(share))} × {profile.gpu.model}" if share and profile.gpu else "no GPU",
            "gpu_hours": entry["gpu_hours"] if entry else "0",
            "cost": money(entry["cost"] if entry else 0, currency),
            "idle": idle_words(seen.get(run_key(user, name, started)) if started is not None else None),
        })
    return rows


def idle_words(server: IdleServer | None) -> str:
    """How idle the culler saw a server at its last look, for people."""
    if server is None:
        return ""
    minutes = int(server.seen.get("idle_minutes") or 0)
    if server.seen.get("action") == "active":
        return "in use"
    if minutes < 1:
        return "idle for less than a minute"
    return f"idle for {minutes} min" if minutes < 120 else f"idle for {minutes // 60} h {minutes % 60} min"


def user_usage(ledger: Ledger, policy: Policy, user: str, period: str) -> dict[str, dict[str, Fraction | Decimal]]:
    """`user`'s GPU-hours and their cost in `period`, per team (finished and running intervals so far).

    Costs are rounded per model and profile as the team's bill rounds the user's lines, so that the page
    and the bill agree to the cent.
    """
    result: dict[str, dict[str, Fraction | Decimal]] = {}
    sums = ledger.gpu_hours(period, ("user", "team", "model", "profile"))
    for (_user, team, model, profile), hours in sorted(item for item in sums.items() if item[0][0] == user):
        price = Fraction(unit_price(policy, model)) if model in policy.billing.prices else Fraction(0)
        entry = result.setdefault(team, {"gpu_hours": Fraction(0), "cost": Decimal("0.00")})
        entry["gpu_hours"] += hours
        entry["cost"] += amount(hours, price)
    return result


def team_daily(ledger: Ledger, team: str, period: str, now: datetime | None = None) -> list[dict[str, str]]:
    """One team's GPU-hours per day of `period` so far."""
    now = now or periods.utcnow()
    return [{"day": start.date().isoformat(),
             "gpu_hours": format_hours(ledger.gpu_hours_between(start, end, (), team=team, now=now)[()])}
            for start, end in days_of(period, now)]
