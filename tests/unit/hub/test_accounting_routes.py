"""The `gpupool-accounting` service in-process: who may see which route, what each page and API answer, bad input.

The service's own tornado `Application` (`make_app`) is served in this process on a free port, with its real
`HubOAuth` client; the one stand-in is the hub's `GET /hub/api/user` (`HubUserAPI`), which names the user of a
token as JupyterHub does (`token-alice` is alice; the user `admin` is the hub's admin). The ledger is seeded
with known intervals. What reads the ledger's figures (usage, bills, reports, metrics, replay) runs once on
SQLite and once on PostgreSQL (the `service` fixture); what only routes or renders runs on SQLite
(`sqlite_service`). The person's path through the real hub, proxy and browser is `tests/e2e/test_accounting_service.py`.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import threading
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import pytest
import requests
from jupyterhub.services.auth import HubOAuth
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.services.accounting_service import make_app
from gpupool.policies.periods import period_of, utcnow
from accounting_seed import POLICY, seed

PREFIX = "/services/accounting/"
#: The scope the hub grants its users on the service (spawner/wiring.py), which the service requires.
ACCESS = "access:services!service=accounting"
#: What a browser sends when it opens a page.
BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


class HubUserAPI(web.RequestHandler):
    """The hub's `GET /hub/api/user`: the model of the token's owner, 403 for a token the hub does not know."""

    def get(self):
        token = self.request.headers.get("Authorization", "").removeprefix("token ")
        name = token.removeprefix("token-")
        if not token.startswith("token-") or not name:
            raise web.HTTPError(403)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"kind": "user", "name": name, "admin": name == "admin", "groups": [],
                                "scopes": [ACCESS, f"read:users!user={name}"]}))


class Loop:
    """An event loop in a thread of its own, serving tornado applications on free ports."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def listen(self, app: web.Application) -> int:
        sock, port = bind_unused_port()

        async def start():
            HTTPServer(app).add_sockets([sock])  # as the service's `app.listen`: the body limit is the handlers'

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(timeout=60)
        return port

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=60)


class Served:
    """The service's application on a free port and an event loop of its own. It asks the hub's user API
    (`hub_user_api`, on another loop) synchronously, from a thread of `HubAuth`'s, as behind the real hub."""

    def __init__(self, folder: Path, ledger_url: str):
        self.policies = folder / "policies"
        self.policies.mkdir(parents=True)
        (self.policies / "policy.yaml").write_text(POLICY)
        self.ledger = Ledger(ledger_url)
        self.service = Loop("accounting-service")
        app = make_app(self.ledger, str(self.policies), PREFIX, str(folder / "teams"))
        self.url = f"http://127.0.0.1:{self.service.listen(app)}"

    def get(self, user: str | None, path: str, headers: dict | None = None, **kw) -> requests.Response:
        """GET `path` of the service as `user` (their hub token), or with no token."""
        headers = {**({"Authorization": f"token token-{user}"} if user else {}), **(headers or {})}
        return requests.get(f"{self.url}{PREFIX}{path}", headers=headers, timeout=60, allow_redirects=False, **kw)

    def close(self) -> None:
        self.service.close()
        self.ledger.dispose()


def _served(folder: Path, ledger_url: str):
    served = Served(folder, ledger_url)
    served.seeded_from = seed(served.ledger)
    return served


@pytest.fixture(scope="module")
def hub_user_api():
    """The hub's user API on a loop of its own, and the `HubOAuth` client every service of this module uses."""
    hub = Loop("hub-user-api")
    port = hub.listen(web.Application([(r"/hub/api/user", HubUserAPI)]))
    HubOAuth.clear_instance()
    HubOAuth.instance(
        api_url=f"http://127.0.0.1:{port}/hub/api", api_token="service-token", base_url=PREFIX, hub_prefix="/hub/",
        oauth_client_id="service-accounting", access_scopes={ACCESS},
        oauth_redirect_uri=f"http://127.0.0.1{PREFIX}oauth_callback")
    yield
    HubOAuth.clear_instance()
    hub.close()


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def service(request, tmp_path_factory, hub_user_api):
    """The seeded service on each database: for what reads the ledger's figures."""
    folder = tmp_path_factory.mktemp(f"accounting-{request.param}")
    url = (request.getfixturevalue("postgres_server").create_database("accounting")
           if request.param == "postgresql" else f"sqlite:///{folder / 'ledger.sqlite'}")
    served = _served(folder, url)
    yield served
    served.close()


@pytest.fixture(scope="module")
def sqlite_service(tmp_path_factory, hub_user_api):
    """The seeded service on SQLite: for what only routes or renders."""
    folder = tmp_path_factory.mktemp("accounting-routes")
    served = _served(folder, f"sqlite:///{folder / 'ledger.sqlite'}")
    yield served
    served.close()


# --- what each role reads: the ledger's figures, on each database --------------------------------------------


def test_a_member_sees_own_usage_and_team_totals(service):
    me = service.get("alice", "api/me")
    assert me.status_code == 200, me.text
    body = me.json()
    assert body["user"] == "alice" and body["gpu_hours"] == "0.5" and body["cost"] == "1.60"
    assert body["period"] == period_of(utcnow())
    (vision,) = body["teams"]
    assert vision["team"] == "vision" and vision["gpu_hours"] == "0.75" and "users" not in vision
    assert vision["budget_gpu_hours"] == "100"


def test_a_lead_sees_the_members_and_the_bill(service):
    team = service.get("lena", "api/teams/vision").json()
    assert team["users"] == {"alice": "0.5", "lena": "0.25"}
    bill = service.get("lena", "api/teams/vision/bill", params={"format": "json"})
    assert bill.status_code == 200, bill.text
    assert bill.json()["total"] == "2.40"  # 0.75 GPU-hours × 3.20
    csv = service.get("lena", "api/teams/vision/bill", params={"format": "csv"})
    assert csv.headers["Content-Type"].startswith("text/csv") and "alice" in csv.text


def test_the_bill_as_csv_is_linked_from_the_pages_and_downloads_under_its_name(service):
    """The lead on their team's and usage pages, the admin on All teams: each page links the CSV bill, which
    comes as a file named for its team and month, the same bill as the JSON; a member sees no bill link."""
    period = period_of(utcnow())
    name = f'attachment; filename="gpupool-bill-vision-{period}.csv"'
    pages = [("lena", "teams/vision", 'id="bill-csv"'), ("lena", "", 'data-bill-csv="vision"'),
             ("admin", "admin", None), ("lena", f"api/teams/vision/bill?format=html&period={period}", 'class="download"')]
    for user, path, marker in pages:
        page = service.get(user, path, headers=BROWSER)
        assert page.status_code == 200 and (marker is None or marker in page.text), (path, page.text[-3000:])
        links = [html.unescape(h) for h in re.findall(r'href="([^"]*format=csv[^"]*)"', page.text)]
        link = next((h for h in links if "teams/vision/" in h or h.startswith("?")), None)
        assert link is not None, (path, links)
        csv = requests.get(requests.compat.urljoin(f"{service.url}{PREFIX}{path}", link), timeout=60,
                           headers={"Authorization": f"token token-{user}"})
        assert csv.status_code == 200 and csv.headers["Content-Type"].startswith("text/csv"), (path, link, csv.text)
        assert csv.headers["Content-Disposition"] == name, (path, csv.headers)
        assert csv.text.splitlines()[-1].startswith(f"total,vision,{period},") and ",2.40,EUR" in csv.text
    # The admin's page links every team's.
    assert f"api/teams/nlp/bill?format=csv&amp;period={period}" in service.get("admin", "admin").text
    # A member who is not a lead: no bill on their pages (the bill is for leads and admins).
    for path in ("", "teams/vision"):
        assert "format=csv" not in service.get("alice", path, headers=BROWSER).text


def test_admin_sees_all_teams_utilisation_and_metrics(service):
    teams = service.get("admin", "api/teams")
    assert teams.status_code == 200, teams.text
    body = teams.json()
    assert [t["team"] for t in body["teams"]] == ["vision", "nlp"]
    assert body["utilisation"]["H200"]["allocated_gpu_hours"] != "0"
    metrics = service.get("admin", "metrics").text
    assert 'gpupool_allocated_shares{model="H200",team="nlp"} 0.25' in metrics
    assert 'gpupool_budget_used_ratio{team="vision"} 0.0075' in metrics
    # one run waited 30 s; the three placed at once are not waits (they made it "4 runs, 7.5 s" before)
    assert 'gpupool_queue_waited_runs{team="vision"} 1.0' in metrics
    assert 'gpupool_queue_wait_mean_seconds{team="vision"} 30.0' in metrics


def test_a_lead_sees_the_team_report_and_page(service):
    report = service.get("lena", "api/teams/vision/report")
    assert report.status_code == 200, report.text
    body = report.json()
    assert body["users"] == {"alice": "0.5", "lena": "0.25"}
    assert body["top_consumers"] == [{"team": "vision", "user": "alice", "gpu_hours": "0.5"},
                                     {"team": "vision", "user": "lena", "gpu_hours": "0.25"}]
    # one run waited 30 s, three were placed at once: only the one that waited counts
    assert body["queue_waits"] == {"runs": 1, "mean_seconds": "30.0", "longest_seconds": 30}
    assert sum(Fraction(d["gpu_hours"]) for d in body["daily"]) == Fraction(3, 4)
    page = service.get("lena", "teams/vision", headers=BROWSER)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    text = html.unescape(page.text)
    assert page.text.count("<svg") == 3 and "Members of vision" in text
    assert "1 run waited in the queue, 30 s." in text
    assert "as its lead" in text and "0.75 GPU-h" in text and "0.75 %" in text  # of the 100 GPU-h budget
    assert "alice" in text and "api/teams/vision/bill?format=html" in page.text


def test_a_member_sees_their_team_as_a_member(service):
    """alice (a member, not the lead) on her team's page: the team's totals, days and queue, not each member's."""
    page = service.get("alice", "teams/vision", headers=BROWSER)
    assert page.status_code == 200, page.text
    text = html.unescape(page.text)
    assert "Team vision" in text and "as a member" in text
    assert "0.75 GPU-h" in text and "0.75 %" in text and "you: 0.5 GPU-h, 1.60 EUR" in text
    assert "1 run waited in the queue, 30 s." in text
    assert page.text.count("<svg") == 2 and "Members of vision" not in text and "/bill" not in page.text
    report = service.get("alice", "api/teams/vision/report")
    assert report.status_code == 200, report.text
    body = report.json()
    assert "users" not in body and "top_consumers" not in body and body["gpu_hours"] == "0.75"
    assert "lena" not in report.text


def test_admin_report_top_consumers_rank_by_gpu_hours(service):
    # nadia's open quarter (since up to 10 h ago) passes alice's 0.5 GPU-h once it has run over 2 h this month.
    ran = utcnow() - service.seeded_from
    if ran < timedelta(hours=3):
        pytest.skip(f"the seeded usage ranks nadia first only after 3 h of the month; {ran} had passed (UTC)")
    body = service.get("admin", "api/admin/report", params={"top": "2"}).json()
    assert [c["user"] for c in body["top_consumers"]] == ["nadia", "alice"]  # nadia's interval still runs


def test_admin_report_utilisation_per_model_per_day(service):
    report = service.get("admin", "api/admin/report", params={"top": "2"})
    assert report.status_code == 200, report.text
    body = report.json()
    assert body["capacity_cards"] == {"H200": 2}
    days = body["utilisation_daily"]["H200"]
    assert days[-1]["day"] == utcnow().date().isoformat()
    allocated = sum(Fraction(d["allocated_gpu_hours"]) for d in days)
    # Days add up to the period, to the rounding of each figure (0.005 GPU-h each; nadia's open interval makes
    # the figures depend on when they are read, so no exact sum of rounded days can be asserted).
    total = Fraction(body["utilisation"]["H200"]["allocated_gpu_hours"])
    assert abs(allocated - total) <= Fraction(len(days) + 1, 200)
    for day in days:
        assert Fraction(day["allocated_gpu_hours"]) <= Fraction(day["capacity_gpu_hours"])
    assert body["queue_waits"] == {"vision": {"runs": 1, "mean_seconds": "30.0", "longest_seconds": 30}}
    page = service.get("admin", "admin", headers=BROWSER)
    assert page.status_code == 200 and page.text.count("<svg") == 4
    text = html.unescape(page.text)
    assert "Teams: share of their budget used in" in text and "budget 100 %" in text
    assert "H200: utilisation per day (2 cards)" in text and "allocated / capacity" in text
    assert re.search(r">\d+(\.\d+)?%</text>", page.text), "the utilisation axis is in percent"
    assert not re.search(r"""(src|href)=["']?https?:|url\(["']?https?:|@import""", page.text), "nothing from outside"


def test_admin_replays_a_months_usage_under_the_current_and_another_policies_folder(service, tmp_path):
    period = period_of(utcnow())  # the seeded runs are this month's
    page = service.get("admin", "admin/replay", params={"period": period}, headers=BROWSER)
    assert page.status_code == 200, page.text[-2000:]
    assert 'id="replay"' in page.text and page.text.count('<svg role="img"') == 1
    assert "current policies: utilisation and queue over time" in page.text
    jobs = int(re.search(r"\((\d+) runs\)", page.text)[1])
    assert jobs == 7  # alice's and lena's runs (the 0 s ones too) and nadia's, still running: every run billed
    assert re.search(r"<td>current policies</td><td>\(all\)</td><td class=\"num\">7</td>", page.text)

    beside = service.policies.parent  # an admin's other policy sets lie beside the platform's own
    bigger = beside / "bigger"
    bigger.mkdir(exist_ok=True)
    (bigger / "policy.yaml").write_text(POLICY.replace("count: 2", "count: 8"))
    both = service.get("admin", "admin/replay", params={"period": period, "policies": str(bigger)}, headers=BROWSER)
    assert both.status_code == 200 and both.text.count('<svg role="img"') == 2
    assert f"<td>{bigger}</td><td>(all)</td>" in both.text
    assert 'class="num differs"' in both.text  # four times the cards: the utilisation differs

    missing = service.get("admin", "admin/replay", params={"policies": "/no/such/folder"}, headers=BROWSER)
    assert missing.status_code == 400 and "no policies folder" in missing.text and "<html" in missing.text
    # Not any folder of the server, nor a link out of the folder beside: the page reads policies, not any YAML.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "policy.yaml").write_text("secret: not a policy\n")
    sneaky = beside / "sneaky"
    sneaky.mkdir(exist_ok=True)
    (sneaky / "policy.yaml").unlink(missing_ok=True)
    (sneaky / "policy.yaml").symlink_to(elsewhere / "policy.yaml")
    for folder in (elsewhere, sneaky):
        refused = service.get("admin", "admin/replay", params={"policies": str(folder)})
        assert refused.status_code == 400 and "beside the platform's own" in refused.json()["message"], refused.text
        assert "secret" not in refused.text
    broken = beside / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "policy.yaml").write_text(POLICY.replace("count: 2", "count: two"))
    refused = service.get("admin", "admin/replay", params={"policies": str(broken)})
    assert refused.status_code == 400 and "policy.yaml:" in refused.json()["message"]
    assert service.get("lena", "admin/replay", headers=BROWSER).status_code == 403


def test_a_members_usage_page_shows_their_own_usage_and_cost(service):
    page = service.get("alice", "", headers=BROWSER)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    text = html.unescape(page.text)
    assert re.search(r'id="my-gpu-hours">0.5 GPU-h<', page.text), "her own GPU-hours, not the team's"
    assert re.search(r'id="my-cost">1.60 EUR<', page.text), "0.5 GPU-h × 3.20 EUR"
    assert "Your running servers" in text and "None." in text
    assert "you: 0.5 GPU-h, 1.60 EUR" in text and "0.75 %" in text  # the team's 0.75 of 100 GPU-h, in percent
    # nadia's interval runs: her page lists the server with its share and its cost so far in the currency
    nadia = service.get("nadia", "", headers=BROWSER).text
    assert re.search(r'id="my-running">1<', nadia)
    assert re.search(r"<td>h200-quarter</td><td>nlp</td><td>0.25 × H200</td>", nadia)
    assert re.search(r'<td class="num">\d+\.\d\d EUR</td>', nadia)


def test_page_shows_budget_alerts(service):
    # nadia's open interval (0.25 of a card, reserving 4 hours) has used up nlp's 1 GPU-hour budget.
    page = html.unescape(service.get("nadia", "").text)
    assert 'role="alert"' in page
    assert 'team "nlp" has used 80% of its budget of 1 GPU-hours' in page
    assert 'team "nlp" has used 100% of its budget' in page
    assert "vision" not in page


# --- who may see which route: routing alone, on SQLite ----------------------------------------------------------

#: Every route that names a team, as a member of vision (not its lead) asks for it.
TEAM_ROUTES = ["api/teams/{}", "api/teams/{}/bill", "api/teams/{}/report", "teams/{}"]


@pytest.mark.parametrize("path", [r.format(t) for r in TEAM_ROUTES for t in ("nlp", "robotics")]
                         + ["api/teams/vision/bill"])
def test_other_teams_data_is_not_found(sqlite_service, path):
    reply = sqlite_service.get("alice", path)
    assert reply.status_code == 404
    assert "nadia" not in reply.text


@pytest.mark.parametrize("path", ["api/teams/nlp", "api/teams/nlp/bill", "api/teams/nlp/report", "teams/nlp"])
def test_a_lead_sees_nothing_of_other_teams(sqlite_service, path):
    reply = sqlite_service.get("lena", path)
    assert reply.status_code == 404 and "nadia" not in reply.text
    # the same answer as for a team that does not exist: nothing leaks
    unknown = sqlite_service.get("lena", path.replace("nlp", "X"))
    assert reply.json()["message"].replace("nlp", "X") == unknown.json()["message"]


@pytest.mark.parametrize("user", ["nadia", "lena"])
@pytest.mark.parametrize("path", ["api/teams", "metrics", "api/admin/report", "admin", "admin/replay"])
def test_admin_routes_are_forbidden_to_members_and_leads(sqlite_service, path, user):
    assert sqlite_service.get(user, path).status_code == 403


def test_a_token_the_hub_does_not_know_gets_no_data(sqlite_service):
    """The hub answers 403 for a token it does not know: the service treats its bearer as not logged in."""
    reply = requests.get(f"{sqlite_service.url}{PREFIX}api/me", headers={"Authorization": "token forged"},
                         timeout=60, allow_redirects=False)
    assert reply.status_code == 302 and "/hub/api/oauth2/authorize" in reply.headers["Location"]
    assert "alice" not in reply.text and "GPU" not in reply.text


@pytest.mark.parametrize("path, status", [("teams/nlp", 404), ("teams/robotics", 404), ("admin", 403),
                                          ("no/such/page", 404)])
def test_errors_are_html_for_browsers_and_json_for_api_clients(sqlite_service, path, status):
    page = sqlite_service.get("alice", path, headers=BROWSER)
    assert page.status_code == status and page.headers["Content-Type"].startswith("text/html")
    assert f"<h1>{status} :" in page.text and 'id="jupyterhub-logo"' in page.text and "nadia" not in page.text
    api = sqlite_service.get("alice", {"admin": "api/admin/report", "no/such/page": "api/no/such"}.get(
        path, "api/" + path), headers=BROWSER)
    assert api.status_code == status and api.json()["status"] == status, "the api/ prefix answers JSON"
    client = sqlite_service.get("alice", path, headers={"Accept": "application/json"})
    assert client.status_code == status and client.json()["status"] == status


def test_bad_input_gets_4xx(sqlite_service):
    assert sqlite_service.get("alice", "api/me", params={"period": "2026-13"}).status_code == 400
    for top in ("0", "101", "ten", "-1"):
        reply = sqlite_service.get("admin", "api/admin/report", params={"top": top})
        assert reply.status_code == 400 and "top must be a whole number from 1 to 100" in reply.json()["message"]
    assert sqlite_service.get("lena", "api/teams/vision/report", params={"period": "26-11"}).status_code == 400
    assert sqlite_service.get("lena", "api/teams/vision/bill", params={"format": "pdf"}).status_code == 400
    big = requests.request("GET", f"{sqlite_service.url}{PREFIX}api/me", data=b"x" * 200_000, timeout=60,
                           headers={"Authorization": "token token-alice"})
    assert big.status_code in (400, 413)


def test_browser_without_login_goes_to_the_hub_login(sqlite_service):
    reply = sqlite_service.get(None, "")
    assert reply.status_code == 302
    assert reply.headers["Location"].startswith("/hub/api/oauth2/authorize?"), reply.headers["Location"]
    assert "client_id=service-accounting" in reply.headers["Location"]


def test_page_shows_charts(sqlite_service):
    page = sqlite_service.get("lena", "", headers=BROWSER)
    assert page.status_code == 200
    text = html.unescape(page.text)
    assert page.text.count("<svg") == 1 and "Team vision: GPU-hours in" in text
    assert "budget 100 GPU-h" in text, "the budget line is labelled with its value"
    assert ">GPU-h</text>" in page.text, "the axis names its unit"


def test_openapi_description(sqlite_service):
    spec = requests.get(f"{sqlite_service.url}{PREFIX}openapi.json", timeout=60).json()
    assert {"/api/me", "/api/teams/{team}/bill", "/api/teams/{team}/report", "/api/admin/report", "/admin",
            "/teams/{team}", "/metrics"} <= set(spec["paths"])


def test_pages_are_hub_pages(sqlite_service):
    """The hub's page template: its stylesheet, logo, navigation bar with Home and Services, a way back."""
    page = sqlite_service.get("alice", "", headers=BROWSER).text
    assert '<link rel="stylesheet" href="/hub/static/css/style.min.css"' in page
    assert 'id="jupyterhub-logo"' in page and 'href="/hub/home">Home</a>' in page
    assert 'href="/services/accounting/">accounting</a>' in page, "the Services menu, as on the hub's pages"
    assert 'href="/hub/logout"' in page and ">Back to the hub</a>" in page
    assert 'href="/hub/admin"' not in page  # the Admin link is for admins, as on the hub
    assert 'href="/hub/admin"' in sqlite_service.get("admin", "", headers=BROWSER).text


def svg_texts(page: str, label: str) -> list[str]:
    """The text elements of the chart whose aria-label contains `label`."""
    (chart,) = [c for c in re.findall(r"<svg .*?</svg>", page, flags=re.S) if label in c.split(">", 1)[0]]
    return [html.unescape(t).strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", chart)]


def test_the_daily_chart_labels_every_day_and_its_axes(sqlite_service):
    page = sqlite_service.get("lena", "teams/vision", headers=BROWSER).text
    texts = svg_texts(page, "GPU-hours per day")
    today = utcnow()
    days = [str(d) for d in range(1, today.day + 1)]
    assert texts[:len(days)] == days, "one label per day of the month so far"
    assert f"day of {today.strftime('%B %Y')} (UTC)" in texts and "GPU-h" in texts
    assert "budget 100 GPU-h" in svg_texts(page, "Team vision: GPU-hours in")


def test_a_user_in_no_team_is_told_how_to_join_one(sqlite_service):
    """The usage page of a user in no team names the leads and the command; an admin in no team is told what an
    admin does. (The hub's own home and spawn pages say it too: tests/e2e/test_accounting_service.py.)"""
    page = sqlite_service.get("sam", "", headers=BROWSER)
    assert page.status_code == 200 and "You are in no team yet" in page.text
    assert "vision: lena" in html.unescape(page.text) and "gpupool team add-member TEAM sam" in page.text
    assert sqlite_service.get("sam", "teams/vision", headers=BROWSER).status_code == 404
    usage = " ".join(html.unescape(sqlite_service.get("admin", "", headers=BROWSER).text).split())
    assert "You are an administrator: put yourself in a team with" in usage and "add-member TEAM admin" in usage
    assert "the teams: nlp, vision." in usage and "or an admin to add you" not in usage, usage[-3000:]
