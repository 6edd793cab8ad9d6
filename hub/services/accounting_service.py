"""`gpupool-accounting`: the hub-managed service that shows usage, budgets and bills, and exports metrics.

Runs under JupyterHub at `/services/accounting/` (`python -m gpupool.hub.services.accounting_service`), authenticated
through the hub: browsers by HubOAuth, API clients by their JupyterHub token. Who sees what:
a member sees their own usage and cost, and their team's totals, days and queue; a team lead each member's
usage, the top consumers and the bill too; an admin everything. Another team's data answers 404, so that
its existence does not leak either. The pages are hub pages (the hub's page.html and navigation bar);
errors are the hub's error page for a browser and JSON for API clients (`api/…`, or no `text/html` in Accept).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from http.client import responses
from pathlib import Path
from urllib.parse import urlencode, urlparse

import psutil
import requests
from jinja2 import ChoiceLoader, Environment, FileSystemLoader, PrefixLoader
from jupyterhub._data import DATA_FILES_PATH
from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from markupsafe import Markup
from tornado import ioloop, web
from traitlets import Bool, Float, Integer, List, Unicode, default
from traitlets.config import Application

from gpupool.hub import __version__
from gpupool.hub.accounting import charts
from gpupool.hub.accounting.bills import FORMATS, bill_for, csv_filename, render_bill, render_html
from gpupool.hub.accounting.culls import idle_figures
from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.accounting.reports import (
    MAX_TOP, daily_utilisation, money, queue_waits, run_label, running_servers, team_daily, top_consumers,
    user_usage,
)
from gpupool.hub.accounting.servers import HubClient, reconcile_with_hub
from gpupool.hub.datasets import DatasetError, human_size, team_datasets, team_registry
from gpupool.policies import periods
from gpupool.policies import DEFAULT_POLICY_DIR, defaults
from gpupool.policies.admission import format_hours, format_share, reached_alerts
from gpupool.policies.model import Policy
from gpupool.policies.reload import current_policy
from gpupool.spawner.pool import discover_cards
from gpupool.spawner.wiring import ACCOUNTING_SERVICE

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


#: The hub's own templates (page.html, error.html) that the accounting pages extend, so they look like the hub.
HUB_TEMPLATES = Path(DATA_FILES_PATH) / "templates"
#: gpupool's overrides of the hub's templates (the hub loads them first too) and the accounting pages' own.
GPUPOOL_HUB_TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
TEMPLATES = Path(__file__).resolve().parent / "templates"


def page_templates() -> Environment:
    """Jinja templates the way the hub loads them: ours first, the hub's as `page.html` or `templates/page.html`."""
    return Environment(autoescape=True, loader=ChoiceLoader([
        FileSystemLoader([str(TEMPLATES)]),
        PrefixLoader({"templates": FileSystemLoader([str(HUB_TEMPLATES)])}, "/"),
        FileSystemLoader([str(GPUPOOL_HUB_TEMPLATES), str(HUB_TEMPLATES)]),
    ]))


def wants_json(path: str, prefix: str, accept: str) -> bool:
    """API routes always answer JSON; a page answers HTML only to a client that asks for it (a browser does)."""
    route = path[len(prefix):] if path.startswith(prefix) else path.lstrip("/")
    if route.startswith("api/") or route in ("metrics", "openapi.json"):
        return True
    return "text/html" not in accept


class AccountingHandler(HubOAuthenticated, web.RequestHandler):
    """Base: authentication, body limit, the hub's page frame; errors as the hub's error page or as JSON."""

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
        if wants_json(self.request.path, self.settings["prefix"], self.request.headers.get("Accept", "")):
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"status": status_code, "message": message}))
            return
        try:
            user = self.current_user
        except Exception:  # the error may be the hub's answer about this very user: show the page without them
            user = None
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(self.settings["templates"].get_template("error.html").render(
            **self.hub_namespace(user), status_code=status_code,
            status_message=responses.get(status_code, "Error"), message=message,
            extra_error_html=Markup('<a href="{}">{}</a> · <a href="{}">Back to the hub</a>').format(
                self.settings["prefix"], self.settings.get("home_label", "Your usage"),
                self.settings["base_url"] + "hub/home")))

    def hub_namespace(self, user: dict | None) -> dict:
        """What the hub's page.html needs to draw its navigation bar, from the service's side of the proxy."""
        base = self.settings["base_url"]
        hub = base + "hub/"
        return {
            "base_url": hub, "prefix": base, "logo_url": hub + "home", "login_url": hub + "login",
            "logout_url": hub + "logout", "version_hash": "", "xsrf_token": "", "no_spawner_check": True,
            "static_url": lambda path, include_version=True: hub + "static/" + path,
            "user": {"name": user["name"], "json_escaped_name": json.dumps(user["name"])[1:-1]} if user else None,
            "parsed_scopes": {"admin-ui"} if user and user.get("admin") else set(),
            "services": [{"name": name, "href": f"{base}services/{name}/"} for name in self.settings["nav_services"]],
            "hub_home": hub + "home",
        }

    def render_page(self, template: str, title: str, tab: str, **values) -> None:
        viewer = self.viewer()
        tabs = [("./", "Usage", "usage")]
        tabs += [(f"teams/{t}", f"Team {t}", f"team:{t}") for t in sorted(viewer.teams | viewer.leads)]
        tabs.append(("datasets", "Datasets", "datasets"))
        if viewer.admin:
            tabs.append(("admin", "All teams", "admin"))
        # Pages a folder down (teams/T, admin/replay) link relative to the service's root.
        root = "../" if tab.startswith("team:") or values.pop("nested", False) else ""
        tabs = [(href if href.startswith("../") else root + href, label, key) for href, label, key in tabs]
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(self.settings["templates"].get_template(template).render(
            **self.hub_namespace(self.current_user), title=title, tab=tab, tabs=tabs, user_admin=viewer.admin,
            currency=self.policy.billing.currency, alerts=values.pop("alerts", []), **values))

    def viewer(self) -> Viewer:
        user = self.current_user
        policy = self.policy
        teams = frozenset(policy.teams_of(user["name"], user.get("groups") or []))
        leads = frozenset(policy.leads_of(user["name"], user.get("groups") or []))
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
        mine = user_usage(self.ledger, policy, viewer.name, period)
        self.write_json({
            "user": viewer.name, "admin": viewer.admin, "period": period,
            "gpu_hours": _hours(sum((u["gpu_hours"] for u in mine.values()), Fraction(0))),
            "cost": str(sum((u["cost"] for u in mine.values()), Decimal("0.00"))),
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
        period = self.period_argument()
        bill = bill_for(self.ledger, self.policy, team, period)
        self.set_header("Content-Type", {"json": "application/json", "csv": "text/csv",
                                         "html": "text/html"}[fmt] + "; charset=utf-8")
        if fmt == "csv":  # saved as a file, named for what it is, not "bill" or "bill.csv"
            self.set_header("Content-Disposition", f'attachment; filename="{csv_filename(team, period)}"')
        elif fmt == "html":
            self.finish(render_html(bill, csv_href=bill_links(team, period, "")["csv"]))
            return
        self.finish(render_bill(bill, fmt))


def bill_links(team: str, period: str, to_api: str) -> dict[str, str]:
    """The team's bill of `period` as the printable page (`html`) and as CSV (`csv`), from a page whose way to
    the service's `api/` is `to_api` ("" from the bill itself, "../api/" from a team page, "api/" from the others)."""
    base = f"{to_api}teams/{team}/bill?" if to_api else "?"
    return {fmt: base + urlencode({"format": fmt, "period": period}) for fmt in ("html", "csv")}


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


def capacity_of(policy: Policy) -> dict[str, int]:
    """Cards per GPU model: NVML's when a driver is present here, else the policy's declared inventory."""
    cards, _source = discover_cards(policy)
    found = Counter(card.model for card in cards)
    return {model: found.get(model, 0) for model in policy.models}


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
        "idle": idle_report(ledger, period),
    }


def idle_report(ledger: Ledger, period: str, team: str | None = None) -> dict[str, dict[str, str | int]]:
    """Per team (or `team` alone): GPU-hours held by idle servers and by idle jobs, their share of the GPU-hours
    held, servers the idle culler stopped and the GPU-hours that gave back (`culls.idle_figures`)."""
    held = ledger.gpu_hours(period, ("team",))
    result = {}
    for name, figures in idle_figures(ledger.engine, period).items():
        if team is not None and name != team:
            continue
        total = held.get((name,), Fraction(0))
        idle = figures.idle_gpu_hours + figures.job_idle_gpu_hours
        result[name] = {"idle_gpu_hours": _hours(figures.idle_gpu_hours),
                        "job_idle_gpu_hours": _hours(figures.job_idle_gpu_hours),
                        "idle_share": f"{float(idle / total):.4f}" if total else "0",
                        "culled_servers": figures.culled, "reclaimed_gpu_hours": _hours(figures.reclaimed_gpu_hours)}
    return result


def team_report(ledger: Ledger, policy, team: str, period: str, top: int, members: bool = True) -> dict:
    """Everything a team's page shows, as JSON: with each member's figures for its leads and admins
    (`members`), without them for a member, who sees the team's totals, days and queue."""
    report = {
        **team_summary(ledger, policy, team, period, members),
        "daily": team_daily(ledger, team, period),
        "queue_waits": queue_waits(ledger, period, team=team).get(team),
        "idle": idle_report(ledger, period, team).get(team),
    }
    if members:
        report["top_consumers"] = top_consumers(ledger, period, top, team=team)
    return report


# --- the pages: the same figures as the JSON routes, for people ---------------------------------------------


def percent(used: Fraction, of: Fraction) -> str:
    """A share of a budget for people: 0.15 %, 7.5 %, 100 %."""
    value = float(used / of * 100) if of else 0.0
    text = f"{value:.2f}" if value < 1 else f"{value:.1f}"
    return text.rstrip("0").rstrip(".") + " %"


def idle_text(idle: dict | None) -> str:
    """The team page's line about idle GPUs (the idle culler's figures)."""
    if not idle:
        return "No server of the team sat idle on a GPU this period, as far as the idle culler saw."
    share = percent(Fraction(idle["idle_share"]), Fraction(1))
    culled = idle["culled_servers"]
    return (f"{idle['idle_gpu_hours']} GPU-h were held by idle servers and {idle['job_idle_gpu_hours']} GPU-h by "
            f"idle training jobs ({share} of the team's GPU-hours); "
            f"the idle culler stopped {culled} server{'' if culled == 1 else 's'}, giving back "
            f"{idle['reclaimed_gpu_hours']} GPU-h.")


def period_name(period: str) -> str:
    return periods.period_bounds(period)[0].strftime("%B %Y")


def queue_text(waits: dict | None) -> str:
    """"1 run waited, 63 s" / "3 runs waited, 20.5 s on average, 40 s at most" / "no run waited"."""
    if not waits:
        return "No run waited in the queue this period."
    runs = waits["runs"]
    if runs == 1:
        return f"1 run waited in the queue, {waits['longest_seconds']} s."
    return (f"{runs} runs waited in the queue, {waits['mean_seconds']} s on average, "
            f"{waits['longest_seconds']} s at most.")


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
        policy, period = self.policy, self.period_argument()
        report = admin_report(self.ledger, policy, period, self.top_argument())
        name = period_name(period)
        utilisation_charts = [Markup(charts.utilisation_chart(
            f"{model}: utilisation per day ({report['capacity_cards'][model]} cards), {name}",
            [(d["day"], float(d["utilisation"])) for d in days]))
            for model, days in report["utilisation_daily"].items()]
        usage = self.ledger.usage(period)
        budgets = [(t["team"], Fraction(t["budget_gpu_hours"])) for t in report["teams"] if t["budget_gpu_hours"]]
        teams, used_by, problems = [], self.ledger.gpu_hours(period, ("team",)), []
        for t in report["teams"]:
            used = used_by.get((t["team"],), Fraction(0))
            try:
                cost = money(bill_for(self.ledger, policy, t["team"], period).total, policy.billing.currency)
            except ValueError as error:  # a model without a price: say so, the rest of the page still helps
                cost = "–"
                problems.append(f"team {t['team']}: {error}")
            teams.append({"name": t["team"], "hours": format_hours(used), "budget": t["budget_gpu_hours"],
                          "used_percent": percent(used, Fraction(t["budget_gpu_hours"])) if t["budget_gpu_hours"]
                          else None, "cost": cost,
                          "href": f"teams/{t['team']}?period={period}",
                          "bill": bill_links(t["team"], period, "api/")})
        alerts = [a.message for t in policy.teams for a in reached_alerts(policy, t, usage)] + problems
        idle = sorted(report["idle"].items())
        self.render_page(
            "admin.html", f"All teams, {name}", "admin", period_name=name, alerts=alerts, idle=idle,
            idle_chart=Markup(charts.idle_chart(f"Teams: share of their GPU-hours held by idle servers and jobs, {name}", [
                (t, float(Fraction(i["idle_share"])) * 100) for t, i in idle])) if idle else "",
            utilisation_charts=utilisation_charts,
            # Budgets differ by orders of magnitude between teams: one scale for all is the share used.
            teams_chart=Markup(charts.bar_chart(
                f"Teams: share of their budget used in {name}",
                [(t, float(used_by.get((t,), Fraction(0)) / b * 100)) for t, b in budgets], "%",
                limit=100.0)) if budgets else "",
            hours_chart=Markup(charts.bar_chart(f"Teams: GPU-hours in {name}", [
                (t["team"], float(Fraction(t["gpu_hours"]))) for t in report["teams"]], "GPU-h")),
            top_chart=Markup(charts.bar_chart(f"Top consumers in {name}", [
                (f'{c["user"]} ({c["team"]})', float(Fraction(c["gpu_hours"]))) for c in report["top_consumers"]],
                "GPU-h")),
            waits=list(report["queue_waits"].items()), teams=teams,
            json_href="api/admin/report?" + urlencode({"period": period}))


def _policy_sets(sets: dict[str, Path], own: Path) -> tuple[dict[str, Policy], list[str]]:
    """Each policy set of `sets` loaded, and the digests of their files; ValueError saying what is wrong. A folder
    other than the platform's own must lie beside it (in its parent folder), files and links resolved: the page
    reads policies, not any YAML of the server."""
    from gpupool.hub.render import policy_files
    from gpupool.policies import PolicyError, load_policy
    from gpupool.spawner.volcano import policies_digest

    root = own.resolve().parent
    loaded, digests = {}, []
    for name, folder in sets.items():
        if folder != own:
            inside = folder.resolve()
            if (len(name) > 1000 or not inside.is_dir() or not inside.is_relative_to(root) or inside == root
                    or any(not f.resolve().is_relative_to(inside) for f in inside.iterdir())):
                raise ValueError(f"no policies folder {name[:200]!r} beside the platform's own: give a folder of "
                                 f"policy files (*.yaml) in {root}, such as {root / 'policies-next'}")
        try:
            loaded[name] = load_policy(folder)
            digests.append(policies_digest(policy_files(folder)))
        except PolicyError as error:
            raise ValueError(error.report(folder, "nothing was replayed")) from None
    return loaded, digests


class AdminReplayHandler(AccountingHandler):
    """Admins: a month's own usage (last month's by default) replayed under the current policies and, if asked,
    under another policies folder of the server's: the table and the timelines of `gpupool replay`. Computed
    off the event loop and kept (per month, policy files and ledger state) so a reload costs nothing."""

    @web.authenticated
    async def get(self):
        from gpupool.hub import replay

        self.admin_or_403()
        this_month = periods.period_bounds(periods.period_of(periods.utcnow()))[0]
        period = self.get_argument("period", periods.period_of(this_month - timedelta(days=1)))
        try:
            periods.parse_period(period)
        except ValueError as error:
            raise web.HTTPError(400, str(error)) from None
        own = Path(self.settings["policy_dir"])
        sets = {"current policies": own}
        against = self.get_argument("policies", "").strip()
        if against:
            sets[against] = Path(against)
        try:  # off the event loop: folders and files, then the ledger
            loaded, digests = await asyncio.to_thread(_policy_sets, sets, own)
        except ValueError as error:
            raise web.HTTPError(400, str(error)) from None
        state = await asyncio.to_thread(self.ledger.intervals_overlapping, *periods.period_bounds(period))
        key = (period, tuple(sets), tuple(digests),
               hash(tuple((i.key, i.end, i.how, i.last_seen, i.state) for i in state)))
        cache = self.settings.setdefault("replay_cache", {})
        if key not in cache:
            work, summaries, runs = await asyncio.to_thread(replay.replay_usage, self.ledger, period, loaded)
            cache.clear()  # one result kept: the page an admin is looking at
            # (the charts are drawn here, on the loop: matplotlib's settings are process-wide)
            cache[key] = (len(work.jobs), replay.html_table(summaries), replay.timeline_charts(runs))
        jobs, table, charts_ = cache[key]
        name = period_name(period)
        self.render_page("admin_replay.html", f"What if: {name} replayed", "admin", nested=True, period=period,
                         period_name=name,
                         against=against, jobs=jobs, table=Markup(table), charts=[Markup(c) for c in charts_])


class TeamReportHandler(AccountingHandler):
    @web.authenticated
    def get(self, team: str):
        team = self.team_or_404(team)
        self.write_json(team_report(self.ledger, self.policy, team, self.period_argument(), self.top_argument(),
                                    self.viewer().may_see_members(team)))


class TeamPageHandler(AccountingHandler):
    """A team's page: its totals against its budget, its days and its queue for every member; each member's
    GPU-hours, the top consumers and the bill for its leads and admins."""

    @web.authenticated
    def get(self, team: str):
        team = self.team_or_404(team)
        viewer, policy, period = self.viewer(), self.policy, self.period_argument()
        lead = viewer.may_see_members(team)
        report = team_report(self.ledger, policy, team, period, self.top_argument(), lead)
        name, currency = period_name(period), policy.billing.currency
        used = self.ledger.gpu_hours(period, ("team",), team=team).get((team,), Fraction(0))
        budget = report["budget_gpu_hours"]
        mine = user_usage(self.ledger, policy, viewer.name, period).get(team, {})
        members_chart = None
        if lead:
            members_chart = Markup(charts.bar_chart(f"Members of {team}: GPU-hours in {name}", [
                (u, float(Fraction(h))) for u, h in report["users"].items()], "GPU-h"))
        self.render_page(
            "team.html", f"Team {team}, {name}", f"team:{team}", period_name=name, lead=lead,
            leads=sorted(policy.teams[team].leads),
            alerts=[a.message for a in reached_alerts(policy, team, self.ledger.usage(period))],
            hours=format_hours(used), budget=budget, on_exhausted=report["on_exhausted"], resets=report["resets"],
            used_percent=percent(used, Fraction(budget)) if budget else None,
            mine=format_hours(mine.get("gpu_hours", Fraction(0))),
            my_cost=money(mine.get("cost", Decimal(0)), currency),
            total_chart=Markup(charts.bar_chart(f"Team {team}: GPU-hours in {name}", [(team, float(used))], "GPU-h",
                                                limit=float(budget) if budget else None)),
            daily_chart=Markup(charts.daily_chart(f"Team {team}: GPU-hours per day, {name}", [
                (d["day"], float(Fraction(d["gpu_hours"]))) for d in report["daily"]], "GPU-h")),
            members_chart=members_chart, queue=queue_text(report["queue_waits"]), idle=idle_text(report["idle"]),
            top=report.get("top_consumers"),
            json_href=f"../api/teams/{team}/report?" + urlencode({"period": period}),
            bill=bill_links(team, period, "../api/") if lead else None)


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
            rows = [[d["name"], v["version"], human_size(v["size"]), "?" if v["files"] is None else v["files"],
                     v["date"], v["commit"][:10]] for d in found["datasets"] for v in d["versions"]]
            example = next(((d["name"], d["versions"][-1]["rev"]) for d in found["datasets"] if d["versions"]), None)
            sections.append({"team": team, "registry": found["registry"], "rows": rows, "example": example,
                             "problems": found["problems"]})
        self.render_page("datasets.html", "Datasets", "datasets", sections=sections)


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
        # Only runs that waited (a second or more) count: runs placed at once are not queue waits.
        waited = GaugeMetricFamily("gpupool_queue_waited_runs",
                                   "Runs this period that waited in the queue (1 s or more)", labels=["team"])
        mean = GaugeMetricFamily("gpupool_queue_wait_mean_seconds",
                                 "Mean queue wait of this period's runs that waited", labels=["team"])
        for name, waits in sorted(self.ledger.queue_waits(period).items()):
            waited.add_metric([name], waits.count)
            mean.add_metric([name], float(waits.mean_s))
        yield waited
        yield mean
        idle_hours = GaugeMetricFamily("gpupool_idle_gpu_hours", "GPU-hours held by idle servers and jobs this "
                                       "period", labels=["team", "kind"])
        idle_ratio = GaugeMetricFamily("gpupool_idle_ratio", "Share of this period's GPU-hours held by idle servers and jobs",
                                       labels=["team"])
        culled = GaugeMetricFamily("gpupool_culled_servers", "Servers the idle culler stopped this period",
                                   labels=["team"])
        reclaimed = GaugeMetricFamily("gpupool_reclaimed_gpu_hours",
                                      "GPU-hours culling gave back this period (until the user came back, 24 h at most)",
                                      labels=["team"])
        for name, figures in idle_report(self.ledger, period).items():
            idle_hours.add_metric([name, "server"], float(Fraction(figures["idle_gpu_hours"])))
            idle_hours.add_metric([name, "job"], float(Fraction(figures["job_idle_gpu_hours"])))
            idle_ratio.add_metric([name], float(figures["idle_share"]))
            culled.add_metric([name], figures["culled_servers"])
            reclaimed.add_metric([name], float(Fraction(figures["reclaimed_gpu_hours"])))
        yield idle_hours
        yield idle_ratio
        yield culled
        yield reclaimed
        errors = CounterMetricFamily("gpupool_reconcile_errors", "Reconciliation rounds that failed", labels=["step"])
        for step, count in RECONCILE_ERRORS.items():
            errors.add_metric([step], count)
        yield errors


class PageHandler(AccountingHandler):
    """The usage page: my GPU-hours and their cost, my running servers, my teams against their budgets."""

    @web.authenticated
    def get(self):
        viewer, policy = self.viewer(), self.policy
        period, currency = self.period_argument(), policy.billing.currency
        name = period_name(period)
        usage = self.ledger.usage(period)
        mine = user_usage(self.ledger, policy, viewer.name, period)
        alerts, teams = [], []
        for team in sorted(viewer.teams | viewer.leads):
            alerts += [alert.message for alert in reached_alerts(policy, team, usage)]
            summary = team_summary(self.ledger, policy, team, period, False)
            used = self.ledger.gpu_hours(period, ("team",), team=team).get((team,), Fraction(0))
            budget = summary["budget_gpu_hours"]
            own = mine.get(team, {})
            teams.append({
                "name": team, "hours": format_hours(used), "budget": budget,
                "used_percent": percent(used, Fraction(budget)) if budget else None,
                "on_exhausted": summary["on_exhausted"], "resets": summary["resets"],
                "mine": format_hours(own.get("gpu_hours", Fraction(0))),
                "my_cost": money(own.get("cost", Decimal(0)), currency), "href": f"teams/{team}",
                "bill": bill_links(team, period, "api/") if viewer.may_see_members(team) else None,
                "chart": Markup(charts.bar_chart(
                    f"Team {team}: GPU-hours in {name}", [(team, float(used)), ("you", float(own.get("gpu_hours", 0)))],
                    "GPU-h", limit=float(budget) if budget else None)),
            })
        running = [{**server, "cost": money(server["cost"], currency), "share": format_share(Fraction(server["share"])),
                    "since": server["since"][:16].replace("T", " "), "server": run_label(server)}
                   for server in running_servers(self.ledger, policy, viewer.name, periods.utcnow())]
        self.render_page(
            "usage.html", f"Your GPU usage, {name}", "usage", period_name=name, alerts=alerts, teams=teams,
            my_hours=format_hours(sum((u["gpu_hours"] for u in mine.values()), Fraction(0))),
            my_cost=money(sum((u["cost"] for u in mine.values()), Decimal(0)), currency), running=running,
            leads=[(t, sorted(team.leads)) for t, team in sorted(policy.teams.items()) if team.leads],
            team_names=sorted(policy.teams))


PERIOD = {"name": "period", "in": "query", "schema": {"type": "string", "pattern": "^\\d{4}-(0[1-9]|1[0-2])$"}}
TOP = {"name": "top", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TOP, "default": 10}}

OPENAPI = {
    "openapi": "3.1.0",
    "info": {"title": "gpupool-accounting", "version": "1"},
    "components": {"securitySchemes": {"jupyterhub": {"type": "apiKey", "in": "header", "name": "Authorization",
                                                       "description": "token <JupyterHub API token>"}}},
    "security": [{"jupyterhub": []}],
    "paths": {
        "/api/me": {"get": {"summary": "My GPU-hours and their cost this period, my running servers with cost so far, "
                                       "my teams' budgets",
                            "parameters": [{"name": "period", "in": "query", "schema": {"type": "string",
                                                                                         "pattern": "^\\d{4}-\\d{2}$"}}]}},
        "/api/teams": {"get": {"summary": "Admins: every team's totals and utilisation per model"}},
        "/api/teams/{team}": {"get": {"summary": "A team's totals (with per-user GPU-hours for leads and admins)"}},
        "/api/teams/{team}/bill": {"get": {"summary": "A team's bill (leads and admins)", "parameters": [
            {"name": "format", "in": "query", "schema": {"enum": list(FORMATS)}}]}},
        "/api/teams/{team}/report": {"get": {
            "summary": "A team's GPU-hours per day and queue waits (runs that waited); for its leads and admins "
                       "also each member's GPU-hours and the top consumers",
            "parameters": [PERIOD, TOP]}},
        "/api/admin/report": {"get": {
            "summary": "Admins: utilisation (allocated / capacity GPU-hours) per model per day, queue waits per team, "
                       "top consumers, every team's totals", "parameters": [PERIOD, TOP]}},
        "/admin": {"get": {"summary": "Admins: the all-teams page with charts (HTML, inline SVG)",
                           "parameters": [PERIOD, TOP]}},
        "/admin/replay": {"get": {"summary": "Admins: a month's usage (default: last month's) replayed under the "
                                             "current policies and, with `policies`, under another folder of the "
                                             "server's (HTML: the replay's table and timeline charts)",
                                  "parameters": [PERIOD, {"name": "policies", "in": "query",
                                                          "schema": {"type": "string"}}]}},
        "/teams/{team}": {"get": {"summary": "The team page with charts (HTML, inline SVG): a member's view for "
                                             "members, with each member's usage for leads and admins",
                                  "parameters": [PERIOD, TOP]}},
        "/api/teams/{team}/datasets": {"get": {
            "summary": "A team's datasets and their versions from its DVC registry (members and admins)"}},
        "/datasets": {"get": {"summary": "The Datasets tab: my teams' datasets and versions (HTML)"}},
        "/metrics": {"get": {"summary": "Prometheus metrics (admins)"}},
        "/health": {"get": {"summary": "No login: status, gpupool version and when this service started"}},
    },
}


class NotFoundHandler(AccountingHandler):
    """Any other path under the service: the hub's 404 page for a browser, JSON for an API client."""

    def get(self, *args):
        raise web.HTTPError(404, f"no page {self.request.path!r} here")


class HealthHandler(web.RequestHandler):
    def get(self):
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"status": "ok", "version": __version__, "started": STARTED}))


class OpenAPIHandler(web.RequestHandler):
    def get(self):
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(OPENAPI))


def make_app(ledger: Ledger, policy_dir: str, prefix: str, team_root: str, base_url: str = "/",
             nav_services: tuple[str, ...] = ("accounting",)) -> web.Application:
    """The service's routes; `base_url` is the hub's (its pages are at `{base_url}hub/`), `nav_services` the
    services the hub's navigation bar lists for every user."""
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
            (prefix + "admin/replay", AdminReplayHandler),
            (prefix + r"teams/([^/]+)", TeamPageHandler),
            (prefix + "metrics", MetricsHandler),
            (prefix + "openapi.json", OpenAPIHandler),
            (prefix + "health", HealthHandler),
            (prefix + "oauth_callback", HubOAuthCallbackHandler),
        ],
        ledger=ledger, policy_dir=policy_dir, team_root=team_root, cookie_secret=os.urandom(32), prefix=prefix,
        base_url=base_url, nav_services=tuple(nav_services), templates=page_templates(),
        max_body_size=MAX_BODY_BYTES, default_handler_class=NotFoundHandler,
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


class AccountingService(Application):
    """`python -m gpupool.hub.services.accounting_service`: the accounting service's settings, and the service itself.

    Configured like JupyterHub's own services: traits with help (`--help-all`), a config file (`--config`),
    `--generate-config`, command-line aliases. Each trait falls back to the environment variable its help
    names (what the hub gives a managed service, and what `gpupool up` and the Helm chart set), then to the
    platform's default.
    """

    name = "gpupool-accounting"
    description = "The gpupool accounting service: usage, budgets, bills and metrics behind the hub login."
    examples = """
    python -m gpupool.hub.services.accounting_service --generate-config > accounting_config.py
    python -m gpupool.hub.services.accounting_service --config accounting_config.py
    python -m gpupool.hub.services.accounting_service --ledger-url postgresql+psycopg://gpupool@db/gpupool
    """
    aliases = {
        "config": "AccountingService.config_file",
        "state-dir": "AccountingService.state_dir",
        "ledger-url": "AccountingService.ledger_url",
        "policies": "AccountingService.policy_dir",
        "team-root": "AccountingService.team_root",
        "url": "AccountingService.service_url",
        "reconcile-seconds": "AccountingService.reconcile_seconds",
        "reconcile-stale-seconds": "AccountingService.reconcile_stale_seconds",
        "log-level": "Application.log_level",
    }
    flags = {
        "generate-config": ({"AccountingService": {"generate_config": True}},
                            "print a config file with every setting and its help, then exit"),
    }

    config_file = Unicode(
        "",
        help="""A Python config file to load (`c.AccountingService.ledger_url = …`); none by default.""",
    ).tag(config=True)

    generate_config = Bool(
        False, help="""Print a config file with every setting and its help, then exit.""",
    ).tag(config=True)

    state_dir = Unicode(
        help="""
        The platform's state folder: where the ledger and the team folders are when they are not set.
        Default: `$GPUPOOL_STATE_DIR`, else `./state`.
        """,
    ).tag(config=True)

    @default("state_dir")
    def _default_state_dir(self):
        return str(defaults.state_dir())

    ledger_url = Unicode(
        help="""
        The usage ledger: `sqlite:///PATH` or `postgresql+psycopg://USER@HOST:PORT/DATABASE`, the same as
        the spawner's. Default: `$GPUPOOL_LEDGER_URL`, else an SQLite file in the state folder.
        """,
    ).tag(config=True)

    @default("ledger_url")
    def _default_ledger_url(self):
        return defaults.env("GPUPOOL_LEDGER_URL", defaults.ledger_url(self.state_dir))

    policy_dir = Unicode(
        help="""
        The policy folder (teams, quotas, budgets, prices), re-read when its files change. Default:
        `$GPUPOOL_POLICIES`, else the policies shipped with gpupool.
        """,
    ).tag(config=True)

    @default("policy_dir")
    def _default_policy_dir(self):
        return defaults.env("GPUPOOL_POLICIES", str(DEFAULT_POLICY_DIR))

    team_root = Unicode(
        help="""
        The teams' folders, whose dataset registries the Datasets tab lists (the spawner's `team_root`).
        Default: `$GPUPOOL_TEAM_ROOT`, else `teams` beside the state folder as root, inside it otherwise.
        """,
    ).tag(config=True)

    @default("team_root")
    def _default_team_root(self):
        return defaults.env("GPUPOOL_TEAM_ROOT", str(defaults.team_root(self.state_dir)))

    nav_services = List(
        Unicode(),
        help="""
        The services the pages' navigation bar lists for every user, as the hub's own pages do. Default:
        `$GPUPOOL_NAV_SERVICES` (comma-separated), else `accounting`.
        """,
    ).tag(config=True)

    @default("nav_services")
    def _default_nav_services(self):
        return [n for n in defaults.env("GPUPOOL_NAV_SERVICES", ACCOUNTING_SERVICE).split(",") if n]

    reconcile_seconds = Float(
        help="""
        Seconds between two reconciliations of the ledger with the servers the hub runs. Default:
        `$GPUPOOL_RECONCILE_SECONDS`, else 60.
        """,
    ).tag(config=True)

    @default("reconcile_seconds")
    def _default_reconcile_seconds(self):
        return float(defaults.env("GPUPOOL_RECONCILE_SECONDS", "60"))

    reconcile_stale_seconds = Integer(
        help="""
        An open interval nobody (spawner heartbeat or hub) has seen for this long is closed at its last
        heartbeat. Default: `$GPUPOOL_RECONCILE_STALE_SECONDS`, else 300.
        """,
    ).tag(config=True)

    @default("reconcile_stale_seconds")
    def _default_reconcile_stale_seconds(self):
        return int(defaults.env("GPUPOOL_RECONCILE_STALE_SECONDS", "300"))

    service_url = Unicode(
        help="""
        Where the service listens, as the hub knows it (127.0.0.1 on one machine, 0.0.0.0 in a pod).
        Default: `$JUPYTERHUB_SERVICE_URL` (the hub sets it for a managed service), else
        `http://127.0.0.1:8003`.
        """,
    ).tag(config=True)

    @default("service_url")
    def _default_service_url(self):
        return defaults.env("JUPYTERHUB_SERVICE_URL", defaults.service_url("accounting"))

    service_prefix = Unicode(
        help="""
        The URL prefix of the service's pages and API. Default: `$JUPYTERHUB_SERVICE_PREFIX` (set by the
        hub), else `/services/accounting/`.
        """,
    ).tag(config=True)

    @default("service_prefix")
    def _default_service_prefix(self):
        return defaults.env("JUPYTERHUB_SERVICE_PREFIX", f"/services/{ACCOUNTING_SERVICE}/")

    hub_base_url = Unicode(
        help="""The hub's base URL (its pages are at `{base_url}hub/`). Default: `$JUPYTERHUB_BASE_URL`, else `/`.""",
    ).tag(config=True)

    @default("hub_base_url")
    def _default_hub_base_url(self):
        return defaults.env("JUPYTERHUB_BASE_URL", "/")

    hub_api_url = Unicode(
        help="""
        The hub's REST API, asked which servers run (reconciliation). Default: `$JUPYTERHUB_API_URL` (set
        by the hub); empty: no reconciliation with the hub, only stale intervals are closed.
        """,
    ).tag(config=True)

    @default("hub_api_url")
    def _default_hub_api_url(self):
        return os.environ.get("JUPYTERHUB_API_URL", "")

    def initialize(self, argv=None):
        self.parse_command_line(argv)
        if self.config_file:
            self.load_config_file(self.config_file)
            self.update_config(self.cli_config)  # the command line wins over the file

    def start(self):
        if self.generate_config:
            print(self.generate_config_file(), end="")
            return
        ledger = Ledger(self.ledger_url)
        app = make_app(ledger, self.policy_dir, self.service_prefix, self.team_root, self.hub_base_url,
                       tuple(self.nav_services))
        parsed = urlparse(self.service_url)
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
        stale = timedelta(seconds=self.reconcile_stale_seconds)
        # The service's own API token: the hub gives it to a managed service in the environment only.
        token = os.environ.get("JUPYTERHUB_API_TOKEN")
        hub = HubClient(self.hub_api_url, token) if self.hub_api_url and token else None
        policy_dir = app.settings["policy_dir"]

        async def reconcile():
            await asyncio.to_thread(reconcile_once, ledger, lambda: current_policy(policy_dir, log), hub, stale)

        ioloop.IOLoop.current().add_callback(reconcile)  # at once: the hub may have run servers while we were down
        ioloop.PeriodicCallback(reconcile, self.reconcile_seconds * 1000).start()
        app.listen(port, host)
        log.info("gpupool-accounting at %s%s", self.service_url, self.service_prefix)
        ioloop.IOLoop.current().start()


def config_reference() -> str:
    """The Markdown table of every setting of the service, from the traits (docs/accounting-service.md)."""
    aliases = {target.split(".")[-1]: name for name, target in AccountingService.aliases.items()
               if target.startswith("AccountingService.")}
    rows = ["| setting | command line | type | what it is |", "|---|---|---|---|"]
    for name, trait in sorted(AccountingService.class_own_traits(config=True).items()):
        flag = f"`--{aliases[name]}`" if name in aliases else ("`--generate-config`" if name == "generate_config" else "")
        help_text = " ".join(trait.help.split()).replace("|", "\\|")
        rows.append(f"| `c.AccountingService.{name}` | {flag} | {type(trait).__name__} | {help_text} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s %(asctime)s accounting] %(message)s")
    service = AccountingService()
    service.initialize(argv)
    service.start()


if __name__ == "__main__":
    main()
