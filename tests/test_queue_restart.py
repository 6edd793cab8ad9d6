"""The queue survives hub restarts, a crash included: through a real `gpupool up`, killed with SIGKILL while
requests wait, then started again on the same state folder."""

from __future__ import annotations

import time

import psutil
import pytest
import requests

from gpupool.hub.harness import Hub

POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami, whole]}\n"
                 "inventory:\n  - {model: H200, count: 1}\n",
    "teams.yaml": "teams:\n  vision: {priority: 100, quota: {gpus: 10, per_user_gpus: 10}}\n",
    "profiles.yaml": """
profiles:
  h200: {display_name: 1 × H200, gpu: {model: H200, count: 1}, teams: [vision], default: true}
  h200-old: {display_name: 1 × H200 (old), gpu: {model: H200, count: 1}, teams: [vision]}
""",
    "billing.yaml": "billing: {prices: {H200: '3.20'}}\n",
}


@pytest.fixture
def hub(tmp_path):
    hub = Hub(tmp_path, POLICY, 'c.LocalGPUSpawner.run_as = "self"', mlflow=False)
    hub.start()
    yield hub
    hub.kill()
    for process in psutil.process_iter(["cmdline"]):  # no server or orphaned service outlives the test
        if str(hub.state) in " ".join(process.info["cmdline"] or []):
            process.kill()


def position(hub: Hub, user: str, expected: str) -> str:
    return hub.progress_until(user, lambda e: expected in e.get("message", ""), timeout=120)[-1]["message"]


def test_queued_requests_come_back_in_order_after_a_hub_crash(hub):
    for name in ("holder", "w1", "w2", "w3"):
        hub.add_user(name, "vision")
    assert hub.api("POST", "/users/holder/server").status_code in (201, 202)
    hub.wait_ready("holder")
    for name, profile in (("w1", "h200"), ("w2", "h200-old"), ("w3", "h200")):
        assert hub.api("POST", f"/users/{name}/server", json={"profile": profile}).status_code in (201, 202)
    position(hub, "w3", "position 3 of 3")
    hub.kill()
    # While the hub is down its profile `h200-old` goes away: w2's request cannot come back.
    profiles = hub.policies / "profiles.yaml"
    profiles.write_text("\n".join(line for line in profiles.read_text().splitlines() if "h200-old" not in line))
    hub.start()
    assert position(hub, "w1", "position 1 of 2").startswith("Waiting for 1 × H200: position 1 of 2")
    position(hub, "w3", "position 2 of 2")
    log = hub.log.read_text()
    assert "w2/ could not come back to the queue after the restart" in log
    token = hub.api("POST", "/users/w2/tokens", json={"expires_in": 600}).json()["token"]
    home = requests.get(f"{hub.url}/hub/home", headers={"Authorization": f"token {token}"}, timeout=30)
    assert home.status_code == 200
    assert "could not be queued again" in home.text and "No such profile: &#x27;h200-old&#x27;" in home.text
    # The order holds: the card goes to w1, not w3.
    hub.stop_server("holder")
    hub.wait_ready("w1")
    assert "w3/" not in hub.allocations()
    for name in ("w1", "w3"):
        hub.stop_server(name)
