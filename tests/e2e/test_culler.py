"""The GPU-aware idle culler on one real `gpupool up` (two H200 cards declared, so no GPU): the culler service runs
as the hub starts it, with its README scopes, and reads GPU use through a TEST DOUBLE of NVML
(tests/nvml_double/pynvml.py) that reports per-process samples for the PIDs a test names.

- an idle server is warned (home page, culler API, webhook), then stopped: its interval ends `culled` and the
  request waiting in the queue starts;
- a server whose processes keep the (double's) GPU busy, with no HTTP activity at all, is not stopped;
- "keep it" postpones the stop within the policy's `keep_max_hours`, then is refused with the reason.

The policy's times are minutes, as an admin writes them; the culler's clock (`tests/culler_clock.py`) lets them pass
a step at a time, each step seen by a look of the culler, instead of the test waiting them out.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from datetime import datetime, timedelta
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import requests

from culler_clock import CullerClock, seen_by_culler, step_until
from gpupool.hub.accounting.culls import IdleStore
from gpupool.hub.accounting.ledger import HowEnded, Ledger
from gpupool.hub.services.accounting_service import idle_report
from gpupool.policies import periods
from harness import Browser, Hub, wait_for

DOUBLE = Path(__file__).resolve().parents[1] / "nvml_double"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
CARDS = ["GPU-double-0000", "GPU-double-0001"]
PEOPLE = ("alice", "bob", "carol")


def policy(webhook: str) -> dict[str, str]:
    return {
        "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [whole]}\n"
                     f"inventory:\n  - {{model: H200, count: 2, uuids: {json.dumps(CARDS)}}}\n",
        "teams.yaml": "teams:\n  vision: {quota: {gpus: 4, per_user_gpus: 1}}\n",
        # bob's profile has a rule of its own (before the pool's): stopped after 30 min idle, warned 10 min before,
        # kept half an hour at most.
        "profiles.yaml": "profiles:\n  h200: {display_name: 1 × H200, gpu: {model: H200, count: 1}, teams: [vision]}\n"
                         "  h200-patient: {display_name: 1 × H200 (patient), gpu: {model: H200, count: 1}, "
                         "teams: [vision], idle: {after_minutes: 30, warn_minutes: 10, cpu_below_percent: 20, "
                         "keep_max_hours: 0.5}}\n",
        # Stopped after 20 min idle, warned 10 min before. CPU under 20% of a core is idle: a JupyterLab server
        # reporting its kernels every second costs a little.
        "settings.yaml": f"settings:\n  alert_webhook: {webhook}\n"
                         "  idle: {after_minutes: 20, warn_minutes: 10, cpu_below_percent: 20, keep_max_hours: 1}\n",
    }


class Webhook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):
        self.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def webhook():
    """The alert webhook's receiver: its URL, and the JSON bodies it got."""
    server = HTTPServer(("127.0.0.1", 0), Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook", Webhook.received
    server.shutdown()


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    """The NVML double's file: the cards, and the SM utilisation it reports per PID."""
    path = tmp_path_factory.mktemp("nvml") / "samples.json"
    path.write_text(json.dumps({"cards": CARDS, "utilization": {"*": 60}}))  # every process busy, until said
    return path


@pytest.fixture(scope="module")
def clock(tmp_path_factory) -> CullerClock:
    """The culler's clock: three hours behind the system's, more than the test may let pass (160 minutes at most,
    in steps of ten, the rules' warning window: the test stops at each warning it waits for)."""
    return CullerClock(tmp_path_factory.mktemp("clock") / "culler-clock", behind=timedelta(hours=3))


@pytest.fixture(scope="module")
def hub(tmp_path_factory, webhook, samples, clock):
    extra = f"""
c.LocalGPUSpawner.run_as = "self"
for service in c.JupyterHub.services:
    if service["name"] == "culler":  # a pass a second, its clock the test's, and the NVML double first on its path
        service["command"] = service["command"] + ["--interval=1"] + {clock.culler_args!r}
        service["environment"] = {{**service["environment"], "PYTHONPATH": {str(DOUBLE)!r},
                                   "GPUPOOL_NVML_DOUBLE": {str(samples)!r}}}
# Servers report their kernels every second (every minute by default).
c.Spawner.environment = {{**c.Spawner.environment, "GPUPOOL_IDLE_REPORT_SECONDS": "1"}}
"""
    hub = Hub(tmp_path_factory.mktemp("culler"), policy(webhook[0]), extra, mlflow=False)
    hub.start()
    try:
        yield hub
    finally:
        hub.stop()
        hub.kill_leftovers()  # the servers a stopped hub leaves running


@pytest.fixture(scope="module")
def people(hub):
    sessions = hub.sign_up(list(PEOPLE), "culler-test-password")
    for name in PEOPLE:
        hub.add_user(name, "vision")
    return sessions, {name: hub.user_token(name) for name in PEOPLE}


def spawn(hub: Hub, token: str, name: str, profile: str = "h200") -> None:
    reply = requests.post(f"{hub.url}/hub/api/users/{name}/server", json={"profile": profile},
                          headers={"Authorization": f"token {token}"}, timeout=60)
    assert reply.status_code in (201, 202), reply.text


def culler(hub: Hub, token: str, method: str = "GET", path: str = "api/servers", **kw) -> requests.Response:
    return requests.request(method, f"{hub.url}/services/culler/{path}", headers={"Authorization": f"token {token}"},
                            timeout=60, **kw)


def server_state(hub: Hub, name: str) -> dict:
    user = hub.api("GET", f"/users/{name}").json()
    return ((user.get("servers") or {}).get("") or {}).get("state") or {}


def warned(row: dict) -> bool:
    return row.get("state") in ("warn", "warned")


def test_idle_servers_are_warned_then_culled_busy_ones_kept_and_keep_it_is_bounded(hub, people, webhook, samples,
                                                                                  clock):
    sessions, tokens = people
    url, received = webhook
    spawn(hub, tokens["alice"], "alice")
    spawn(hub, tokens["carol"], "carol")
    hub.wait_ready("alice", timeout=240)
    hub.wait_ready("carol", timeout=240)
    # Both keep their cards busy (the double reports every process busy so far), with no HTTP activity at all.
    pids = {name: server_state(hub, name)["pid"] for name in ("alice", "carol")}
    spawn(hub, tokens["bob"], "bob", "h200-patient")  # both cards are held: bob waits in the queue
    hub.progress_until("bob", lambda event: "Waiting for" in event.get("message", ""), timeout=120)
    # alice's work ends; carol's goes on.
    samples.write_text(json.dumps({"cards": CARDS, "utilization": {str(pids["carol"]): 60}}))

    # alice: after 10 of the culler's minutes idle, warned on her home page, by the API and through the webhook ...
    warned_at = step_until(hub, "alice", tokens["alice"], clock, warned, minutes=10, most=40)
    assert "will be stopped at" in warned_at["message"] and warned_at["signals"]["gpu_percent"] == 0
    assert hub.server("alice") is not None  # warned, not stopped: the stop comes 10 minutes later
    # Her server reported its kernels (none busy) with its own token; the culler made no token of its own for it.
    assert warned_at["signals"]["busy_kernels"] == 0, warned_at
    assert not [t for t in hub.api("GET", "/users/alice/tokens").json()["api_tokens"] if "culler" in t["note"]]
    home = sessions["alice"].get(f"{hub.url}/hub/home", timeout=60).text
    assert 'id="gpupool-idle-warning"' in home and "will be stopped at" in home
    assert "gpupool-idle-warning" not in sessions["carol"].get(f"{hub.url}/hub/home", timeout=60).text

    # ... then stopped: her interval ends `culled`, and bob's waiting request gets the card at once.
    step_until(hub, "alice", tokens["alice"], clock, lambda row: not row, minutes=10, most=20)
    hub.wait_ready("bob", timeout=240)
    ledger = Ledger(hub.ledger_url)
    ended = {i.user: i.how for i in ledger.intervals_overlapping(*_today()) if i.end is not None}
    assert ended.get("alice") == HowEnded.CULLED, ended
    kinds = [(body["kind"], body["user"]) for body in received]
    assert ("idle-warning", "alice") in kinds and ("idle-cull", "alice") in kinds
    assert kinds.index(("idle-warning", "alice")) < kinds.index(("idle-cull", "alice"))

    # carol's busy server was seen busy at every look, and never warned; her home page says so.
    carol = seen_by_culler(hub, tokens["carol"])
    assert carol["state"] == "active" and carol["signals"]["gpu_percent"] == 60, carol
    assert hub.server("carol") is not None and not any(user == "carol" for _, user in kinds)
    assert re.search(r'class="gpupool-idle">in use<', sessions["carol"].get(f"{hub.url}/hub/home", timeout=60).text)

    # bob: warned in turn (after 20 of his profile's 30 minutes), on his home page, where he follows "Keep it" to
    # the culler's page and keeps it (his profile allows half an hour in all), in headless Chromium.
    step_until(hub, "bob", tokens["bob"], clock, warned, minutes=10, most=40)
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    assert chromium and driver, "headless Chromium is not installed (apt-get install chromium chromium-driver)"
    browser = Browser(chromium, driver)
    try:
        browser.log_in_as(hub.url, sessions["bob"])
        browser.start_recording()
        browser.get(f"{hub.url}/hub/home")
        assert "will be stopped at" in browser.wait_for_text("Idle GPU")
        browser.screenshot_whole_page(SCREENSHOTS / "culler-home-warning.png")
        browser.click("#gpupool-idle-warning a")
        browser.wait_for_text("Idle servers")
        browser.wait_page_loaded()
        row = browser.css('#idle-servers tr[data-server=""]')[0]
        assert row.get_attribute("data-state") in ("warn", "warned")
        browser.screenshot_whole_page(SCREENSHOTS / "culler-page.png")
        browser.click('#idle-servers button[type="submit"]')  # the hour it offers first: half an hour is left
        browser.wait(lambda d: "0.5 of 0.5 h" in browser.text(), 60, "the page never showed the keep")
        assert not browser.failed_requests(), browser.failed_requests()
        assert not browser.console_errors(), browser.console_errors()
    finally:
        browser.quit()
    kept = seen_by_culler(hub, tokens["bob"])
    keep_until = kept["keep_until"]
    assert keep_until and kept["kept_hours"] == 0.5, kept
    refused = culler(hub, tokens["bob"], "POST", "api/servers/bob/keep", json={"hours": 1})
    assert refused.status_code == 409 and "keep_max_hours: 0.5" in refused.json()["message"], refused.text
    # Bad input and other people's servers change nothing.
    assert culler(hub, tokens["bob"], "POST", "api/servers/bob/keep", json={"hours": "soon"}).status_code == 400
    assert culler(hub, tokens["bob"], "POST", "api/servers/bob/keep", json={"days": 1}).status_code == 400
    assert culler(hub, tokens["bob"], "POST", "api/servers/carol/keep", json={"hours": 1}).status_code == 404
    assert seen_by_culler(hub, tokens["bob"])["keep_until"] == keep_until

    # Kept: warned again 10 minutes before the keep ends, still running; culled only after the time kept.
    run = server_state(hub, "bob")["usage_run"]
    again = step_until(hub, "bob", tokens["bob"], clock, warned, minutes=10, most=40)
    assert datetime.fromisoformat(again["seen_at"]) < datetime.fromisoformat(keep_until), (again, keep_until)
    assert datetime.fromisoformat(again["cull_at"]) >= datetime.fromisoformat(keep_until), (again, keep_until)
    assert hub.server("bob") is not None
    step_until(hub, "bob", tokens["bob"], clock, lambda row: not row, minutes=10, most=20)
    bob = [i for i in ledger.intervals_overlapping(*_today()) if i.user == "bob"]
    assert [i.how for i in bob] == [HowEnded.CULLED]
    assert IdleStore(ledger.engine).get(run).cull_requested_at >= datetime.fromisoformat(keep_until)
    assert sum(1 for body in received if body == {**body, "kind": "idle-warning", "user": "bob"}) >= 2

    # The team's page and the reports: idle GPU-hours held, two servers culled, GPU-hours given back.
    figures = idle_report(ledger, periods.period_of(periods.utcnow()))["vision"]
    assert figures["culled_servers"] == 2 and Fraction(figures["idle_gpu_hours"]) > 0, figures
    assert 0 < Fraction(figures["reclaimed_gpu_hours"]) and 0 < float(figures["idle_share"]) < 1, figures
    page = sessions["carol"].get(f"{hub.url}/services/accounting/teams/vision", timeout=60).text
    assert "the idle culler stopped 2 servers, giving back" in page


def _today():
    from datetime import UTC, datetime, timedelta

    now = datetime.now(UTC)
    return now - timedelta(hours=2), now + timedelta(hours=1)
