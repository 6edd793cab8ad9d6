"""The spawn page says, per profile, whether a spawn would start now or wait (and why), and the queue's length,
from the pool's own pass of the queue; checked against what spawns then do on one real `gpupool up` with one
H200 card, through people's logins and tokens, and looked at in headless Chromium (docs/screenshots/)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import requests

from harness import Browser, Hub

SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami, whole]}\n"
                 "inventory:\n  - {model: H200, count: 1}\n",
    "teams.yaml": "teams:\n  vision: {priority: 100, quota: {gpus: 4, per_user_gpus: 1}}\n",
    "profiles.yaml": """
profiles:
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision], default: true}
  h200: {display_name: 1 × H200, gpu: {model: H200, count: 1}, teams: [vision]}
  cpu: {display_name: CPU only, teams: [vision]}
""",
    "billing.yaml": "billing: {prices: {H200: '3.20'}}\n",
}
PEOPLE = ("alice", "bob", "carol")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub(tmp_path_factory.mktemp("availability"), POLICY, 'c.LocalGPUSpawner.run_as = "self"', mlflow=False)
    hub.start()
    try:
        yield hub
    finally:
        hub.stop()


@pytest.fixture(scope="module")
def people(hub):
    sessions = hub.sign_up(list(PEOPLE), "availability-test")
    for name in PEOPLE:
        hub.add_user(name, "vision")
    return sessions, {name: hub.user_token(name) for name in PEOPLE}


def availability(hub: Hub, session: requests.Session) -> dict[str, tuple[str, str]]:
    """What the person's spawn page says: profile → (start|wait|refuse, the line's text); `queue` → its line."""
    page = session.get(f"{hub.url}/hub/spawn", timeout=60)
    page.encoding = "utf-8"
    assert page.status_code == 200, page.text[-2000:]
    found = {m[0]: (m[1], re.sub(r"<[^>]+>", "", m[2]).strip()) for m in re.findall(
        r'id="availability-([a-z0-9-]+)" data-action="(\w+)">(.*?)</div>', page.text)}
    queue = re.search(r'id="availability-queue">(.*?)</p>', page.text)
    found["queue"] = ("", queue[1] if queue else "")
    return found


def spawn(hub: Hub, token: str, name: str, profile: str) -> None:
    reply = requests.post(f"{hub.url}/hub/api/users/{name}/server", json={"profile": profile},
                          headers={"Authorization": f"token {token}"}, timeout=60)
    assert reply.status_code in (201, 202), reply.text


def test_the_spawn_page_says_what_a_spawn_would_do_and_spawns_then_do_it(hub, people):
    sessions, tokens = people
    seen = availability(hub, sessions["carol"])
    assert seen["h200-quarter"][0] == seen["h200"][0] == seen["cpu"][0] == "start", seen
    assert seen["queue"][1].startswith("Queue now: 0 request(s) waiting")

    # bob takes the whole card: it said it would start, and it starts.
    spawn(hub, tokens["bob"], "bob", "h200")
    hub.wait_ready("bob", timeout=240)
    seen = availability(hub, sessions["carol"])
    assert seen["h200-quarter"] == ("wait", "would wait: no H200 has 0.25 free: 1 of 1 allocated"), seen
    assert seen["h200"][0] == "wait" and seen["cpu"][0] == "start"

    # alice asks anyway: her spawn waits, for the reason the page gave.
    spawn(hub, tokens["alice"], "alice", "h200-quarter")
    events = hub.progress_until("alice", lambda e: e.get("reason") == "no-capacity", timeout=120)
    assert "no H200 has 0.25 free" in events[-1]["message"]
    seen = availability(hub, sessions["carol"])
    assert seen["queue"][1].startswith("Queue now: 1 request(s) waiting, 1 of them from your team(s)"), seen
    assert seen["h200-quarter"][0] == "wait"

    # bob stops: alice's request starts; a quarter still fits beside hers, a whole card does not.
    hub.stop_server("bob", timeout=120)
    hub.wait_ready("alice", timeout=240)
    seen = availability(hub, sessions["carol"])
    assert seen["h200-quarter"][0] == "start" and seen["h200"] == (
        "wait", "would wait: no H200 has 1 free: 0.25 of 1 allocated"), seen
    assert seen["queue"][1].startswith("Queue now: 0 request(s) waiting")
    # The same for other pickers: the hub's REST API with the person's own token; another's is not theirs.
    api = requests.get(f"{hub.url}/hub/api/users/carol/availability",
                       headers={"Authorization": f"token {tokens['carol']}"}, timeout=60)
    assert api.status_code == 200, api.text
    assert api.json()["profiles"]["h200"] == {"action": "wait", "code": "no-capacity",
                                              "reason": "no H200 has 1 free: 0.25 of 1 allocated"}
    assert api.json()["profiles"]["h200-quarter"]["action"] == "start" and api.json()["queue_length"] == 0
    assert requests.get(f"{hub.url}/hub/api/users/alice/availability", timeout=60,
                        headers={"Authorization": f"token {tokens['carol']}"}).status_code == 404
    spawn(hub, tokens["carol"], "carol", "h200-quarter")
    hub.wait_ready("carol", timeout=240)  # it said it would start, and it did
    hub.stop_server("carol", timeout=120)


def test_the_spawn_page_in_a_browser(hub, people):
    """bob's spawn page in headless Chromium while alice holds the card whole: its screenshot goes into the docs."""
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    sessions, tokens = people
    if hub.server("alice"):
        hub.stop_server("alice", timeout=120)
    spawn(hub, tokens["alice"], "alice", "h200")
    hub.wait_ready("alice", timeout=240)
    browser = Browser(chromium, driver)
    try:
        browser.log_in_as(hub.url, sessions["bob"])
        browser.start_recording()
        browser.get(f"{hub.url}/hub/spawn")
        text = browser.wait_for_text("would wait")
        browser.wait_page_loaded()
        assert "Queue now: 0 request(s) waiting" in text and "starts now" in text, text  # the CPU profile
        assert "no H200 has 0.25 free: 1 of 1 allocated" in text, text
        assert not browser.failed_requests(), browser.failed_requests()
        assert not browser.console_errors(), browser.console_errors()
        browser.screenshot_whole_page(SCREENSHOTS / "spawn-availability.png")
    finally:
        browser.quit()
    hub.stop_server("alice", timeout=120)
