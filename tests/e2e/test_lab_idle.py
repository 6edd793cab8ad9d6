"""JupyterLab's warning before the idle culler stops a server, as its user sees it, on one real `gpupool up` (one
H200 declared, no GPU): the culler as the hub starts it (a pass a second), alice's JupyterLab in headless Chromium
with the labextension gpupool-idle and the server extension gpupool.hub.lab_idle that `make install` put into the
servers' environment. The screenshot goes into the docs (docs/screenshots/lab-idle-warning.png).

The policy's times are minutes, as an admin writes them; the culler's clock (`tests/culler_clock.py`) lets them pass
a step at a time, each step seen by a look of the culler, instead of the test waiting them out. JupyterLab checks
the warning as often as its server says: the culler's pass (a second here), never under 5 s.
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import requests

from culler_clock import CullerClock, seen_by_culler, step_until
from harness import Browser, Hub
from gpupool.hub.lab_idle import MIN_CHECK_S, check_every, culler_url, this_server, warned

SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [whole]}\n"
                 "inventory:\n  - {model: H200, count: 1}\n",
    "teams.yaml": "teams:\n  vision: {quota: {gpus: 1, per_user_gpus: 1}}\n",
    "profiles.yaml": "profiles:\n  h200: {display_name: 1 × H200, gpu: {model: H200, count: 1}, teams: [vision]}\n",
    # Warned after 20 min idle, stopped 10 min later. "Keep it 1 h" is granted whole once; a second keep is refused
    # with the policy's reason.
    "settings.yaml": "settings:\n"
                     "  idle: {after_minutes: 30, warn_minutes: 10, cpu_below_percent: 50, keep_max_hours: 1}\n",
}


def test_a_warning_stands_until_the_stop_it_announces_is_postponed():
    row = {"user": "alice", "server": "", "state": "warned", "cull_at": "2026-05-01T10:02:00+00:00",
           "keep_until": None, "message": "alice's server has been idle ..."}
    assert warned(row) and warned({**row, "state": "warn"})
    assert not warned({**row, "state": "idle"}) and not warned({**row, "state": "active"}) and not warned(None)
    # Kept since the culler's last look: the stop it announced is past the keep's end no more.
    assert not warned({**row, "keep_until": "2026-05-01T11:00:00+00:00"})
    # Warned anew for the end of a keep: the stop is the keep's end (or later).
    assert warned({**row, "keep_until": "2026-05-01T10:02:00+00:00"})
    assert warned({**row, "keep_until": "2026-05-01T09:00:00+00:00"})
    named = {**row, "server": "big"}
    assert this_server([named, row], "alice", "") is row and this_server([named, row], "alice", "big") is named
    assert this_server([row], "bob", "") is None
    assert culler_url({"GPUPOOL_HUB_URL": "http://127.0.0.1:8000/"}) == "http://127.0.0.1:8000/services/culler/"
    assert (culler_url({"JUPYTERHUB_PUBLIC_HUB_URL": "https://hub.example/hub/"})
            == "https://hub.example/services/culler/")
    assert culler_url({}) is None
    # JupyterLab checks as often as the culler looks, within 5 s and a minute; a minute when the culler does not say.
    assert check_every({"interval_s": 60}) == 60 and check_every({"interval_s": 20.5}) == 20.5
    assert check_every({"interval_s": 1}) == 5 and check_every({"interval_s": 3600}) == 60
    assert all(check_every({"interval_s": bad}) == 60 for bad in (None, 0, -5, "1", True, [1]))
    assert check_every({}) == 60


@pytest.fixture(scope="module")
def clock(tmp_path_factory) -> CullerClock:
    """The culler's clock: two hours behind the system's, more than the test may let pass (100 minutes at most)."""
    return CullerClock(tmp_path_factory.mktemp("clock") / "culler-clock", behind=timedelta(hours=2))


@pytest.fixture(scope="module")
def hub(tmp_path_factory, clock):
    extra = f"""
c.LocalGPUSpawner.run_as = "self"
for service in c.JupyterHub.services:
    if service["name"] == "culler":  # a pass a second, its clock the test's
        service["command"] = service["command"] + ["--interval=1"] + {clock.culler_args!r}
"""
    hub = Hub(tmp_path_factory.mktemp("lab-idle"), POLICY, extra, mlflow=False)
    hub.start()
    try:
        yield hub
    finally:
        hub.stop()


def warnings(browser: Browser) -> list[str]:
    """The texts of the idle warnings JupyterLab shows (its notifications' toasts)."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        return [t.text for t in browser.css(".Toastify__toast") if "will be stopped at" in t.text]
    except StaleElementReferenceException:  # redrawn while read: read again
        return warnings(browser)


def warned_by_culler(row: dict) -> bool:
    return row.get("state") in ("warn", "warned")


def test_jupyterlab_warns_before_the_stop_and_keeps_the_server(hub, clock):
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    sessions = hub.sign_up(["alice"], "lab-idle-test")
    hub.add_user("alice", "vision")
    token = hub.user_token("alice")
    auth = {"Authorization": f"token {token}"}
    reply = requests.post(f"{hub.url}/hub/api/users/alice/server", json={"profile": "h200"}, headers=auth, timeout=60)
    assert reply.status_code in (201, 202), reply.text
    hub.wait_ready("alice", timeout=240)
    step_until(hub, "alice", token, clock, warned_by_culler, minutes=10, most=40)

    # The server extension, as JupyterLab asks it (here with alice's token through the hub's proxy): it asks the
    # culler with the server's own token.
    lab = f"{hub.url}/user/alice/gpupool/idle"
    answer = requests.get(lab, headers=auth, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["warned"] is True and "will be stopped at" in answer.json()["server"]["message"]
    assert answer.json()["check_every_s"] == MIN_CHECK_S  # the culler's pass is a second: JupyterLab's floor
    assert requests.get(lab, timeout=60, allow_redirects=False).status_code in (302, 403)  # nobody's login

    browser = Browser(chromium, driver)
    try:
        browser.log_in_as(hub.url, sessions["alice"])
        browser.start_recording()
        browser.get(f"{hub.url}/user/alice/lab")
        browser.wait_page_loaded()
        # Loading JupyterLab is CPU work of the server, which may have ended the warning: idle again until warned,
        # the warning shows at JupyterLab's start or at its next check.
        step_until(hub, "alice", token, clock, warned_by_culler, minutes=10, most=40)
        browser.wait_for_text("will be stopped at", timeout=200)
        # JupyterLab draws a notification's words before its buttons: read it once the buttons are there too.
        browser.wait(lambda d: any("Keep it 1 h" in w for w in warnings(browser)), 60,
                     f"the warning never showed its buttons: {warnings(browser)}")
        first = warnings(browser)
        assert len(first) == 1, first
        assert "Keep it 1 h" in first[0] and "UTC to give its GPU back to the pool" in first[0], first
        # The culler's words change as the idle time grows (two more minutes of its clock; more if the server was
        # busy meanwhile, which starts the idle time again). JupyterLab's next check then updates the notification
        # with them: updated, not shown twice.
        step_until(hub, "alice", token, clock,
                   lambda row: warned_by_culler(row) and not first[0].startswith(row["message"]), minutes=2, most=20)
        # One warning in the end, with the new words: updated in place, or (when the server's stop time moved)
        # replaced, the old one leaving as the new one comes; never two that stay.
        browser.wait(lambda d: len(now := warnings(browser)) == 1 and now != first, 100,
                     f"the warning was never updated to one: {warnings(browser)}; the culler: "
                     f"{seen_by_culler(hub, token)}")
        assert browser.css(".jp-Notification-Status-Text")[0].text == "1"  # one in the notification centre too
        browser.wait_page_loaded()
        browser.screenshot(SCREENSHOTS / "lab-idle-warning.png")
        toasts = [t for t in browser.css(".Toastify__toast") if "will be stopped at" in t.text]

        keep = [b for b in toasts[0].find_elements("css selector", "button") if b.text == "Keep it 1 h"]
        assert keep, toasts[0].get_attribute("outerHTML")
        keep[0].click()
        browser.wait_for_text("Kept: this server will not be stopped before", timeout=60)
        # The warning goes with the keep (it may still be leaving as the confirmation comes)
        browser.wait(lambda d: "will be stopped at" not in browser.text(), 30,
                     f"the warning stayed after the keep: {browser.text()[:3000]}")
        assert not [r for r in browser.failed_requests() if "/gpupool/" in r], browser.failed_requests()
        assert not [e for e in browser.console_errors() if "gpupool" in e], browser.console_errors()
    finally:
        browser.quit()

    # The culler has it: kept for the hour asked, and so no longer warned.
    kept = seen_by_culler(hub, token)
    assert kept["keep_until"] and kept["kept_hours"] == 1.0, kept
    answer = requests.get(lab, headers=auth, timeout=60).json()
    assert answer["warned"] is False and answer["server"]["keep_until"] == kept["keep_until"], answer
    # A second hour is more than the policy allows: the culler's reason comes back as it gave it.
    refused = requests.post(f"{lab}/keep", json={"hours": 1}, headers=auth, timeout=60)
    assert refused.status_code == 409 and "keep_max_hours: 1" in refused.json()["message"], refused.text
    assert requests.post(f"{lab}/keep", json={"days": 1}, headers=auth, timeout=60).status_code == 400
    assert seen_by_culler(hub, token)["kept_hours"] == 1.0
    hub.stop_server("alice", timeout=120)
