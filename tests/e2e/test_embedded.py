"""The embedded platform end to end: `gpupool up` runs a real JupyterHub, proxy and JupyterLab servers.

Nothing is mocked: users are created and servers spawned through the hub's REST API with a service token
(`tests/harness.py`), code runs in a real kernel of the spawned server, and the hub is stopped and
restarted for real.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from gpupool.hub.accounting.ledger import Ledger
from gpupool.policies.periods import period_of, utcnow
from harness import Hub
from gpupool.spawner.pool import AllocationStore

POLICY = {
    "gpus.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami, mig, whole], mig: {profiles: [1g.18gb]}}
inventory:
  - {model: H200, count: 2}
""",
    "teams.yaml": """
teams:
  vision: {priority: 100, quota: {gpus: 10, per_user_gpus: 10}}
  nlp: {priority: 50, quota: {gpus: 0.5, per_user_gpus: 0.5}}
""",
    "profiles.yaml": """
profiles:
  cpu: {display_name: CPU only, teams: [vision, nlp], default: true}
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision, nlp]}
  h200-half: {display_name: 0.5 × H200, gpu: {model: H200, share: 0.5}, teams: [vision]}
  h200-whole: {display_name: 1 × H200, gpu: {model: H200, count: 1}, teams: [vision, nlp]}
""",
    "billing.yaml": "billing: {prices: {H200: '3.20'}}\n",
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub(tmp_path_factory.mktemp("embedded"), POLICY,
              'c.LocalGPUSpawner.run_as = "self"  # per-user system accounts: test_system_users.py')
    hub.start()
    yield hub
    for user in hub.api("GET", "/users").json():
        if user["servers"]:
            hub.api("DELETE", f"/users/{user['name']}/server")
    time.sleep(2)
    hub.stop()
    for process in psutil.process_iter(["cmdline"]):  # no server outlives the test
        if str(hub.state) in " ".join(process.info["cmdline"] or []):
            process.kill()


def test_the_first_admin_logs_in_with_the_password_gpupool_up_printed(hub):
    (password,) = re.findall(r"with the password (\S+)", hub.log.read_text())
    browser = requests.Session()
    page = browser.get(f"{hub.url}/hub/login", timeout=30)
    assert page.status_code == 200 and 'name="password"' in page.text
    form = {"username": "admin", "password": password, "_xsrf": browser.cookies.get("_xsrf", "")}
    wrong = browser.post(f"{hub.url}/hub/login", data={**form, "password": "not-" + password}, timeout=30,
                         allow_redirects=False)
    assert wrong.status_code == 200 and "Invalid username or password." in wrong.text
    logged_in = browser.post(f"{hub.url}/hub/login", data=form, timeout=30, allow_redirects=False)
    assert logged_in.status_code == 302, logged_in.text[-2000:]
    assert browser.get(f"{hub.url}/hub/api/user", timeout=30).json()["admin"] is True


def test_team_add_member_command(hub):
    import subprocess
    import sys
    from pathlib import Path

    gpupool = Path(sys.executable).parent / "gpupool"
    done = subprocess.run([gpupool, "team", "add-member", "nlp", "bob", "--create", "--state-dir", str(hub.state)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "bob is now a member of team nlp" in done.stdout
    assert "bob" in hub.api("GET", "/groups/nlp").json()["users"]
    refused = subprocess.run([gpupool, "team", "add-member", "robotics", "bob", "--state-dir", str(hub.state)],
                             capture_output=True, text=True, check=False)
    assert refused.returncode == 1 and "no team 'robotics'" in refused.stderr


def test_quarter_share_reaches_the_kernel(hub):
    hub.add_user("alice", "vision")
    assert hub.api("POST", "/users/alice/server", json={"profile": "h200-quarter"}).status_code in (201, 202)
    hub.wait_ready("alice")
    printed = hub.run_in_kernel(
        "alice", "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith(('GPUPOOL_', 'CUDA_'))}))"
    )
    env = json.loads(printed)
    card = hub.allocations()["alice/"]
    assert env["GPUPOOL_TEAM"] == "vision"
    assert env["GPUPOOL_PROFILE"] == "h200-quarter"
    assert env["GPUPOOL_SHARE"] == "1/4"
    assert env["GPUPOOL_GPU_MODEL"] == "H200"
    assert env["CUDA_VISIBLE_DEVICES"] == card[0] and card[0].startswith("GPU-declared-H200-")
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={int(141 * 1024 / 4)}M"
    assert hub.api("DELETE", "/users/alice/server").status_code in (202, 204)
    deadline = time.monotonic() + 30
    while hub.server("alice") and time.monotonic() < deadline:
        time.sleep(0.3)
    assert "alice/" not in hub.allocations()
    ledger = Ledger(hub.ledger_url, migrate=False)
    assert not [i for i in ledger.open_intervals() if i.user == "alice"]
    (interval,) = [i for i in ledger.usage_rows(period_of(utcnow())) if i.user == "alice"]
    assert interval.model == "H200" and interval.profile == "h200-quarter" and interval.gpu_hours > 0


def test_team_quota_makes_the_next_spawn_wait(hub):
    for n in (1, 2, 3):
        hub.add_user(f"q{n}", "nlp")
    for n in (1, 2):
        assert hub.api("POST", f"/users/q{n}/server", json={"profile": "h200-quarter"}).status_code in (201, 202)
        hub.wait_ready(f"q{n}")
    # The REST answer comes as soon as the request waits in the queue (not after JupyterHub's 10 s wait for a
    # slow spawn), and says where it waits: the progress stream's words.
    waiting = 'Waiting for 0.25 × H200: position 1 of 1 in queue "nlp" (team "nlp" holds 0.5 of 0.5 GPUs (quota))'
    reply = hub.api("POST", "/users/q3/server", json={"profile": "h200-quarter"})
    assert (reply.status_code, reply.text) == (202, waiting + "\n")
    events = hub.progress_until("q3", lambda e: "position" in e.get("message", ""))
    assert events[-1]["message"] == waiting
    assert events[-1]["reason"] == "quota-full", "the progress stream carries the wait's code for scripts"
    assert "q3/" not in hub.allocations(), "the cards have room: only the quota holds q3 back"
    hub.stop_server("q1")
    hub.wait_ready("q3")
    for n in (2, 3):
        hub.stop_server(f"q{n}")
    assert not [k for k in hub.allocations() if k.startswith("q")]


def metric(hub: Hub, name: str, **labels: str) -> float:
    """A sample of the hub's /hub/metrics (JupyterHub's and gpupool's), read with the harness's read:metrics."""
    text = hub.api("GET", "/metrics").text
    wanted = {f'{key}="{value}"' for key, value in labels.items()}
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            found = set(line[len(name) + 1:line.index("}")].split(","))
            if wanted <= found:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_refused_spawn_carries_its_reason_code_in_the_rest_error_and_the_metrics(hub):
    # nlp's members may hold 0.5 GPU at once: a whole card can never start for them, so it is refused at once.
    hub.add_user("rhea", "nlp")
    before = metric(hub, "jupyterhub_server_spawn_duration_seconds_count", reason="quota-never-fits")
    reply = hub.api("POST", "/users/rhea/server", json={"profile": "h200-whole"})
    assert reply.status_code == 403, reply.text
    assert reply.json()["message"] == ('1 × H200 can never start: team "nlp" may hold at most 0.5 GPUs '
                                       "at once (quota) (reason: quota-never-fits)")
    # JupyterHub counts it as a handled rejection under the code; gpupool counts the decision.
    assert metric(hub, "jupyterhub_server_spawn_duration_seconds_count", status="failure",
                  reason="quota-never-fits") == before + 1
    assert metric(hub, "gpupool_admission_decisions_total", action="deny", reason="quota-never-fits") >= 1
    assert "rhea/" not in hub.allocations()


def test_cancelling_a_queued_spawn_leaves_the_queue_cleanly(hub):
    for name in ("c1", "c2", "dave", "erin"):
        hub.add_user(name, "nlp")
    for name in ("c1", "c2"):
        assert hub.api("POST", f"/users/{name}/server", json={"profile": "h200-quarter"}).status_code in (201, 202)
        hub.wait_ready(name)
    assert hub.api("POST", "/users/dave/server", json={"profile": "h200-quarter"}).status_code in (201, 202)
    hub.progress_until("dave", lambda e: "position 1 of 1" in e.get("message", ""))
    reply = hub.api("POST", "/users/erin/server", json={"profile": "h200-quarter"})
    assert reply.status_code == 202 and "position 2 of 2" in reply.text, reply.text
    hub.progress_until("erin", lambda e: "position 2 of 2" in e.get("message", ""))
    # dave's progress page, open while he waits and when he presses its "Stop Server" button
    watching = ThreadPoolExecutor(1).submit(hub.progress_until, "dave", lambda e: e.get("failed") or e.get("ready"),
                                            120)
    # The queue message is re-checked every 5 s: watch long enough that a repeat would show.
    time.sleep(6)
    log_before = len(hub.log.read_text())
    assert hub.api("DELETE", "/users/dave/server").status_code in (202, 204)
    events = watching.result(timeout=120)
    messages = [e.get("message") for e in events]
    assert events[-1].get("failed") and events[-1]["message"] == "Spawn cancelled", messages
    assert not any(e.get("ready") for e in events), messages
    queued = [m for m in messages if m and m.startswith("Waiting for 0.25 × H200: position")]
    assert queued, messages
    assert all(a != b for a, b in zip(messages, messages[1:])), f"a message repeated: {messages}"
    deadline = time.monotonic() + 30
    while hub.server("dave") is not None and time.monotonic() < deadline:
        time.sleep(0.3)
    assert hub.server("dave") is None
    # dave's place is freed: erin moves up
    hub.progress_until("erin", lambda e: "position 1 of 1" in e.get("message", ""))
    log = hub.log.read_text()[log_before:]
    assert "Server dave is ready" not in log and "Redirect loop" not in log, log[-3000:]
    assert "dave/" not in hub.allocations()
    assert not [i for i in Ledger(hub.ledger_url, migrate=False).open_intervals() if i.user == "dave"]
    # erin while she still waits (stopped once c1 left, she would be starting: JupyterHub's stop handler answers
    # 500 to a start that does not end within its 1 s)
    for name in ("erin", "c1", "c2"):
        hub.stop_server(name)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"profile": "h200-half"}, "No such profile: 'h200-half'. Options include: cpu, h200-quarter"),
        ({"profile": "h200-eighth"}, "No such profile: 'h200-eighth'"),
        ({"profile": "h200-quarter", "gpus": 8}, "Unknown user option(s): gpus. Accepted keys: profile, image, team"),
        ({"profile": "h200-quarter", "team": "vision"}, "Team 'vision' cannot be charged"),
    ],
)
def test_bad_user_options_get_400_and_nothing_starts(hub, options, words):
    hub.add_user("nadia", "nlp")
    before = hub.allocations()
    reply = hub.api("POST", "/users/nadia/server", json=options)
    assert reply.status_code == 400, reply.text
    assert words in reply.json()["message"]
    time.sleep(0.5)
    server = hub.server("nadia")
    assert server is None or not server["ready"]
    assert hub.allocations() == before
    assert not any("nadia" in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
                   if "jupyterhub-singleuser" in " ".join(p.info["cmdline"] or []))


def test_twelve_quarter_spawns_eight_run_four_queue(hub):
    users = [f"u{n:02d}" for n in range(12)]
    for user in users:
        hub.add_user(user, "vision")

    def spawn(user):
        reply = hub.api("POST", f"/users/{user}/server", json={"profile": "h200-quarter"})
        assert reply.status_code in (201, 202), reply.text

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(spawn, users))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(hub.allocations()) < 8:
        time.sleep(0.5)
    time.sleep(1)
    allocations = hub.allocations()
    assert len(allocations) == 8
    per_card: dict[str, int] = {}
    for cards in allocations.values():
        per_card[cards[0]] = per_card.get(cards[0], 0) + 1
    assert per_card == {"GPU-declared-H200-0": 4, "GPU-declared-H200-1": 4}, "no card is over-committed"

    waiting = [u for u in users if f"{u}/" not in allocations]
    positions = {}
    for user in waiting:
        events = hub.progress_until(user, lambda e: "position" in e.get("message", ""))
        message = events[-1]["message"]
        assert message.startswith("Waiting for 0.25 × H200: position "), message
        assert 'in queue "vision" (no H200 has 0.25 free: 2 of 2 allocated)' in message
        assert events[-1]["reason"] == "no-capacity"
        positions[user] = int(message.split("position ")[1].split(" of ")[0])
    assert sorted(positions.values()) == [1, 2, 3, 4]

    running = sorted(allocations)[0].removesuffix("/")
    hub.wait_ready(running)
    head = min(positions, key=positions.get)
    assert hub.api("DELETE", f"/users/{running}/server").status_code in (202, 204)
    hub.wait_ready(head)
    assert f"{head}/" in hub.allocations() and f"{running}/" not in hub.allocations()

    # Stopping a waiting spawn cancels its wait and frees its place.
    last = max(positions, key=positions.get)
    assert hub.api("DELETE", f"/users/{last}/server").status_code in (202, 204)
    time.sleep(1)
    assert len(hub.allocations()) == 8
    assert f"{last}/" not in hub.allocations()


def test_hub_restart_readopts_running_servers_and_cleans_up_dead_ones(hub):
    allocations = hub.allocations()
    running = sorted(k.removesuffix("/") for k in allocations)
    keep, kill = running[0], running[1]
    for user in (keep, kill):
        hub.wait_ready(user)
    store = AllocationStore(hub.state / "allocations.sqlite", owner="test")
    pid = next(a.pid for a in store.all() if a.key == f"{kill}/")
    ledger_url = hub.ledger_url
    before = [i.key for i in Ledger(ledger_url, migrate=False).open_intervals() if i.user == keep]
    assert len(before) == 1
    hub.stop()
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    hub.start()
    server = hub.wait_ready(keep)
    assert server["ready"]
    assert hub.run_in_kernel(keep, "import os; print(os.environ['GPUPOOL_PROFILE'])").strip() == "h200-quarter"
    after = hub.allocations()
    assert after[f"{keep}/"] == allocations[f"{keep}/"], "the running server keeps its card"
    assert f"{kill}/" not in after, "the share of the server that died while the hub was down is freed"
    deadline = time.monotonic() + 30
    while hub.server(kill) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert hub.server(kill) is None
    intervals = Ledger(ledger_url, migrate=False).open_intervals()
    assert [i.key for i in intervals if i.user == keep] == before, "the same interval goes on: nothing lost or doubled"
    assert kill not in {i.user for i in intervals}, "the dead server's usage interval is closed"
