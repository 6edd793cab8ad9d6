"""The embedded platform end to end: `gpupool up` runs a real JupyterHub, proxy and JupyterLab servers.

Nothing is mocked: users are created and servers spawned through the hub's REST API with a test service
token, code runs in a real kernel of the spawned server, and the hub is stopped and restarted for real.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import websocket  # websocket-client, a JupyterLab dependency

from gpupool.spawner.pool import AllocationStore

ROOT = Path(__file__).resolve().parent.parent
GPUPOOL = Path(sys.executable).parent / "gpupool"
TOKEN = uuid.uuid4().hex

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
  nlp: {priority: 50, quota: {gpus: 10, per_user_gpus: 10}}
""",
    "profiles.yaml": """
profiles:
  cpu: {display_name: CPU only, teams: [vision, nlp], default: true}
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision, nlp]}
  h200-half: {display_name: 0.5 × H200, gpu: {model: H200, share: 0.5}, teams: [vision]}
""",
    "billing.yaml": "billing: {prices: {H200: '3.20'}}\n",
}

TEST_SERVICE = f"""
c.LocalGPUSpawner.run_as = "self"  # per-user system accounts are tested separately
c.JupyterHub.services.append({{"name": "test-harness", "api_token": {TOKEN!r}}})
c.JupyterHub.load_roles.append({{
    "name": "test-harness",
    "scopes": ["admin:users", "admin:servers", "access:servers", "admin:groups", "read:users"],
    "services": ["test-harness"],
}})
"""


def free_port_block(n: int = 3) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            sockets = []
            for port in range(base, base + n):
                sock = socket.socket()
                sock.bind(("127.0.0.1", port))
                sockets.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free ports")


class Hub:
    """A `gpupool up` process and a REST client for it."""

    def __init__(self, tmp: Path):
        self.policies = tmp / "policies"
        self.policies.mkdir()
        for name, text in POLICY.items():
            (self.policies / name).write_text(text)
        self.state = tmp / "state"
        (self.state / "jupyterhub_config.d").mkdir(parents=True)
        (self.state / "jupyterhub_config.d" / "test.py").write_text(TEST_SERVICE)
        self.port = free_port_block()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = tmp / "hub.log"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {TOKEN}"

    def start(self) -> None:
        log = self.log.open("a")
        env = dict(os.environ)
        self.process = subprocess.Popen(
            [GPUPOOL, "up", "--state-dir", str(self.state), "--port", str(self.port), "--policies", str(self.policies)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if self.session.get(f"{self.url}/hub/api/users", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        raise TimeoutError(self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(30)

    def api(self, method: str, path: str, **kw) -> requests.Response:
        return self.session.request(method, f"{self.url}/hub/api{path}", timeout=30, **kw)

    def add_user(self, name: str, team: str) -> None:
        assert self.api("POST", f"/users/{name}").status_code in (201, 409)
        assert self.api("POST", f"/groups/{team}/users", json={"users": [name]}).status_code == 200

    def server(self, name: str) -> dict | None:
        return self.api("GET", f"/users/{name}").json()["servers"].get("")

    def wait_ready(self, name: str, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            server = self.server(name)
            if server and server["ready"]:
                return server
            time.sleep(0.5)
        raise TimeoutError(f"{name}'s server not ready: {self.server(name)}\n{self.log.read_text()[-3000:]}")

    def progress_until(self, name: str, predicate, timeout: float = 60) -> list[dict]:
        """Progress events of `name`'s spawn until one satisfies `predicate`."""
        events = []
        with self.session.get(f"{self.url}/hub/api/users/{name}/server/progress", stream=True, timeout=timeout) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if predicate(events[-1]):
                        break
        return events

    def run_in_kernel(self, name: str, code: str) -> str:
        """Run `code` in a new kernel of `name`'s server and return what it printed."""
        base = f"{self.url}/user/{name}/api"
        kernel = self.session.post(f"{base}/kernels", json={"name": "python3"}, timeout=60)
        assert kernel.status_code == 201, kernel.text
        kernel_id = kernel.json()["id"]
        ws = websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/user/{name}/api/kernels/{kernel_id}/channels",
            header=[f"Authorization: token {TOKEN}"], timeout=60,
        )
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex, "msg_type": "execute_request",
                       "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False},
        }))
        output = []
        while True:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                output.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        ws.close()
        self.session.delete(f"{base}/kernels/{kernel_id}", timeout=30)
        return "".join(output)

    def allocations(self) -> dict[str, tuple[str, ...]]:
        return {a.key: a.cards for a in AllocationStore(self.state / "allocations.sqlite", owner="test").all()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub(tmp_path_factory.mktemp("embedded"))
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
        assert 'in queue "vision" (no H200 has 0.25 free: 2.0 of 2 allocated)' in message
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
