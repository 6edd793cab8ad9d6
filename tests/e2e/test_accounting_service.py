"""The `gpupool-accounting` service behind a real JupyterHub: the person's path, once per kind of role.

The hub (started by `gpupool up`) runs the service as a managed service; requests go through the real
proxy with real JupyterHub tokens of real hub users, and Chromium logs in through the hub's login form. The
ledger (SQLite) is seeded directly with known intervals. Who may see which route, every page's and API's
figures on SQLite and PostgreSQL, and bad input are tested in-process: tests/unit/hub/test_accounting_routes.py.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import requests

from gpupool.hub.accounting.ledger import Ledger
from gpupool.policies.periods import period_of, utcnow
from accounting_seed import POLICY as SEEDED_POLICY, seed
from harness import Hub

POLICY = {"policy.yaml": SEEDED_POLICY}
PASSWORD = "a-test-password"
# Browsers log in with JupyterHub's DummyAuthenticator (as in test_mlflow_service.py); tokens work as before.
SELF = ('c.LocalGPUSpawner.run_as = "self"\n'
        f'c.JupyterHub.authenticator_class = "dummy"\nc.DummyAuthenticator.password = {PASSWORD!r}\n')
#: What a browser sends when it opens a page.
BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
REPO_ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO_ROOT / "docs" / "screenshots"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub(tmp_path_factory.mktemp("accounting"), POLICY, SELF, mlflow=False)
    hub.start()
    ledger = Ledger(hub.ledger_url)
    seed(ledger)
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


def test_a_member_reads_her_usage_and_her_team_through_the_hub(hub):
    """alice, a member, with her own hub token through the proxy: her figures, her team's, no other team's."""
    me = get(hub, "alice", "api/me")
    assert me.status_code == 200, me.text
    body = me.json()
    assert body["user"] == "alice" and body["gpu_hours"] == "0.5" and body["cost"] == "1.60"
    assert [team["team"] for team in body["teams"]] == ["vision"] and "users" not in body["teams"][0]
    page = get(hub, "alice", "", headers=BROWSER)
    assert page.status_code == 200 and re.search(r'id="my-gpu-hours">0.5 GPU-h<', page.text)
    assert 'href="/services/accounting/">accounting</a>' in page.text, "the hub's navigation bar"
    for path in ("api/teams/nlp", "teams/nlp", "api/teams/vision/bill"):
        reply = get(hub, "alice", path)
        assert reply.status_code == 404 and "nadia" not in reply.text, path
    assert get(hub, "alice", "api/admin/report").status_code == 403


def test_a_lead_reads_the_members_report_and_bill_through_the_hub(hub):
    report = get(hub, "lena", "api/teams/vision/report")
    assert report.status_code == 200, report.text
    assert report.json()["users"] == {"alice": "0.5", "lena": "0.25"}
    bill = get(hub, "lena", "api/teams/vision/bill", params={"format": "json"})
    assert bill.status_code == 200 and bill.json()["total"] == "2.40", bill.text  # 0.75 GPU-hours × 3.20
    assert get(hub, "lena", "api/teams/nlp").status_code == 404
    assert get(hub, "lena", "metrics").status_code == 403


def test_an_admin_reads_every_team_and_both_metrics_through_the_hub(hub):
    teams = get(hub, "admin", "api/teams")
    assert teams.status_code == 200, teams.text
    assert [t["team"] for t in teams.json()["teams"]] == ["vision", "nlp"]
    metrics = requests.get(f"{hub.url}/hub/metrics", headers={"Authorization": f"token {token_of(hub, 'admin')}"},
                           timeout=30).text
    for name in ("gpupool_queue_length", "gpupool_queue_wait_seconds", "gpupool_ledger_write_errors"):
        assert f"# TYPE {name}" in metrics, name
    service = get(hub, "admin", "metrics").text
    assert 'gpupool_budget_used_ratio{team="vision"} 0.0075' in service
    assert 'gpupool_reconcile_errors_total{step="hub"} 0.0' in service, "the service reconciles with the hub"


def test_browser_without_login_goes_to_the_hub_login(hub):
    reply = get(hub, None, "")
    assert reply.status_code == 302
    assert "/hub/api/oauth2/authorize" in reply.headers["Location"] or "/hub/login" in reply.headers["Location"]
    # followed, the hub's OAuth sends the browser to the hub's login page
    landed = requests.get(f"{hub.url}/services/accounting/", headers=BROWSER, timeout=30)
    assert landed.status_code == 200 and "/hub/login" in landed.url, landed.url


def test_a_user_in_no_team_is_told_how_to_join_one(hub):
    """On the hub's own pages (the usage page's side: tests/unit/hub/test_accounting_routes.py)."""
    hub.api("POST", "/users/sam")
    page = get(hub, "sam", "", headers=BROWSER)
    assert page.status_code == 200 and "You are in no team yet" in page.text
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
