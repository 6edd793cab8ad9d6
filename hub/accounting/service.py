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
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path
from urllib.parse import urlparse

import psutil
import requests
from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from tornado import ioloop, web

from gpupool.hub import __version__
from gpupool.hub.accounting import periods
from gpupool.hub.accounting.admission import format_hours, reached_alerts
from gpupool.hub.accounting.bills import FORMATS, bill_for, render_bill
from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.accounting.reports import (
    MAX_TOP, bar_chart, capacity_of, column_chart, daily_utilisation, queue_waits, running_servers, team_daily,
    top_consumers,
)
from gpupool.hub.accounting.servers import HubClient, reconcile_with_hub
from gpupool.hub.datasets import DatasetError, human_size, team_datasets, team_registry
from gpupool.policies import DEFAULT_POLICY_DIR
from gpupool.spawner.mixin import current_policy

log = logging.getLogger("gpupool.accounting")

#: Requests may not carry bodies larger than this (the API only reads).
MAX_BODY_BYTES = 64 * 1024
#: When this process started: the health answer tells a service that a restarted hub started from a stale one.
STARTED = datetime.fromtimestamp(psutil.Process().create_time(), UTC).isoformat()


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

    def top_argument(self) -> int:
        text = self.get_argument("top", "10")
        if not text.isdigit() or not 1 <= int(text) <= MAX_TOP:
            raise web.HTTPError(400, f"top must be a whole number from 1 to {MAX_TOP}, not {text[:20]!r}")
        return int(text)

    def admin_or_403(self) -> Viewer:
        viewer = self.viewer()
        if not viewer.admin:
            raise web.HTTPError(403, "admins only")
        return viewer

    def lead_team_or_404(self, team: str) -> str:
        """`team` when the viewer leads it (or is an admin); 404 otherwise, whether or not it exists."""
        if team not in self.policy.teams or not self.viewer().may_see_members(team):
            raise web.HTTPError(404, f"no team {team!r} that you lead")
        return team

    def write_page(self, title: str, body: str) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(
            f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}section{margin:1.5em 0}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}</style>"
            f"</head><body><h1>{html.escape(title)}</h1>{body}</body></html>"
        )

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
        running = running_servers(self.ledger, policy, viewer.name, now)
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
        self.admin_or_403()
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


def admin_report(ledger: Ledger, policy, period: str, top: int) -> dict:
    """Everything the admin page shows, as JSON."""
    capacity = capacity_of(policy)
    return {
        "period": period,
        "capacity_cards": capacity,
        "utilisation": utilisation(ledger, policy, period),
        "utilisation_daily": daily_utilisation(ledger, policy, capacity, period),
        "queue_waits": queue_waits(ledger, period),
        "top_consumers": top_consumers(ledger, period, top),
        "teams": [team_summary(ledger, policy, t, period, False) for t in policy.teams],
    }


def team_report(ledger: Ledger, policy, team: str, period: str, top: int) -> dict:
    """Everything a team lead's page shows, as JSON."""
    return {
        **team_summary(ledger, policy, team, period, True),
        "daily": team_daily(ledger, team, period),
        "queue_waits": queue_waits(ledger, period, team=team).get(team),
        "top_consumers": top_consumers(ledger, period, top, team=team),
    }


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


class AdminReportHandler(AccountingHandler):
    @web.authenticated
    def get(self):
        self.admin_or_403()
        self.write_json(admin_report(self.ledger, self.policy, self.period_argument(), self.top_argument()))


class AdminPageHandler(AccountingHandler):
    """Admins: every team, utilisation per model per day, queue waits, top consumers."""

    @web.authenticated
    def get(self):
        self.admin_or_403()
        period = self.period_argument()
        report = admin_report(self.ledger, self.policy, period, self.top_argument())
        sections = []
        for model, days in report["utilisation_daily"].items():
            sections.append(column_chart(
                f"{model} utilisation per day ({report['capacity_cards'][model]} cards)",
                [(d["day"], float(d["utilisation"])) for d in days], "of capacity", top=1.0))
        sections.append(bar_chart(f"Teams: GPU-hours in {period}",
                                  [(t["team"], float(Fraction(t["gpu_hours"]))) for t in report["teams"]], "GPU-h"))
        sections.append(bar_chart("Top consumers", [(f'{c["user"]} ({c["team"]})', float(Fraction(c["gpu_hours"])))
                                                    for c in report["top_consumers"]], "GPU-h"))
        waits = report["queue_waits"]
        sections.append(bar_chart("Mean queue wait per team", [(t, float(w["mean_seconds"])) for t, w in waits.items()],
                                  "s"))
        sections.append(_table(["team", "runs that queued", "mean wait (s)", "longest wait (s)"],
                               [[t, w["runs"], w["mean_seconds"], w["longest_seconds"]] for t, w in waits.items()]))
        sections.append(_table(["team", "GPU-hours", "budget", "used"],
                               [[t["team"], t["gpu_hours"], t["budget_gpu_hours"] or "none", t["budget_used"] or "-"]
                                for t in report["teams"]]))
        links = " · ".join(f"<a href='teams/{html.escape(t)}?period={period}'>{html.escape(t)}</a>"
                           for t in self.policy.teams)
        self.write_page(f"gpupool: all teams, {period}",
                        "".join(f"<section>{s}</section>" for s in sections)
                        + f"<p>Teams: {links}</p><p><a href='api/admin/report?period={period}'>as JSON</a></p>")


class TeamReportHandler(AccountingHandler):
    @web.authenticated
    def get(self, team: str):
        team = self.lead_team_or_404(team)
        self.write_json(team_report(self.ledger, self.policy, team, self.period_argument(), self.top_argument()))


class TeamPageHandler(AccountingHandler):
    """Team leads (and admins): the team's users, its GPU-hours per day, its queue waits."""

    @web.authenticated
    def get(self, team: str):
        team = self.lead_team_or_404(team)
        period = self.period_argument()
        report = team_report(self.ledger, self.policy, team, period, self.top_argument())
        budget = float(report["budget_gpu_hours"]) if report["budget_gpu_hours"] else None
        sections = [
            bar_chart(f"Team {team}: GPU-hours in {period}", [(team, float(Fraction(report["gpu_hours"])))],
                      "GPU-h", budget),
            column_chart(f"Team {team}: GPU-hours per day", [(d["day"], float(Fraction(d["gpu_hours"])))
                                                             for d in report["daily"]], "GPU-h"),
            bar_chart(f"Members of {team}", [(u, float(Fraction(h))) for u, h in report["users"].items()], "GPU-h"),
        ]
        waits = report["queue_waits"]
        sections.append("<p>Queue: " + (f"{waits['runs']} run(s) waited, {waits['mean_seconds']} s on average, "
                                        f"{waits['longest_seconds']} s at most" if waits else "no run waited")
                        + "</p>")
        self.write_page(f"gpupool: team {team}, {period}",
                        "".join(f"<section>{s}</section>" for s in sections)
                        + f"<p><a href='../api/teams/{html.escape(team)}/report?period={period}'>as JSON</a> · "
                          f"<a href='../api/teams/{html.escape(team)}/bill?format=html&amp;period={period}'>bill</a></p>")


class TeamDatasetsHandler(AccountingHandler):
    """A team's datasets and their versions (members and admins), from the team's registry."""

    @web.authenticated
    async def get(self, team: str):
        team = self.team_or_404(team)
        self.write_json(await datasets_of(self.policy, team, self.settings["team_root"]))


async def datasets_of(policy, team: str, team_root: str) -> dict:
    """What the Datasets tab shows of `team`: its registry, datasets and versions (git reads, in a thread)."""
    try:
        registry = team_registry(policy, team, team_root)
        listing = await asyncio.to_thread(team_datasets, policy, team, team_root)
    except DatasetError as error:  # e.g. a registry the service cannot read: say so, don't fail the page
        return {"team": team, "registry": None, "datasets": [], "problems": [str(error)]}
    return {"team": team, "registry": str(registry.path) if registry.exists() else None, **listing.as_json()}


class DatasetsPageHandler(AccountingHandler):
    """The Datasets tab: each of my teams' datasets, their versions, and how to get one."""

    @web.authenticated
    async def get(self):
        viewer, policy = self.viewer(), self.policy
        teams = sorted(policy.teams) if viewer.admin else sorted(viewer.teams | viewer.leads)
        sections = []
        for team in teams:
            found = await datasets_of(policy, team, self.settings["team_root"])
            title = f"<h2>Team {html.escape(team)}</h2>"
            if found["registry"] is None:
                sections.append(title + "<p>No dataset registry yet: a member creates it with "
                                f"<code>gpupool datasets init --team {html.escape(team)}</code>.</p>"
                                + "".join(f"<p>{html.escape(p)}</p>" for p in found["problems"]))
                continue
            rows = [[d["name"], v["version"], human_size(v["size"]), "?" if v["files"] is None else v["files"],
                     v["date"], v["commit"][:10]] for d in found["datasets"] for v in d["versions"]]
            example = next(((d["name"], d["versions"][-1]["rev"]) for d in found["datasets"] if d["versions"]), None)
            how = (f"<p>Get a version: <code>dvc import {html.escape(found['registry'])} {html.escape(example[0])} "
                   f"--rev {html.escape(example[1])}</code> (or <code>dvc get</code>)</p>" if example else "")
            sections.append(title + f"<p>Registry: <code>{html.escape(found['registry'])}</code></p>"
                            + (_table(["dataset", "version", "size", "files", "date", "commit"], rows) if rows
                               else "<p>No dataset yet: <code>gpupool datasets add NAME FOLDER --version v1</code></p>")
                            + how + "".join(f"<p>⚠ {html.escape(p)}</p>" for p in found["problems"]))
        self.write_page("gpupool: datasets", TABS + "".join(f"<section>{s}</section>" for s in sections)
                        + "<p><a href='api/teams/TEAM/datasets'>as JSON</a>: api/teams/&lt;team&gt;/datasets</p>")


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
        # The live queue length and wait histogram are the hub's (/hub/metrics, where the queue is); these
        # are the waits the ledger recorded this period, which survive restarts.
        waited = GaugeMetricFamily("gpupool_queue_waited_runs", "Runs this period that waited in the queue",
                                   labels=["team"])
        mean = GaugeMetricFamily("gpupool_queue_wait_mean_seconds", "Mean queue wait of this period's runs",
                                 labels=["team"])
        for name, waits in sorted(self.ledger.queue_waits(period).items()):
            waited.add_metric([name], waits.count)
            mean.add_metric([name], float(waits.mean_s))
        yield waited
        yield mean
        errors = CounterMetricFamily("gpupool_reconcile_errors", "Reconciliation rounds that failed", labels=["step"])
        for step, count in RECONCILE_ERRORS.items():
            errors.add_metric([step], count)
        yield errors


#: The tabs of the user pages.
TABS = "<nav><a href='./'>Usage</a> · <a href='datasets'>Datasets</a></nav>"


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
            f"{TABS}<h1>GPU usage of {html.escape(viewer.name)}, {html.escape(period)}</h1>"
            + "".join(f"<section>{s}</section>" for s in sections)
            + "".join(f"<p><a href='teams/{html.escape(t)}'>Team {html.escape(t)}: members and days</a></p>"
                      for t in sorted(viewer.leads))
            + ("<p><a href='admin'>All teams: utilisation, queue waits, top consumers</a></p>" if viewer.admin else "")
            + "<p><a href='api/me'>as JSON</a></p></body></html>"
        )


PERIOD = {"name": "period", "in": "query", "schema": {"type": "string", "pattern": "^\\d{4}-(0[1-9]|1[0-2])$"}}
TOP = {"name": "top", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TOP, "default": 10}}

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
        "/api/teams/{team}/report": {"get": {
            "summary": "Team leads and admins: the team's users, GPU-hours per day, queue waits, top consumers",
            "parameters": [PERIOD, TOP]}},
        "/api/admin/report": {"get": {
            "summary": "Admins: utilisation (allocated / capacity GPU-hours) per model per day, queue waits per team, "
                       "top consumers, every team's totals", "parameters": [PERIOD, TOP]}},
        "/admin": {"get": {"summary": "Admins: the all-teams page with charts (HTML, inline SVG)",
                           "parameters": [PERIOD, TOP]}},
        "/teams/{team}": {"get": {"summary": "Team leads and admins: the team page with charts (HTML, inline SVG)",
                                  "parameters": [PERIOD, TOP]}},
        "/api/teams/{team}/datasets": {"get": {
            "summary": "A team's datasets and their versions from its DVC registry (members and admins)"}},
        "/datasets": {"get": {"summary": "The Datasets tab: my teams' datasets and versions (HTML)"}},
        "/metrics": {"get": {"summary": "Prometheus metrics (admins)"}},
        "/health": {"get": {"summary": "No login: status, gpupool version and when this service started"}},
    },
}


class HealthHandler(web.RequestHandler):
    def get(self):
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"status": "ok", "version": __version__, "started": STARTED}))


class OpenAPIHandler(web.RequestHandler):
    def get(self):
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(OPENAPI))


def make_app(ledger: Ledger, policy_dir: str, prefix: str, team_root: str = "teams") -> web.Application:
    return web.Application(
        [
            (prefix, PageHandler),
            (prefix + "api/me", MeHandler),
            (prefix + "api/teams", TeamsHandler),
            (prefix + r"api/teams/([^/]+)", TeamHandler),
            (prefix + r"api/teams/([^/]+)/bill", BillHandler),
            (prefix + r"api/teams/([^/]+)/report", TeamReportHandler),
            (prefix + r"api/teams/([^/]+)/datasets", TeamDatasetsHandler),
            (prefix + "datasets", DatasetsPageHandler),
            (prefix + "api/admin/report", AdminReportHandler),
            (prefix + "admin", AdminPageHandler),
            (prefix + r"teams/([^/]+)", TeamPageHandler),
            (prefix + "metrics", MetricsHandler),
            (prefix + "openapi.json", OpenAPIHandler),
            (prefix + "health", HealthHandler),
            (prefix + "oauth_callback", HubOAuthCallbackHandler),
        ],
        ledger=ledger, policy_dir=policy_dir, team_root=team_root, cookie_secret=os.urandom(32),
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
        except requests.RequestException as error:  # the hub is down or restarting: the next round tries again
            RECONCILE_ERRORS["hub"] += 1
            log.warning("reconciliation with the hub skipped: %s", error)
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
    # The team folders (and their dataset registries): LocalGPUSpawner.team_root's default, or as configured.
    team_root = os.environ.get("GPUPOOL_TEAM_ROOT", str(state / "teams"))
    app = make_app(ledger, os.environ.get("GPUPOOL_POLICIES", str(DEFAULT_POLICY_DIR)), prefix, team_root)
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
