"""The `gpupool-accounting` service behind a real JupyterHub: who sees what, bills, metrics, bad input.

The hub (started by `gpupool up`) runs the service as a managed service; requests go through the real
proxy with real JupyterHub tokens of real hub users. The ledger is seeded directly with known intervals,
once in SQLite and once in a real PostgreSQL started by the test setup.
"""

from __future__ import annotations

import html
import re
import shutil
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import pytest
import requests

from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.accounting.periods import period_of, utcnow
from gpupool.hub.harness import Hub

POLICY = {
    "policy.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 2}]
teams:
  vision: {members: [alice, lena], leads: [lena], budget: {gpu_hours: 100}}
  nlp: {members: [nadia], budget: {gpu_hours: 1, on_exhausted: deny}}
profiles:
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision, nlp]}
billing: {prices: {H200: '3.20'}}
""",
}
PASSWORD = "a-test-password"
# Browsers log in with JupyterHub's DummyAuthenticator (as in test_mlflow_service.py); tokens work as before.
SELF = ('c.LocalGPUSpawner.run_as = "self"\n'
        f'c.JupyterHub.authenticator_class = "dummy"\nc.DummyAuthenticator.password = {PASSWORD!r}\n')
#: What a browser sends when it opens a page.
BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
REPO_ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO_ROOT / "docs" / "screenshots"


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def hub(request, tmp_path_factory):
    ledger_url = None
    if request.param == "postgresql":
        ledger_url = request.getfixturevalue("postgres_server").create_database("accounting")
    hub = Hub(tmp_path_factory.mktemp("accounting"), POLICY, SELF, ledger_url=ledger_url, mlflow=False)
    hub.backend = request.param
    hub.start()
    now = utcnow().replace(microsecond=0)
    # Two finished intervals and a running one, all this month (the first hours of a month are enough).
    start = max(now - timedelta(hours=10), now.replace(day=1, hour=0, minute=0, second=0))
    hub.seeded_from = start
    ledger = Ledger(hub.ledger_url)
    ledger.open_interval("alice-1", "alice", "vision", "h200-quarter", "H200", Fraction(1, 4), start)
    ledger.close_interval("alice-1", start + timedelta(seconds=7200), "stopped")  # 0.5 GPU-h
    ledger.open_interval("lena-1", "lena", "vision", "h200-quarter", "H200", Fraction(1, 4), start)
    ledger.close_interval("lena-1", start + timedelta(seconds=3600), "stopped")  # 0.25 GPU-h
    # Reserving 4 hours: nlp's 1 GPU-hour budget counts as used from the start, however early in the month this runs.
    ledger.open_interval("nadia-1", "nadia", "nlp", "h200-quarter", "H200", Fraction(1, 4), start,
                         reserve=timedelta(hours=4))
    # A run of lena's that queued 30 s and ended at once: a queue wait on record, no GPU-hours.
    ledger.keep_run("lena/@seeded", "lena", "vision", "h200-quarter", "H200", Fraction(1, 4), start, start,
                    queue_wait=timedelta(seconds=30))
    ledger.close_run("lena/@seeded", start, "stopped")
    # Three of alice's runs placed at once (a wait of 0 s on record): they did not wait, and must not count.
    for n in range(3):
        ledger.keep_run(f"alice/@at-once-{n}", "alice", "vision", "h200-quarter", "H200", Fraction(1, 4), start,
                        start, queue_wait=timedelta(0))
        ledger.close_run(f"alice/@at-once-{n}", start, "stopped")
    ledger.dispose()
    yield hub
    hub.stop()


def token_of(hub: Hub, user: str) -> str:
    hub.api("POST", f"/users/{user}")
    reply = hub.api("POST", f"/users/{user}/tokens", json={"note": "test"})
    assert reply.status_code == 201, reply.text
    return reply.json()["token"]


def get(hub: Hub, user: str | None, path: str, headers: dict | None = None, **kw) -> requests.Response:
    headers = {**({"Authorization": f"token {token_of(hub, user)}"} if user else {}), **(headers or {})}
    return requests.get(f"{hub.url}/services/accounting/{path}", headers=headers, timeout=30,
                        allow_redirects=False, **kw)


def test_a_member_sees_own_usage_and_team_totals(hub):
    me = get(hub, "alice", "api/me")
    assert me.status_code == 200, me.text
    body = me.json()
    assert body["user"] == "alice" and body["gpu_hours"] == "0.5"
    (vision,) = body["teams"]
    assert vision["team"] == "vision" and vision["gpu_hours"] == "0.75" and "users" not in vision
    assert vision["budget_gpu_hours"] == "100"


def test_a_lead_sees_the_members_and_the_bill(hub):
    team = get(hub, "lena", "api/teams/vision").json()
    assert team["users"] == {"alice": "0.5", "lena": "0.25"}
    bill = get(hub, "lena", "api/teams/vision/bill", params={"format": "json"})
    assert bill.status_code == 200, bill.text
    assert bill.json()["total"] == "2.40"  # 0.75 GPU-hours × 3.20
    csv = get(hub, "lena", "api/teams/vision/bill", params={"format": "csv"})
    assert csv.headers["Content-Type"].startswith("text/csv") and "alice" in csv.text


def test_the_bill_as_csv_is_linked_from_the_pages_and_downloads_under_its_name(hub):
    """The lead on their team's and usage pages, the admin on All teams: each page links the CSV bill, which
    comes as a file named for its team and month, the same bill as the JSON; a member sees no bill link."""
    period = period_of(utcnow())
    name = f'attachment; filename="gpupool-bill-vision-{period}.csv"'
    lena, admin = token_of(hub, "lena"), token_of(hub, "admin")
    pages = [(lena, "teams/vision", 'id="bill-csv"'), (lena, "", 'data-bill-csv="vision"'), (admin, "admin", None),
             (lena, f"api/teams/vision/bill?format=html&period={period}", 'class="download"')]
    for token, path, marker in pages:
        url = f"{hub.url}/services/accounting/{path}"
        page = requests.get(url, headers={"Authorization": f"token {token}", **BROWSER}, timeout=30)
        assert page.status_code == 200 and (marker is None or marker in page.text), (path, page.text[-3000:])
        links = [html.unescape(h) for h in re.findall(r'href="([^"]*format=csv[^"]*)"', page.text)]
        link = next((h for h in links if "teams/vision/" in h or h.startswith("?")), None)
        assert link is not None, (path, links)
        csv = requests.get(requests.compat.urljoin(url, link), headers={"Authorization": f"token {token}"}, timeout=30)
        assert csv.status_code == 200 and csv.headers["Content-Type"].startswith("text/csv"), (path, link, csv.text)
        assert csv.headers["Content-Disposition"] == name, (path, csv.headers)
        assert csv.text.splitlines()[-1].startswith(f"total,vision,{period},") and ",2.40,EUR" in csv.text
    # The admin's page links every team's.
    page = requests.get(f"{hub.url}/services/accounting/admin", headers={"Authorization": f"token {admin}"}, timeout=30)
    assert f"api/teams/nlp/bill?format=csv&amp;period={period}" in page.text
    # A member who is not a lead: no bill on their pages (the bill is for leads and admins).
    for path in ("", "teams/vision"):
        assert "format=csv" not in get(hub, "alice", path, headers=BROWSER).text


#: Every route that names a team, as a member of vision (not its lead) asks for it.
TEAM_ROUTES = ["api/teams/{}", "api/teams/{}/bill", "api/teams/{}/report", "teams/{}"]


@pytest.mark.parametrize("path", [r.format(t) for r in TEAM_ROUTES for t in ("nlp", "robotics")]
                         + ["api/teams/vision/bill"])
def test_other_teams_data_is_not_found(hub, path):
    reply = get(hub, "alice", path)
    assert reply.status_code == 404
    assert "nadia" not in reply.text


@pytest.mark.parametrize("path", ["api/teams/nlp", "api/teams/nlp/bill", "api/teams/nlp/report", "teams/nlp"])
def test_a_lead_sees_nothing_of_other_teams(hub, path):
    reply = get(hub, "lena", path)
    assert reply.status_code == 404 and "nadia" not in reply.text
    # the same answer as for a team that does not exist: nothing leaks
    assert reply.json()["message"].replace("nlp", "X") == get(hub, "lena", path.replace("nlp", "X")).json()["message"]


@pytest.mark.parametrize("user", ["nadia", "lena"])
@pytest.mark.parametrize("path", ["api/teams", "metrics", "api/admin/report", "admin"])
def test_admin_routes_are_forbidden_to_members_and_leads(hub, path, user):
    assert get(hub, user, path).status_code == 403


def test_admin_sees_all_teams_utilisation_and_metrics(hub):
    teams = get(hub, "admin", "api/teams")
    assert teams.status_code == 200, teams.text
    body = teams.json()
    assert [t["team"] for t in body["teams"]] == ["vision", "nlp"]
    assert body["utilisation"]["H200"]["allocated_gpu_hours"] != "0"
    metrics = get(hub, "admin", "metrics").text
    assert 'gpupool_allocated_shares{model="H200",team="nlp"} 0.25' in metrics
    assert 'gpupool_budget_used_ratio{team="vision"} 0.0075' in metrics


def test_a_lead_sees_the_team_report_and_page(hub):
    report = get(hub, "lena", "api/teams/vision/report")
    assert report.status_code == 200, report.text
    body = report.json()
    assert body["users"] == {"alice": "0.5", "lena": "0.25"}
    assert body["top_consumers"] == [{"team": "vision", "user": "alice", "gpu_hours": "0.5"},
                                     {"team": "vision", "user": "lena", "gpu_hours": "0.25"}]
    # one run waited 30 s, three were placed at once: only the one that waited counts
    assert body["queue_waits"] == {"runs": 1, "mean_seconds": "30.0", "longest_seconds": 30}
    assert sum(Fraction(d["gpu_hours"]) for d in body["daily"]) == Fraction(3, 4)
    page = get(hub, "lena", "teams/vision", headers=BROWSER)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    text = html.unescape(page.text)
    assert page.text.count("<svg") == 3 and "Members of vision" in text
    assert "1 run waited in the queue, 30 s." in text
    assert "as its lead" in text and "0.75 GPU-h" in text and "0.75 %" in text  # of the 100 GPU-h budget
    assert "alice" in text and "api/teams/vision/bill?format=html" in page.text


def test_a_member_sees_their_team_as_a_member(hub):
    """alice (a member, not the lead) on her team's page: the team's totals, days and queue, not each member's."""
    page = get(hub, "alice", "teams/vision", headers=BROWSER)
    assert page.status_code == 200, page.text
    text = html.unescape(page.text)
    assert "Team vision" in text and "as a member" in text
    assert "0.75 GPU-h" in text and "0.75 %" in text and "you: 0.5 GPU-h, 1.60 EUR" in text
    assert "1 run waited in the queue, 30 s." in text
    assert page.text.count("<svg") == 2 and "Members of vision" not in text and "/bill" not in page.text
    report = get(hub, "alice", "api/teams/vision/report")
    assert report.status_code == 200, report.text
    body = report.json()
    assert "users" not in body and "top_consumers" not in body and body["gpu_hours"] == "0.75"
    assert "lena" not in report.text


def test_admin_report_top_consumers_rank_by_gpu_hours(hub):
    # nadia's open quarter (since up to 10 h ago) passes alice's 0.5 GPU-h once it has run over 2 h this month.
    ran = utcnow() - hub.seeded_from
    if ran < timedelta(hours=3):
        pytest.skip(f"the seeded usage ranks nadia first only after 3 h of the month; {ran} had passed (UTC)")
    body = get(hub, "admin", "api/admin/report", params={"top": "2"}).json()
    assert [c["user"] for c in body["top_consumers"]] == ["nadia", "alice"]  # nadia's interval still runs


def test_admin_report_utilisation_per_model_per_day(hub):
    report = get(hub, "admin", "api/admin/report", params={"top": "2"})
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
    page = get(hub, "admin", "admin", headers=BROWSER)
    assert page.status_code == 200 and page.text.count("<svg") == 4
    text = html.unescape(page.text)
    assert "Teams: share of their budget used in" in text and "budget 100 %" in text
    assert "H200: utilisation per day (2 cards)" in text and "allocated / capacity" in text
    assert re.search(r">\d+(\.\d+)?%</text>", page.text), "the utilisation axis is in percent"
    assert not re.search(r"""(src|href)=["']?https?:|url\(["']?https?:|@import""", page.text), "nothing from outside"


def test_admin_replays_a_months_usage_under_the_current_and_another_policies_folder(hub, tmp_path):
    period = period_of(utcnow())  # the seeded runs are this month's
    page = get(hub, "admin", "admin/replay", params={"period": period}, headers=BROWSER)
    assert page.status_code == 200, page.text[-2000:]
    assert 'id="replay"' in page.text and page.text.count('<svg role="img"') == 1
    assert "current policies: utilisation and queue over time" in page.text
    jobs = int(re.search(r"\((\d+) runs\)", page.text)[1])
    assert jobs == 7  # alice's and lena's runs (the 0 s ones too) and nadia's, still running: every run billed
    assert re.search(r"<td>current policies</td><td>\(all\)</td><td class=\"num\">7</td>", page.text)

    beside = hub.policies.parent  # an admin's other policy sets lie beside the platform's own
    bigger = beside / "bigger"
    bigger.mkdir(exist_ok=True)
    (bigger / "policy.yaml").write_text(POLICY["policy.yaml"].replace("count: 2", "count: 8"))
    both = get(hub, "admin", "admin/replay", params={"period": period, "policies": str(bigger)}, headers=BROWSER)
    assert both.status_code == 200 and both.text.count('<svg role="img"') == 2
    assert f"<td>{bigger}</td><td>(all)</td>" in both.text
    assert 'class="num differs"' in both.text  # four times the cards: the utilisation differs

    missing = get(hub, "admin", "admin/replay", params={"policies": "/no/such/folder"}, headers=BROWSER)
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
        refused = get(hub, "admin", "admin/replay", params={"policies": str(folder)})
        assert refused.status_code == 400 and "beside the platform's own" in refused.json()["message"], refused.text
        assert "secret" not in refused.text
    broken = beside / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "policy.yaml").write_text(POLICY["policy.yaml"].replace("count: 2", "count: two"))
    refused = get(hub, "admin", "admin/replay", params={"policies": str(broken)})
    assert refused.status_code == 400 and "policy.yaml:" in refused.json()["message"]
    assert get(hub, "lena", "admin/replay", headers=BROWSER).status_code == 403


def test_hub_metrics_has_the_queue_and_ledger_error_metrics(hub):
    metrics = requests.get(f"{hub.url}/hub/metrics", headers={"Authorization": f"token {token_of(hub, 'admin')}"},
                           timeout=30).text
    for name in ("gpupool_queue_length", "gpupool_queue_wait_seconds", "gpupool_ledger_write_errors"):
        assert f"# TYPE {name}" in metrics, name
    service = get(hub, "admin", "metrics").text
    # one run waited 30 s; the three placed at once are not waits (they made it "4 runs, 7.5 s" before)
    assert 'gpupool_queue_waited_runs{team="vision"} 1.0' in service
    assert 'gpupool_queue_wait_mean_seconds{team="vision"} 30.0' in service
    assert 'gpupool_reconcile_errors_total{step="hub"} 0.0' in service, "the service reconciles with the hub"


def test_bad_input_gets_4xx(hub):
    assert get(hub, "alice", "api/me", params={"period": "2026-13"}).status_code == 400
    for top in ("0", "101", "ten", "-1"):
        reply = get(hub, "admin", "api/admin/report", params={"top": top})
        assert reply.status_code == 400 and "top must be a whole number from 1 to 100" in reply.json()["message"]
    assert get(hub, "lena", "api/teams/vision/report", params={"period": "26-11"}).status_code == 400
    assert get(hub, "lena", "api/teams/vision/bill", params={"format": "pdf"}).status_code == 400
    big = requests.request("GET", f"{hub.url}/services/accounting/api/me", data=b"x" * 200_000, timeout=30,
                           headers={"Authorization": f"token {token_of(hub, 'alice')}"})
    assert big.status_code in (400, 413)


def test_browser_without_login_goes_to_the_hub_login(hub):
    reply = get(hub, None, "")
    assert reply.status_code == 302
    assert "/hub/api/oauth2/authorize" in reply.headers["Location"] or "/hub/login" in reply.headers["Location"]


def test_page_shows_charts(hub):
    page = get(hub, "lena", "", headers=BROWSER)
    assert page.status_code == 200
    text = html.unescape(page.text)
    assert page.text.count("<svg") == 1 and "Team vision: GPU-hours in" in text
    assert "budget 100 GPU-h" in text, "the budget line is labelled with its value"
    assert ">GPU-h</text>" in page.text, "the axis names its unit"


def test_page_shows_budget_alerts(hub):
    # nadia's open interval (0.25 of a card, reserving 4 hours) has used up nlp's 1 GPU-hour budget.
    page = html.unescape(get(hub, "nadia", "").text)
    assert 'role="alert"' in page
    assert 'team "nlp" has used 80% of its budget of 1 GPU-hours' in page
    assert 'team "nlp" has used 100% of its budget' in page
    assert "vision" not in page


def test_openapi_description(hub):
    spec = requests.get(f"{hub.url}/services/accounting/openapi.json", timeout=30).json()
    assert {"/api/me", "/api/teams/{team}/bill", "/api/teams/{team}/report", "/api/admin/report", "/admin",
            "/teams/{team}", "/metrics"} <= set(spec["paths"])


def test_period_is_current_month(hub):
    assert get(hub, "alice", "api/me").json()["period"] == period_of(utcnow())


# --- the pages as people see them --------------------------------------------------------------------------


def svg_texts(page: str, label: str) -> list[str]:
    """The text elements of the chart whose aria-label contains `label`."""
    (chart,) = [c for c in re.findall(r"<svg .*?</svg>", page, flags=re.S) if label in c.split(">", 1)[0]]
    return [html.unescape(t).strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", chart)]


def test_a_members_usage_page_shows_their_own_usage_and_cost(hub):
    page = get(hub, "alice", "", headers=BROWSER)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    text = html.unescape(page.text)
    assert re.search(r'id="my-gpu-hours">0.5 GPU-h<', page.text), "her own GPU-hours, not the team's"
    assert re.search(r'id="my-cost">1.60 EUR<', page.text), "0.5 GPU-h × 3.20 EUR"
    assert "Your running servers" in text and "None." in text
    assert "you: 0.5 GPU-h, 1.60 EUR" in text and "0.75 %" in text  # the team's 0.75 of 100 GPU-h, in percent
    # nadia's interval runs: her page lists the server with its share and its cost so far in the currency
    nadia = get(hub, "nadia", "", headers=BROWSER).text
    assert re.search(r'id="my-running">1<', nadia)
    assert re.search(r"<td>h200-quarter</td><td>nlp</td><td>0.25 × H200</td>", nadia)
    assert re.search(r'<td class="num">\d+\.\d\d EUR</td>', nadia)
    assert get(hub, "alice", "api/me").json()["cost"] == "1.60"


def test_pages_are_hub_pages(hub):
    """The hub's page template: its stylesheet, logo, navigation bar with Home and Services, a way back."""
    page = get(hub, "alice", "", headers=BROWSER).text
    assert '<link rel="stylesheet" href="/hub/static/css/style.min.css"' in page
    assert 'id="jupyterhub-logo"' in page and 'href="/hub/home">Home</a>' in page
    assert 'href="/services/accounting/">accounting</a>' in page, "the Services menu, as on the hub's pages"
    assert 'href="/hub/logout"' in page and ">Back to the hub</a>" in page
    assert 'href="/hub/admin"' not in page  # the Admin link is for admins, as on the hub
    assert 'href="/hub/admin"' in get(hub, "admin", "", headers=BROWSER).text


@pytest.mark.parametrize("path, status", [("teams/nlp", 404), ("teams/robotics", 404), ("admin", 403),
                                          ("no/such/page", 404)])
def test_errors_are_html_for_browsers_and_json_for_api_clients(hub, path, status):
    page = get(hub, "alice", path, headers=BROWSER)
    assert page.status_code == status and page.headers["Content-Type"].startswith("text/html")
    assert f"<h1>{status} :" in page.text and 'id="jupyterhub-logo"' in page.text and "nadia" not in page.text
    api = get(hub, "alice", {"admin": "api/admin/report", "no/such/page": "api/no/such"}.get(path, "api/" + path),
              headers=BROWSER)
    assert api.status_code == status and api.json()["status"] == status, "the api/ prefix answers JSON"
    client = get(hub, "alice", path, headers={"Accept": "application/json"})
    assert client.status_code == status and client.json()["status"] == status


def test_the_daily_chart_labels_every_day_and_its_axes(hub):
    page = get(hub, "lena", "teams/vision", headers=BROWSER).text
    texts = svg_texts(page, "GPU-hours per day")
    today = utcnow()
    days = [str(d) for d in range(1, today.day + 1)]
    assert texts[:len(days)] == days, "one label per day of the month so far"
    assert f"day of {today.strftime('%B %Y')} (UTC)" in texts and "GPU-h" in texts
    assert "budget 100 GPU-h" in svg_texts(page, "Team vision: GPU-hours in")


def test_a_user_in_no_team_is_told_how_to_join_one(hub):
    hub.api("POST", "/users/sam")
    page = get(hub, "sam", "", headers=BROWSER)
    assert page.status_code == 200 and "You are in no team yet" in page.text
    assert "vision: lena" in html.unescape(page.text) and "gpupool team add-member TEAM sam" in page.text
    assert get(hub, "sam", "teams/vision", headers=BROWSER).status_code == 404
    # The hub's home page (it takes no token for pages: log in as a browser does, with the login form)
    home = logged_in(hub, "sam").get(f"{hub.url}/hub/home", headers=BROWSER, timeout=30)
    assert home.status_code == 200 and home.url.endswith("/hub/home"), home.url
    assert 'id="gpupool-no-team"' in home.text and 'id="start"' not in home.text, "no Start button that ends in 403"
    assert "gpupool team add-member TEAM sam" in home.text
    member = logged_in(hub, "alice").get(f"{hub.url}/hub/home", headers=BROWSER, timeout=30)
    assert 'id="start"' in member.text and "gpupool-no-team" not in member.text
    # Once added to a team (what `gpupool team add-member` does: the hub group), the next visit has the button.
    tom = logged_in(hub, "tom")
    assert "gpupool-no-team" in tom.get(f"{hub.url}/hub/home", headers=BROWSER, timeout=30).text
    assert hub.api("POST", "/groups/vision/users", json={"users": ["tom"]}).status_code == 200
    home = tom.get(f"{hub.url}/hub/home", headers=BROWSER, timeout=30).text
    assert 'id="start"' in home and "gpupool-no-team" not in home
    # The hub's admin in no team is not sent to "ask an admin": told what an admin does, on each page.
    usage = " ".join(html.unescape(get(hub, "admin", "", headers=BROWSER).text).split())
    assert "You are an administrator: put yourself in a team with" in usage and "add-member TEAM admin" in usage
    assert "the teams: nlp, vision." in usage and "or an admin to add you" not in usage, usage[-3000:]
    admin = logged_in(hub, "admin")
    for page in ("home", "spawn"):
        text = admin.get(f"{hub.url}/hub/{page}", headers=BROWSER, timeout=30).text
        assert 'id="gpupool-admin-join"' in text and "gpupool team add-member TEAM admin" in text, text[-3000:]
        assert "or an administrator to add you" not in text and 'hub/admin"' in text, page


def logged_in(hub: Hub, user: str) -> requests.Session:
    """A session logged in through the hub's login form (its _xsrf cookie and field included)."""
    session = requests.Session()
    session.get(f"{hub.url}/hub/login", timeout=30)
    reply = session.post(f"{hub.url}/hub/login", timeout=30, data={
        "username": user, "password": PASSWORD, "_xsrf": session.cookies.get("_xsrf", path="/hub/")})
    assert reply.status_code == 200 and "/hub/login" not in reply.url, reply.url
    return session


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver; "
                    "`make install` does it as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def browse_as(hub: Hub, browser, user: str, path: str):
    """Log in through the hub's login form as `user` (a fresh session) and open `path`."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{hub.url}/hub/logout")
    browser.delete_all_cookies()
    browser.get(f"{hub.url}{path}")
    WebDriverWait(browser, 60).until(expected_conditions.url_contains("/hub/login"))
    browser.find_element(By.ID, "username_input").send_keys(user)
    browser.find_element(By.ID, "password_input").send_keys(PASSWORD)
    browser.find_element(By.ID, "login_submit").click()
    WebDriverWait(browser, 120).until(lambda b: path.split("?")[0] in b.current_url and "/login" not in b.current_url)
    return WebDriverWait(browser, 60).until(lambda b: b.find_element(By.TAG_NAME, "body").text)


def shoot(browser, name: str) -> Path:
    """A screenshot of the whole page into docs/screenshots/ (made by the test run, so the docs stay current)."""
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 1280, "height": max(700, min(height, 4000)), "deviceScaleFactor": 1, "mobile": False})
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    browser.save_screenshot(str(path))
    browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    return path


def test_the_pages_in_a_browser(hub, browser):
    """As a member, a lead, an admin and a user in no team, in Chromium: what each reads on the pages."""
    from selenium.webdriver.common.by import By

    if hub.backend != "sqlite":
        pytest.skip("the pages are the same on PostgreSQL; one browser pass is enough")
    body = browse_as(hub, browser, "alice", "/services/accounting/")
    assert "Your GPU usage" in body and "0.5 GPU-h" in body and "1.60 EUR" in body, body
    assert "Home" in body and "Services" in body and "Logout" in body, "the hub's navigation bar"
    assert browser.find_element(By.ID, "jupyterhub-logo").is_displayed()
    shots = [shoot(browser, "usage-member")]
    browser.get(f"{hub.url}/services/accounting/teams/vision")
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "as a member" in body and "1 run waited in the queue, 30 s." in body and "Members of" not in body
    shots.append(shoot(browser, "team-member"))
    browser.get(f"{hub.url}/services/accounting/teams/nlp")
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "404" in body and "Not Found" in body and "{" not in body, "the hub's error page, not JSON"
    shots.append(shoot(browser, "not-found"))

    body = browse_as(hub, browser, "nadia", "/services/accounting/")
    assert "Servers running now\n1" in body and "0.25 × H200" in body and "EUR" in body, body
    assert 'team "nlp" has used 100% of its budget' in body
    shots.append(shoot(browser, "usage-running-server"))

    body = browse_as(hub, browser, "lena", "/services/accounting/teams/vision")
    assert "as its lead" in body and "Top consumers" in body and "alice" in body
    shots.append(shoot(browser, "team-lead"))

    body = browse_as(hub, browser, "admin", "/services/accounting/admin")
    assert "All teams" in body and "Queue waits" in body and "vision" in body and "nlp" in body
    shots.append(shoot(browser, "admin"))
    # What if: the page's link to a month replayed (followed by its address: it lies below the fold)
    browser.get(browser.find_element(By.ID, "replay-link").get_attribute("href"))
    browser.find_element(By.ID, "period").clear()
    browser.find_element(By.ID, "period").send_keys(period_of(utcnow()))
    browser.find_element(By.CSS_SELECTOR, "#replay-form button").click()
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 120).until(lambda b: "period=" in b.current_url)
    body = WebDriverWait(browser, 60).until(lambda b: b.find_element(By.TAG_NAME, "body").text)
    assert "replayed" in body and "(all)" in body and "Usage" in body, body  # the table, and the tabs still link
    assert browser.find_element(By.LINK_TEXT, "Usage").get_attribute("href").endswith("/services/accounting/")
    shots.append(shoot(browser, "admin-replay"))

    body = browse_as(hub, browser, "sam", "/hub/home")
    assert "You are in no team yet" in body and "Start My Server" not in body
    shots.append(shoot(browser, "home-no-team"))
    for shot in shots:
        assert shot.stat().st_size > 10_000, shot  # a rendered page, not an empty one
