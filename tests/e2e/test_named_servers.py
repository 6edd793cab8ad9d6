"""Named servers: several servers per user, each with its own profile, one user against the quotas; sharing a
server within its team.

The first tests check the pure parts (the share rule, the named-server limit, the hub configuration); the rest
drive one real `gpupool up` (JupyterHub, proxy, JupyterLab servers) through its REST API with each user's own
token and through its pages with each user's login, as people and their scripts do. Those are the steps of one
story, in order: each starts from the servers the steps before it left.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import requests
from traitlets.config import Config

from gpupool.hub.accounting.ledger import Ledger, run_server
from gpupool.hub.config import PlatformSettings, apply_config, named_server_limit
from gpupool.policies.periods import period_bounds, period_of, utcnow
from harness import Browser, Hub, wait_for
from ordinary_user import ordinary_user
from gpupool.policies import DEFAULT_POLICY_DIR, load_policy
from gpupool.policies.sharing import SHARE_CODES_REFUSED, share_refusal
from gpupool.spawner import volcano
from gpupool.spawner.volcano import wiring_notes
from gpupool.spawner.wiring import sharing_roles

POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}\n"
                 "inventory:\n  - {model: H200, count: 2}\n",
    "teams.yaml": """
teams:
  vision:
    priority: 100
    quota: {gpus: 2, per_user_gpus: 0.5}
    named_servers: 4
    sharing: true
  nlp: {priority: 50, quota: {gpus: 1, per_user_gpus: 1}}
  solo: {named_servers: 0}
  ops: {priority: 10, quota: {gpus: 1, per_user_gpus: 0.25}}
""",
    "profiles.yaml": """
profiles:
  cpu: {display_name: CPU only, teams: [vision, nlp, solo, ops], default: true}
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision, nlp, ops]}
""",
    "billing.yaml": "billing: {prices: {H200: '3.20'}}\n",
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("named-policies")
    for name, text in POLICY.items():
        (directory / name).write_text(text)
    return directory


# --- the pure parts ------------------------------------------------------------------------------------------


def test_a_member_gets_the_largest_named_server_limit_of_their_teams(policy):
    loaded = load_policy(policy)
    assert loaded.named_server_limit(["vision"]) == 4
    assert loaded.named_server_limit(["nlp"]) == 2  # the default
    assert loaded.named_server_limit(["solo", "nlp"]) == 2
    assert loaded.named_server_limit(["solo"]) == 0
    assert loaded.named_server_limit([]) == 0


def test_the_hub_limit_is_the_one_of_the_user_in_the_path(policy):
    """JupyterHub calls the limit with the request's handler: the user whose servers are asked for counts."""
    users = {"alice": SimpleNamespace(name="alice", groups=[SimpleNamespace(name="vision")]),
             "carol": SimpleNamespace(name="carol", groups=[SimpleNamespace(name="nlp")])}
    limit = named_server_limit(policy)

    def handler(path_args, current):
        return SimpleNamespace(path_args=path_args, find_user=users.get, current_user=users.get(current))

    assert limit(handler(["carol", "x"], "alice")) == 2  # alice (or an admin) spawning for carol: carol's limit
    assert limit(handler([], "alice")) == 4  # the home page: the user asking
    assert limit(handler([], None)) == 0


def test_only_teams_that_allow_sharing_get_the_shares_scope(policy, tmp_path):
    c = Config()
    apply_config(c, PlatformSettings(state_dir=tmp_path / "state", policy_dir=policy))
    assert c.JupyterHub.allow_named_servers is True
    assert callable(c.JupyterHub.named_server_limit_per_user)
    assert c.GPUPoolHub.policy_dir == str(policy)
    sharing = [r for r in c.JupyterHub.load_roles if r["name"].startswith("gpupool-sharing-")]
    assert sharing == sharing_roles(load_policy(policy)) == [{
        "name": "gpupool-sharing-vision",
        "description": "members of team vision may share their servers with the team",
        "scopes": ["shares!user", "read:users:name!group=vision", "read:groups:name!group=vision"],
        "groups": ["vision"],
    }]
    user_role = next(r for r in c.JupyterHub.load_roles if r["name"] == "user")
    assert not [s for s in user_role["scopes"] if s.startswith("shares")]


def test_gpupool_hub_serves_gpupool_pages_whatever_its_configuration(monkeypatch):
    """The Kubernetes hub (z2jh's configuration names no template path) gets the pages the embedded one gets:
    the progress page whose Stop stops that page's server (issue 33 item 1)."""
    from jupyterhub.app import JupyterHub

    from gpupool.hub.app import GPUPoolHub
    from gpupool.hub.config import TEMPLATES

    from jinja2 import Environment, FileSystemLoader

    jupyterhubs = JupyterHub()._template_paths_default()[0]
    monkeypatch.setattr(JupyterHub, "init_tornado_settings", lambda self: None)
    # None: not configured (z2jh), JupyterHub's default, its own folder alone
    for configured in (None, [], ["/srv/branding"], [str(TEMPLATES)], ["/srv/branding", jupyterhubs]):
        hub = GPUPoolHub() if configured is None else GPUPoolHub(template_paths=list(configured))
        hub.init_tornado_settings()
        # JupyterHub then adds its own folder when missing; the first folder that has a page serves it
        paths = [*hub.template_paths, *([jupyterhubs] if jupyterhubs not in hub.template_paths else [])]
        served = FileSystemLoader(paths).get_source(Environment(), "spawn_pending.html")[1]
        assert served == str(TEMPLATES / "spawn_pending.html"), (configured, paths)
        branding = [p for p in configured or [] if p != jupyterhubs]  # an admin's own pages still come first
        assert paths[:len(branding)] == branding, paths
    assert volcano.jupyterhub_values(load_policy(DEFAULT_POLICY_DIR), volcano.Release())["hub"]["args"][0] == \
        "gpupool-hub"


def test_the_kubernetes_mode_says_that_it_does_not_share(policy):
    (note,) = wiring_notes(load_policy(policy))
    assert note.startswith("teams vision allow sharing servers (teams.TEAM.sharing)")


def test_a_server_is_shared_within_the_team_it_runs_for(policy):
    loaded = load_policy(policy)
    assert share_refusal(loaded, "alice", "train", "vision", user="bob", user_teams=["vision"]) is None
    assert share_refusal(loaded, "alice", "train", "vision", group="vision") is None
    outside = share_refusal(loaded, "alice", "train", "vision", user="carol", user_teams=["nlp"])
    assert outside == ("carol is not a member of team 'vision', which alice/train runs for: servers are shared "
                       "within their team only (teams.vision.sharing)")
    assert "not with group 'nlp'" in share_refusal(loaded, "alice", "train", "vision", group="nlp")
    off = share_refusal(loaded, "carol", "", "nlp", user="dora", user_teams=["nlp"])
    assert off.startswith("sharing is off for team 'nlp', which carol's default server runs for")
    assert "(teams.nlp.sharing)" in off
    assert "has not run for a team yet" in share_refusal(loaded, "alice", "new", None, user="bob", user_teams=["vision"])
    assert "no longer have" in share_refusal(loaded, "alice", "old", "robotics", user="bob", user_teams=["vision"])


# --- a real hub ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory, policy):
    hub = Hub(tmp_path_factory.mktemp("named"), POLICY, 'c.LocalGPUSpawner.run_as = "self"', mlflow=False)
    hub.start()
    yield hub
    for user in hub.api("GET", "/users").json():
        for server in user["servers"]:
            hub.api("DELETE", hub.server_path(user["name"], server))
    hub.stop()
    for process in psutil.process_iter(["cmdline"]):  # no server outlives the test
        if str(hub.state) in " ".join(process.info["cmdline"] or []):
            process.kill()


SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
#: erin's quota is one quarter H200: a second quarter of hers waits in the queue.
TEAMS = {"alice": "vision", "bob": "vision", "carol": "nlp", "dave": "solo", "erin": "ops"}
QUARTER = "0.25 × H200"


@pytest.fixture(scope="module")
def sessions(hub):
    """Each person signed up, approved by the admin and logged in (their browser's cookies), in their team."""
    sessions = hub.sign_up(list(TEAMS), "named-servers-test")
    for user, team in TEAMS.items():
        hub.add_user(user, team)
    return sessions


@pytest.fixture(scope="module")
def tokens(hub, sessions):
    """Each person's own API token (the hub's Token page), for their REST calls."""
    return {user: hub.user_token(user) for user in TEAMS}


def as_user(hub, token: str, method: str, path: str, **kw) -> requests.Response:
    """A REST request (`path` from the root: `/hub/api/…`, `/user/…`, `/services/…`) with a user's token."""
    return requests.request(method, f"{hub.url}{path}", headers={"Authorization": f"token {token}", **kw.pop(
        "headers", {})}, timeout=60, allow_redirects=False, **kw)


def page(hub, session: requests.Session, method: str, path: str, **kw) -> requests.Response:
    """A page as the person's browser asks for it (their login cookie; forms carry `_xsrf`)."""
    if method == "POST":
        kw["data"] = {**kw.get("data", {}), "_xsrf": session.cookies.get("_xsrf", "")}
    reply = session.request(method, f"{hub.url}{path}", timeout=60, allow_redirects=False, **kw)
    reply.encoding = "utf-8"  # the hub's pages are UTF-8 without saying so in Content-Type
    return reply


def test_two_named_servers_with_their_own_profiles_run_at_once_within_the_users_quota(hub, sessions, tokens):
    alice = tokens["alice"]
    # The spawn form of a named server offers the profiles of alice's team, and starts the one she picks.
    form = page(hub, sessions["alice"], "GET", "/hub/spawn/alice/notebook")
    assert form.status_code == 200 and "CPU only" in form.text and "0.25 × H200" in form.text, form.text[-2000:]
    started = page(hub, sessions["alice"], "POST", "/hub/spawn/alice/notebook", data={"profile": "cpu"})
    assert started.status_code == 302, started.text[-2000:]
    # The REST API: the named server `train` with the quarter share.
    reply = as_user(hub, alice, "POST", "/hub/api/users/alice/servers/train", json={"profile": "h200-quarter"})
    assert reply.status_code in (201, 202), reply.text
    notebook = hub.wait_ready("alice", server="notebook")
    train = hub.wait_ready("alice", server="train")
    assert notebook["user_options"] == {"profile": "cpu", "team": "vision"}
    assert train["user_options"] == {"profile": "h200-quarter", "team": "vision"}
    assert set(hub.allocations()) == {"alice/train"}  # the CPU-only server holds no card

    # alice may hold 0.5 at once (quota.per_user_gpus): a second quarter fits, a third waits for one of hers.
    assert as_user(hub, alice, "POST", "/hub/api/users/alice/servers/train-b",
                   json={"profile": "h200-quarter"}).status_code in (201, 202)
    hub.wait_ready("alice", server="train-b")
    assert set(hub.allocations()) == {"alice/train", "alice/train-b"}
    assert as_user(hub, alice, "POST", "/hub/api/users/alice/servers/train-c",
                   json={"profile": "h200-quarter"}).status_code in (201, 202)
    events = hub.progress_until("alice", lambda e: "position" in e.get("message", ""), server="train-c")
    assert events[-1]["message"] == (
        'Waiting for 0.25 × H200: position 1 of 1 in queue "vision" '
        '(alice holds 0.5 of 0.5 GPUs allowed per member of team "vision" (quota))'
    )
    assert "alice/train-c" not in hub.allocations(), "the cards have room: only alice's own quota holds it back"

    # Stopping one of her servers frees its share for the waiting one; the others keep running.
    hub.stop_server("alice", 120, server="train-b")
    hub.wait_ready("alice", server="train-c")
    assert set(hub.allocations()) == {"alice/train", "alice/train-c"}
    assert hub.server("alice", "train")["ready"] and hub.server("alice", "notebook")["ready"]
    assert as_user(hub, alice, "GET", "/user/alice/train/api/status").status_code == 200
    hub.stop_server("alice", 120, server="train-c")
    assert set(hub.allocations()) == {"alice/train"}


def test_the_named_server_limit_comes_from_the_teams_policy(hub, sessions, tokens):
    # alice has notebook, train, train-b and train-c (stopped ones count: JupyterHub keeps them until deleted)
    fifth = as_user(hub, tokens["alice"], "POST", "/hub/api/users/alice/servers/fifth", json={"profile": "cpu"})
    assert fifth.status_code == 400 and "already has the maximum of 4 named servers" in fifth.json()["message"]
    # team solo allows none (named_servers: 0); JupyterHub reads 0 as "no limit", so the spawner refuses.
    named = as_user(hub, tokens["dave"], "POST", "/hub/api/users/dave/servers/pad", json={"profile": "cpu"})
    assert named.status_code == 403, named.text
    assert "allow no named servers (teams.TEAM.named_servers is 0)" in named.json()["message"]
    home = page(hub, sessions["dave"], "GET", "/hub/home")
    assert home.status_code == 200 and "Add New Server" not in home.text
    assert "Add New Server" in page(hub, sessions["carol"], "GET", "/hub/home").text


def named_servers(hub, token: str, user: str) -> list[str]:
    """The named servers of `user` as the REST API lists them with the stopped ones (which JupyterHub counts)."""
    listed = as_user(hub, token, "GET", f"/hub/api/users/{user}", params={"include_stopped_servers": "1"})
    assert listed.status_code == 200, listed.text
    return sorted(name for name in listed.json()["servers"] if name)


def test_opening_the_spawn_page_of_a_new_name_makes_no_server(hub, sessions, tokens):
    """Issue 33 item 11: JupyterHub made the named server when its spawn page was opened; those stopped servers
    counted against the limit until deleted, so bob, having looked at four forms, could start none."""
    bob = tokens["bob"]
    for name in ("look-1", "look-2", "look-3", "look-4", "look-5"):  # one more than his teams' limit of 4
        form = page(hub, sessions["bob"], "GET", f"/hub/spawn/bob/{name}")
        assert form.status_code == 200 and "0.25 × H200" in form.text, form.text[-2000:]
    assert named_servers(hub, bob, "bob") == []
    # The form posted still makes and starts the server, within the untouched limit.
    started = page(hub, sessions["bob"], "POST", "/hub/spawn/bob/look-2", data={"profile": "cpu"})
    assert started.status_code == 302, started.text[-2000:]
    assert hub.wait_ready("bob", server="look-2")["user_options"] == {"profile": "cpu", "team": "vision"}
    removed = as_user(hub, bob, "DELETE", "/hub/api/users/bob/servers/look-2", json={"remove": True})
    assert removed.status_code in (202, 204), removed.text
    wait_for(lambda: named_servers(hub, bob, "bob") == [], 120, message="bob's look-2 was not removed")


def test_the_home_page_the_ledger_and_the_usage_page_show_each_server(hub, sessions, tokens):
    alice = tokens["alice"]
    home = page(hub, sessions["alice"], "GET", "/hub/home")
    assert home.status_code == 200, home.text[-2000:]
    table = home.text[home.text.index('id="gpupool-servers"'):]
    rows = dict(re.findall(r'<tr data-gpupool-server="([^"]*)">(.*?)</tr>', table, re.S))
    assert set(rows) == {"notebook", "train"}, table[:3000]
    assert "CPU only" in rows["notebook"] and "no GPU" in rows["notebook"] and "0.00 EUR" in rows["notebook"]
    assert "0.25 × H200" in rows["train"] and "0.25 × H200</td>" in rows["train"] and " EUR</td>" in rows["train"]
    assert "vision" in rows["train"]

    # The ledger keys each run by user, server and start: one run per start of a GPU server.
    ledger = Ledger(hub.ledger_url, migrate=False)
    start, end = period_bounds(period_of(utcnow()))
    runs = {run_server(i.run): i for i in ledger.intervals_overlapping(start, end, user="alice", team="vision")}
    assert set(runs) == {"train", "train-b", "train-c"}
    assert runs["train"].is_open and runs["train"].profile == "h200-quarter"
    assert runs["train-b"].how == "stopped" and runs["train-c"].how == "stopped"

    # The usage page (the accounting service) names the running server.
    hub.wait_service("accounting", "health")
    me = as_user(hub, alice, "GET", "/services/accounting/api/me")
    assert me.status_code == 200, me.text
    (running,) = me.json()["running"]
    assert running["server"] == "train" and running["profile"] == "h200-quarter"
    usage = as_user(hub, alice, "GET", "/services/accounting/", headers={"Accept": "text/html"})
    assert usage.status_code == 200 and '<tr data-server="train"><td>train</td>' in usage.text, usage.text[-3000:]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, one for the module's pages (each test logs in as its person)."""
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    browser = Browser(chromium, driver)
    yield browser
    browser.quit()


def test_the_home_page_in_a_browser(hub, sessions, browser):
    """alice's home page in headless Chromium, with her two servers; its screenshot goes into docs/screenshots/."""
    browser.log_in_as(hub.url, sessions["alice"])
    browser.start_recording()
    browser.get(f"{hub.url}/hub/home")
    text = browser.wait_for_text("Your running servers")
    browser.wait_page_loaded()
    assert "notebook" in text and "train" in text and "CPU only" in text and "0.25 × H200" in text, text
    assert not browser.failed_requests(), browser.failed_requests()
    assert not browser.console_errors(), browser.console_errors()
    browser.screenshot_whole_page(SCREENSHOTS / "home-named-servers.png")


def test_sharing_is_off_unless_the_team_allows_it(hub, tokens):
    carol = tokens["carol"]
    assert as_user(hub, carol, "POST", "/hub/api/users/carol/servers/pad", json={"profile": "cpu"}).status_code \
        in (201, 202)
    hub.wait_ready("carol", server="pad")
    refused = as_user(hub, carol, "POST", "/hub/api/shares/carol/pad", json={"user": "alice"})
    assert refused.status_code == 403, refused.text  # team nlp says nothing: no `shares` scope at all
    assert "requires any of [shares]" in refused.json()["message"]
    # Share codes are refused even where sharing is on: whoever holds a code could accept it.
    code = as_user(hub, tokens["alice"], "POST", "/hub/api/share-codes/alice/train", json={})
    assert code.status_code == 403 and code.json()["message"] == SHARE_CODES_REFUSED


def test_a_server_is_shared_with_teammates_only(hub, tokens):
    alice, bob, carol = tokens["alice"], tokens["bob"], tokens["carol"]
    # (bob's first visit comes after the share: the server remembers what a token may do for a few minutes)
    shared = as_user(hub, alice, "POST", "/hub/api/shares/alice/train", json={"user": "bob"})
    assert shared.status_code == 200, shared.text
    assert shared.json()["user"]["name"] == "bob"
    assert as_user(hub, bob, "GET", "/user/alice/train/api/status").status_code == 200

    outside = as_user(hub, alice, "POST", "/hub/api/shares/alice/train", json={"user": "carol"})
    assert outside.status_code == 403
    assert outside.json()["message"] == ("carol is not a member of team 'vision', which alice/train runs for: "
                                         "servers are shared within their team only (teams.vision.sharing)")
    assert as_user(hub, carol, "GET", "/user/alice/train/api/status").status_code in (403, 404)
    assert as_user(hub, alice, "POST", "/hub/api/shares/alice/train", json=["bob"]).status_code == 400
    assert as_user(hub, alice, "POST", "/hub/api/shares/alice/train", json={"person": "bob"}).status_code == 400
    group = as_user(hub, alice, "POST", "/hub/api/shares/alice/train", json={"group": "nlp"})
    assert group.status_code == 403 and "not with group 'nlp'" in group.json()["message"]
    assert as_user(hub, alice, "POST", "/hub/api/shares/alice/train", json={"group": "vision"}).status_code == 200
    listed = as_user(hub, alice, "GET", "/hub/api/shares/alice/train").json()["items"]
    assert sorted((s["user"] or {}).get("name") or s["group"]["name"] for s in listed) == ["bob", "vision"]
    # Revoking is JupyterHub's own.
    assert as_user(hub, alice, "DELETE", "/hub/api/shares/alice/train").status_code == 204
    assert as_user(hub, alice, "GET", "/hub/api/shares/alice/train").json()["items"] == []


def test_stopping_a_named_server_ends_its_run_and_keeps_the_others(hub, sessions):
    hub.stop_server("alice", 120, server="train")
    assert not hub.allocations()
    assert hub.server("alice", "notebook")["ready"]
    ledger = Ledger(hub.ledger_url, migrate=False)
    assert not [i for i in ledger.open_intervals() if i.user == "alice"]
    home = page(hub, sessions["alice"], "GET", "/hub/home").text
    rows = dict(re.findall(r'<tr data-gpupool-server="([^"]*)">(.*?)</tr>', home, re.S))
    assert set(rows) == {"notebook"}


def test_shares_the_policy_no_longer_allows_are_revoked_when_the_server_starts_again(hub, tokens):
    alice = tokens["alice"]
    assert as_user(hub, alice, "POST", "/hub/api/shares/alice/notebook", json={"user": "bob"}).status_code == 200
    # The team turns sharing off: new shares are refused at once (the policies are read again when they change)...
    teams = hub.policies / "teams.yaml"
    teams.write_text(teams.read_text().replace("sharing: true", "sharing: false"))
    again = as_user(hub, alice, "POST", "/hub/api/shares/alice/notebook", json={"group": "vision"})
    assert again.status_code == 403 and again.json()["message"].startswith("sharing is off for team 'vision'")
    # ...and the shares made before end when the server starts again.
    hub.stop_server("alice", 120, server="notebook")
    assert as_user(hub, alice, "POST", "/hub/api/users/alice/servers/notebook",
                   json={"profile": "cpu"}).status_code in (201, 202)
    hub.wait_ready("alice", server="notebook")
    assert as_user(hub, alice, "GET", "/hub/api/shares/alice/notebook").json()["items"] == []
    assert "Revoking the share of alice:notebook with bob: sharing is off for team 'vision'" in hub.log.read_text()


# --- Stop on the progress page (issue 33 item 1) --------------------------------------------------------------


def stop_while_queued(hub: Hub, browser: Browser, user: str, server: str = "") -> str:
    """`user` (logged in in `browser`) picks the quarter H200 on the spawn page of their server `server` ("": the
    default one), the request waits in the queue, and they press the progress page's Stop Server: the page's
    text once it has answered."""
    from selenium.common.exceptions import WebDriverException

    def said(selector: str) -> str:
        try:
            found = browser.css(selector)
            return found[0].text if found else ""
        except WebDriverException:  # between two pages
            return ""

    path = f"{user}/{server}" if server else user
    browser.get(f"{hub.url}/hub/spawn/{path}")
    browser.wait_for_text(QUARTER)
    label = next(e for e in browser.css("#spawn_form label") if QUARTER in e.text)
    label.find_element("css selector", "input[type=radio]").click()
    browser.click("#spawn_form [type=submit]")
    browser.wait(lambda d: f"/spawn-pending/{path}" in d.current_url, 120,
                 f"the spawn did not go to the progress page: {browser.driver.current_url}\n{browser.text()[:2000]}")
    browser.wait(lambda d: "position 1 of 1" in said("#progress-message"), 300,
                 f"the progress page never showed the queue:\n{browser.text()[:2000]}")
    browser.click("#stop-server-btn")
    try:
        browser.wait(lambda d: "will not start" in said("#stop-server-status")
                     and said("#progress-message") == "Spawn cancelled", 180)
    except Exception:
        raise AssertionError(f"after Stop Server, {browser.driver.current_url} does not say that the wait was "
                             f"cancelled; it shows:\n{browser.text()[:2000]}") from None
    return browser.text()


def cancel_both_waits(hub: Hub, browser: Browser, user: str, rest) -> None:
    """The person's path of issue 33 item 1: `user`, whose team allows one quarter H200 per person, stops a queued
    named server on its progress page while their default server runs, then a queued default server while a
    named one runs. `rest(method, path)`: a REST call from the root (`/hub/api/…`, `/user/…`) with a token of
    theirs or the hub's."""

    def queue_length() -> int:
        reply = rest("GET", f"/hub/api/users/{user}/availability")
        assert reply.status_code == 200, reply.text
        return reply.json()["queue_length"]

    assert rest("POST", f"/hub/api/users/{user}/server", json={"profile": "h200-quarter"}).status_code in (201, 202)
    hub.wait_ready(user)
    text = stop_while_queued(hub, browser, user, "second")
    assert "The server \u201csecond\u201d will not start" in text, text
    wait_for(lambda: hub.server(user, "second") is None, 120, message=f"{user}'s second is still there")
    assert (hub.server(user) or {}).get("ready"), f"{user}'s running default server was stopped: {hub.server(user)}"
    assert rest("GET", f"/user/{user}/api/status").status_code == 200  # its JupyterLab answers
    assert queue_length() == 0
    assert sorted(key for key in hub.allocations() if key.startswith(f"{user}/")) == [f"{user}/"]

    # The default server's page: its Stop stops it alone, while a named server holds the user's quarter.
    hub.stop_server(user, 120)
    assert rest("POST", f"/hub/api/users/{user}/servers/first", json={"profile": "h200-quarter"}).status_code in (
        201, 202)
    hub.wait_ready(user, server="first")
    text = stop_while_queued(hub, browser, user)
    assert "The default server will not start" in text, text
    wait_for(lambda: hub.server(user) is None, 120, message=f"{user}'s default server is still there")
    assert (hub.server(user, "first") or {}).get("ready"), f"{user}'s first was stopped: {hub.server(user, 'first')}"
    assert rest("GET", f"/user/{user}/first/api/status").status_code == 200
    assert queue_length() == 0
    assert sorted(key for key in hub.allocations() if key.startswith(f"{user}/")) == [f"{user}/first"]
    hub.stop_server(user, 120, server="first")


def test_stop_on_a_queued_servers_progress_page_stops_that_server_alone(hub, sessions, tokens, browser):
    browser.log_in_as(hub.url, sessions["erin"])
    cancel_both_waits(hub, browser, "erin", lambda method, path, **kw: as_user(hub, tokens["erin"], method, path, **kw))


@pytest.fixture(scope="module")
def ordinary_hub():
    """A hub run by an ordinary Unix user (the journey's, made when missing) on this module's policies; its
    admin, the one account such a hub has, is in team ops."""
    hub_user, problem = ordinary_user()
    if problem:
        pytest.skip(problem)
    unix_user = hub_user if os.geteuid() == 0 else None
    # Not under pytest's tmp_path, whose parents are private to the tests' user: the hub's user owns the tree.
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-named-ordinary-"))
    os.chmod(tmp, 0o755)
    hub = Hub(tmp, POLICY, mlflow=False, unix_user=unix_user)
    if unix_user:
        account = pwd.getpwnam(unix_user)
        for path in [tmp, *tmp.rglob("*")]:
            os.chown(path, account.pw_uid, account.pw_gid)
    try:
        hub.start()
        assert hub.api("POST", "/groups/ops/users", json={"users": ["admin"]}).status_code == 200
        yield hub
    finally:
        try:
            for server in (hub.api("GET", "/users/admin").json().get("servers") or {}):
                hub.stop_server("admin", 60, server=server)
        except (requests.RequestException, ValueError, AssertionError):
            pass  # the hub is gone already
        hub.stop()
        hub.kill_leftovers()
        shutil.rmtree(tmp, ignore_errors=True)


def test_stop_on_a_queued_servers_progress_page_stops_that_server_alone_with_the_hub_run_by_an_ordinary_user(
        ordinary_hub, browser):
    hub = ordinary_hub
    browser.log_in_as(hub.url, hub.log_in("admin", hub.admin_password()))
    cancel_both_waits(hub, browser, "admin",
                      lambda method, path, **kw: hub.session.request(method, f"{hub.url}{path}", timeout=60, **kw))
