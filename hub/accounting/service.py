"""`gpupool-accounting`: the hub-managed service that shows usage, budgets and bills, and exports metrics.

Runs under JupyterHub at `/services/accounting/` (`python -m gpupool.hub.accounting.service`), authenticated
through the hub: browsers by HubOAuth, API clients by their JupyterHub token. Who sees what:
a member sees their own usage and their team's totals, a team lead their team's users too, an admin
everything. Another team's data answers 404, so that its existence does not leak either.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from tornado import ioloop, web

from gpupool.hub.accounting import periods
from gpupool.hub.accounting.admission import format_hours, reached_alerts
from gpupool.hub.accounting.bills import FORMATS, bill_for, render_bill, unit_price
from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.accounting.servers import HubClient, reconcile_with_hub
from gpupool.policies import DEFAULT_POLICY_DIR
from gpupool.spawner.mixin import current_policy

log = logging.getLogger("gpupool.accounting")

#: Requests may not carry bodies larger than this (the API only reads).
MAX_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class Viewer:
    name: str
    admin: bool
    teams: frozenset[str]  # member of
    leads: frozenset[str]  # lead of

    def may_see_team(self, team: str) -> bool:
        return self.admin or team in self.teams or team in self.leads

    def may_see_members(self, team: str) -> bool:
        return self.admin or team in self.leads


class AccountingHandler(HubOAuthenticated, web.RequestHandler):
    """Base: authentication, body limit, JSON errors that never leak a traceback."""

    @property
    def ledger(self) -> Ledger:
        return self.settings["ledger"]

    @property
    def policy(self):
        return current_policy(self.settings["policy_dir"], log)

    def prepare(self):
        length = self.request.headers.get("Content-Length")
        if (length and length.isdigit() and int(length) > MAX_BODY_BYTES) or len(self.request.body) > MAX_BODY_BYTES:
            raise web.HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes")

    def write_error(self, status_code: int, **kwargs):
        error = kwargs.get("exc_info", (None, None))[1]
        message = error.log_message if isinstance(error, web.HTTPError) and error.log_message else self._reason
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"status": status_code, "message": message}))

    def viewer(self) -> Viewer:
        user = self.current_user
        policy = self.policy
        groups = set(user.get("groups") or []) | set(policy.teams_of(user["name"]))
        teams = frozenset(g for g in groups if g in policy.teams)
        leads = frozenset(t for t, team in policy.teams.items() if user["name"] in team.leads)
        return Viewer(user["name"], bool(user.get("admin")), teams, leads)

    def period_argument(self) -> str:
        period = self.get_argument("period", periods.period_of(periods.utcnow()))
        try:
            periods.parse_period(period)
        except ValueError as error:
            raise web.HTTPError(400, str(error)) from None
        return period

    def team_or_404(self, team: str) -> str:
        if team not in self.policy.teams or not self.viewer().may_see_team(team):
            raise web.HTTPError(404, f"no team {team!r} that you may see")
        return team

    def write_json(self, data) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data, default=str))


def _hours(value: Fraction) -> str:
    return format_hours(value)


def team_summary(ledger: Ledger, policy, team: str, period: str, members: bool) -> dict:
    budget = policy.teams[team].budget
    used = ledger.gpu_hours(period, ("team",), team=team).get((team,), Fraction(0))
    summary = {
        "team": team,
        "period": period,
        "gpu_hours": _hours(used),
        "budget_gpu_hours": str(budget.gpu_hours) if budget.gpu_hours is not None else None,
        "budget_used": (f"{float(used / Fraction(budget.gpu_hours)):.4f}" if budget.gpu_hours else None),
        "on_exhausted": budget.on_exhausted,
        "resets": periods.period_reset(period),
    }
    if members:
        per_user = ledger.gpu_hours(period, ("user",), team=team)
        summary["users"] = {user: _hours(hours) for (user,), hours in sorted(per_user.items())}
    return summary


class MeHandler(AccountingHandler):
    @web.authenticated
    def get(self):
        viewer = self.viewer()
        policy, now = self.policy, periods.utcnow()
        period = self.period_argument()
        running = []
        for interval in self.ledger.open_intervals():
            if interval.user != viewer.name:
                continue
            hours = Fraction(interval.share) * Fraction(int((now - interval.start).total_seconds()), 3600)
            price = unit_price(policy, interval.model) if interval.model in policy.billing.prices else Decimal(0)
            running.append({
                "key": interval.key, "team": interval.team, "profile": interval.profile, "model": interval.model,
                "share": str(interval.share), "since": interval.start.isoformat(), "gpu_hours": _hours(hours),
                "cost": str((Decimal(hours.numerator) / Decimal(hours.denominator) * price).quantize(Decimal("0.01"))),
            })
        mine = self.ledger.gpu_hours(period, ("user",)).get((viewer.name,), Fraction(0))
        self.write_json({
            "user": viewer.name, "admin": viewer.admin, "period": period, "gpu_hours": _hours(mine),
            "currency": policy.billing.currency, "running": running,
            "teams": [team_summary(self.ledger, policy, t, period, viewer.may_see_members(t))
                      for t in sorted(viewer.teams | viewer.leads)],
        })


class TeamHandler(AccountingHandler):
    @web.authenticated
    def get(self, team: str):
        team = self.team_or_404(team)
        self.write_json(team_summary(self.ledger, self.policy, team, self.period_argument(),
                                     self.viewer().may_see_members(team)))


class BillHandler(AccountingHandler):
    @web.authenticated
    def get(self, team: str):
        team = self.team_or_404(team)
        if not self.viewer().may_see_members(team):
            raise web.HTTPError(404, f"no bill of team {team!r} that you may see (team leads and admins)")
        fmt = self.get_argument("format", "json")
        if fmt not in FORMATS:
            raise web.HTTPError(400, f"unknown format {fmt!r} (accepted: {', '.join(FORMATS)})")
        bill = bill_for(self.ledger, self.policy, team, self.period_argument())
        self.set_header("Content-Type", {"json": "application/json", "csv": "text/csv",
                                         "html": "text/html"}[fmt] + "; charset=utf-8")
        self.finish(render_bill(bill, fmt))


class TeamsHandler(AccountingHandler):
    """Admins: every team's totals and the pool's utilisation per model."""

    @web.authenticated
    def get(self):
        viewer = self.viewer()
        if not viewer.admin:
            raise web.HTTPError(403, "admins only")
        policy, period = self.policy, self.period_argument()
        self.write_json({
            "period": period,
            "teams": [team_summary(self.ledger, policy, t, period, True) for t in policy.teams],
            "utilisation": utilisation(self.ledger, policy, period),
        })


def utilisation(ledger: Ledger, policy, period: str) -> dict[str, dict[str, str]]:
    """Allocated GPU-hours / capacity GPU-hours per model, for the part of `period` that has passed."""
    start, end = periods.period_bounds(period)
    elapsed = max(timedelta(0), min(end, periods.utcnow()) - start)
    hours_elapsed = Fraction(int(elapsed.total_seconds()), 3600)
    allocated = ledger.gpu_hours(period, ("model",))
    result = {}
    for model in policy.models:
        cards = sum(d.count for d in policy.inventory if d.model == model)
        capacity = cards * hours_elapsed
        used = allocated.get((model,), Fraction(0))
        result[model] = {"allocated_gpu_hours": _hours(used), "capacity_gpu_hours": _hours(capacity),
                         "utilisation": f"{float(used / capacity):.4f}" if capacity else "0"}
    return result


class MetricsHandler(AccountingHandler):
    """Prometheus metrics (admins' tokens, or the hub's Prometheus scraping with an admin token)."""

    @web.authenticated
    def get(self):
        if not self.viewer().admin:
            raise web.HTTPError(403, "admins only")
        registry = CollectorRegistry()
        registry.register(_Collector(self.ledger, self.policy))
        self.set_header("Content-Type", "text/plain; version=0.0.4")
        self.finish(generate_latest(registry))


class _Collector:
    def __init__(self, ledger: Ledger, policy):
        self.ledger, self.policy = ledger, policy

    def collect(self):
        allocated = GaugeMetricFamily("gpupool_allocated_shares", "GPU shares held now, in cards",
                                      labels=["team", "model"])
        for (team, model), share in sorted(self.ledger.holdings().team_model.items()):
            allocated.add_metric([team, model], float(share))
        yield allocated
        budget = GaugeMetricFamily("gpupool_budget_used_ratio", "GPU-hours used / period budget",
                                   labels=["team"])
        period = periods.period_of(periods.utcnow())
        used = self.ledger.gpu_hours(period, ("team",))
        for name, team in self.policy.teams.items():
            if team.budget.gpu_hours:
                budget.add_metric([name], float(used.get((name,), Fraction(0)) / Fraction(team.budget.gpu_hours)))
        yield budget


def bar_chart(title: str, bars: list[tuple[str, float]], unit: str, limit: float | None = None) -> str:
    """A small self-contained SVG bar chart (no JavaScript), every label escaped."""
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


class PageHandler(AccountingHandler):
    """The hub page: my running servers and their cost, my teams' budgets (charts), members for leads."""

    @web.authenticated
    def get(self):
        viewer, policy = self.viewer(), self.policy
        period = self.period_argument()
        sections = []
        usage = self.ledger.usage(period)
        for team in sorted(viewer.teams | viewer.leads):
            for alert in reached_alerts(policy, team, usage):
                sections.append(f'<p class="alert" role="alert">⚠ {html.escape(alert.message)}</p>')
            summary = team_summary(self.ledger, policy, team, period, viewer.may_see_members(team))
            budget = float(summary["budget_gpu_hours"]) if summary["budget_gpu_hours"] else None
            bars = [(team, float(Fraction(summary["gpu_hours"])))]
            sections.append(bar_chart(f"Team {team}: GPU-hours in {period}", bars, "GPU-h", budget))
            if "users" in summary:
                users = [(u, float(Fraction(h))) for u, h in summary["users"].items()]
                sections.append(bar_chart(f"Members of {team}", users, "GPU-h"))
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(
            "<!doctype html><html><head><meta charset='utf-8'><title>gpupool usage</title></head><body>"
            f"<h1>GPU usage of {html.escape(viewer.name)}, {html.escape(period)}</h1>"
            + "".join(f"<section>{s}</section>" for s in sections)
            + "<p><a href='api/me'>as JSON</a></p></body></html>"
        )


OPENAPI = {
    "openapi": "3.1.0",
    "info": {"title": "gpupool-accounting", "version": "1"},
    "components": {"securitySchemes": {"jupyterhub": {"type": "apiKey", "in": "header", "name": "Authorization",
                                                       "description": "token <JupyterHub API token>"}}},
    "security": [{"jupyterhub": []}],
    "paths": {
        "/api/me": {"get": {"summary": "My usage this period, my running servers with cost so far, my teams' budgets",
                            "parameters": [{"name": "period", "in": "query", "schema": {"type": "string",
                                                                                         "pattern": "^\\d{4}-\\d{2}$"}}]}},
        "/api/teams": {"get": {"summary": "Admins: every team's totals and utilisation per model"}},
        "/api/teams/{team}": {"get": {"summary": "A team's totals (with per-user GPU-hours for leads and admins)"}},
        "/api/teams/{team}/bill": {"get": {"summary": "A team's bill (leads and admins)", "parameters": [
            {"name": "format", "in": "query", "schema": {"enum": list(FORMATS)}}]}},
        "/metrics": {"get": {"summary": "Prometheus metrics (admins)"}},
    },
}


class OpenAPIHandler(web.RequestHandler):
    def get(self):
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(OPENAPI))


def make_app(ledger: Ledger, policy_dir: str, prefix: str) -> web.Application:
    return web.Application(
        [
            (prefix, PageHandler),
            (prefix + "api/me", MeHandler),
            (prefix + "api/teams", TeamsHandler),
            (prefix + r"api/teams/([^/]+)", TeamHandler),
            (prefix + r"api/teams/([^/]+)/bill", BillHandler),
            (prefix + "metrics", MetricsHandler),
            (prefix + "openapi.json", OpenAPIHandler),
            (prefix + "oauth_callback", HubOAuthCallbackHandler),
        ],
        ledger=ledger, policy_dir=policy_dir, cookie_secret=os.urandom(32),
        max_body_size=MAX_BODY_BYTES,
    )


#: Reconciliation rounds that failed, by step (`hub`: the hub did not answer or the ledger refused a write).
RECONCILE_ERRORS: dict[str, int] = {"hub": 0, "stale": 0}


def reconcile_once(ledger: Ledger, policy_of, hub: HubClient | None, stale: timedelta) -> None:
    """One round: make the ledger agree with what the hub runs, then close what nobody has seen for `stale`.

    When the hub does not answer, only the second step runs; a server that ran on meanwhile is continued
    from where its interval was closed as soon as the hub or its spawner reports it again.
    """
    if hub is not None:
        try:
            done = reconcile_with_hub(ledger, policy_of(), hub)
            for what in ("opened", "continued", "closed"):
                runs = getattr(done, what)
                if runs:
                    log.warning("reconciliation with the hub %s %d run(s): %s", what, len(runs), ", ".join(runs))
            for run, why in done.unknown.items():
                log.error("cannot account for %s: %s", run, why)
        except Exception:  # keep serving; the next round tries again
            RECONCILE_ERRORS["hub"] += 1
            log.exception("reconciliation with the hub failed")
    try:
        closed = ledger.reconcile(stale)
        if closed:
            log.warning("closed %d interval(s) not seen for %s at their last heartbeat: %s", len(closed),
                        stale, ", ".join(closed))
    except Exception:
        RECONCILE_ERRORS["stale"] += 1
        log.exception("reconciliation of stale intervals failed")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s %(asctime)s accounting] %(message)s")
    state = Path(os.environ.get("GPUPOOL_STATE_DIR", "state"))
    ledger = Ledger(os.environ.get("GPUPOOL_LEDGER_URL", f"sqlite:///{state / 'ledger.sqlite'}"))
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/accounting/")
    app = make_app(ledger, os.environ.get("GPUPOOL_POLICIES", str(DEFAULT_POLICY_DIR)), prefix)
    url = os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:8003")
    # Listen where the hub says the service is: 127.0.0.1 on one machine, 0.0.0.0 in a pod.
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80

    stale = timedelta(seconds=int(os.environ.get("GPUPOOL_RECONCILE_STALE_SECONDS", "300")))
    every = float(os.environ.get("GPUPOOL_RECONCILE_SECONDS", "60"))
    api_url, token = os.environ.get("JUPYTERHUB_API_URL"), os.environ.get("JUPYTERHUB_API_TOKEN")
    hub = HubClient(api_url, token) if api_url and token else None
    policy_dir = app.settings["policy_dir"]

    async def reconcile():
        await asyncio.to_thread(reconcile_once, ledger, lambda: current_policy(policy_dir, log), hub, stale)

    ioloop.IOLoop.current().add_callback(reconcile)  # at once: the hub may have run servers while we were down
    ioloop.PeriodicCallback(reconcile, every * 1000).start()
    app.listen(port, host)
    log.info("gpupool-accounting at %s%s", url, prefix)
    ioloop.IOLoop.current().start()


if __name__ == "__main__":
    main()
