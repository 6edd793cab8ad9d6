"""The queue survives hub restarts, a crash included: through a real `gpupool up`, killed with SIGKILL while
requests wait, then started again on the same state folder; and however many wait, every one comes back."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
from datetime import timedelta
from fractions import Fraction

import pytest
import requests

from gpupool.hub.accounting.ledger import Ledger
from gpupool.policies.periods import utcnow
from harness import Hub
from gpupool.spawner.pool import AllocationStore, LocalPool, Request, declared_cards, process_alive
from gpupool.spawner.requeue import requeue

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
    # No heartbeat after the start (the hub's poll): what a server is billed to after it died unseen is then
    # either its recorded exit or its start, never something in between by chance.
    hub = Hub(tmp_path, POLICY, 'c.LocalGPUSpawner.run_as = "self"\nc.Spawner.poll_interval = 3600', mlflow=False)
    hub.start()
    yield hub
    hub.kill()
    hub.kill_leftovers()  # no server, orphaned service or proxy outlives the test


def position(hub: Hub, user: str, expected: str) -> str:
    """The first queue message of `user`'s spawn that contains `expected` (once the hub knows the spawn)."""
    deadline = time.monotonic() + 120
    while hub.server(user) is None and time.monotonic() < deadline:  # asked for again after the restart
        time.sleep(0.3)
    return hub.progress_until(user, lambda e: expected in e.get("message", ""), timeout=120)[-1]["message"]


def browser_login(hub: Hub, name: str, password: str) -> requests.Session:
    """A browser session of `name` (NativeAuthenticator's login form), as people log in."""
    browser = requests.Session()
    browser.get(f"{hub.url}/hub/login", timeout=30)
    form = {"username": name, "password": password, "_xsrf": browser.cookies.get("_xsrf", "")}
    reply = browser.post(f"{hub.url}/hub/login", data=form, timeout=30, allow_redirects=False)
    assert reply.status_code == 302, reply.text[-2000:]
    return browser


def sign_up_and_approve(hub: Hub, name: str, password: str) -> None:
    page = requests.Session()
    page.get(f"{hub.url}/hub/signup", timeout=30)
    form = {"username": name, "signup_password": password, "signup_password_confirmation": password,
            "_xsrf": page.cookies.get("_xsrf", "")}
    assert page.post(f"{hub.url}/hub/signup", data=form, timeout=30).status_code == 200
    (admin_password,) = re.findall(r"with the password (\S+)", hub.log.read_text())
    admin = browser_login(hub, "admin", admin_password)
    assert hub.approve(admin, name).status_code == 200


def test_queued_requests_come_back_in_order_after_a_hub_crash(hub):
    sign_up_and_approve(hub, "w2", "w2-password-long")  # first: a sign-up never takes an existing user's name
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
    home = browser_login(hub, "w2", "w2-password-long").get(f"{hub.url}/hub/home", timeout=30)
    assert home.status_code == 200 and home.url.endswith("/hub/home"), home.url
    assert "could not be queued again" in home.text and "No such profile: &#x27;h200-old&#x27;" in home.text
    # The order holds: the card goes to w1, not w3.
    hub.stop_server("holder")
    hub.wait_ready("w1")
    assert "w3/" not in hub.allocations()
    # Then to w3, once w1 leaves. Stopped only once it runs: JupyterHub answers a stop in the instant a spawn
    # finishes starting with a 500 (its handler gives a cancelled spawn 1 s, and on Python 3.11 `asyncio.wait_for`
    # drops a cancel that comes as what it waits for ends, so the spawn goes on: seen in CI).
    hub.stop_server("w1")
    hub.wait_ready("w3")
    hub.stop_server("w3")


def test_a_server_that_ends_while_the_hub_is_down_is_billed_to_its_exit(hub):
    hub.add_user("holder", "vision")
    assert hub.api("POST", "/users/holder/server").status_code in (201, 202)
    hub.wait_ready("holder")
    ledger = Ledger(hub.ledger_url, migrate=False)
    (interval,) = [i for i in ledger.open_intervals() if i.user == "holder"]
    while utcnow() - interval.start < timedelta(seconds=4):  # well after its last heartbeat (its start)
        time.sleep(0.2)
    (pid,) = [a.pid for a in AllocationStore(hub.state / "allocations.sqlite", owner="test").all()]
    hub.kill()
    killed = utcnow()
    os.kill(pid, signal.SIGKILL)
    while process_alive(pid, None):  # until it is gone or a zombie (reaped between two looks: gone)
        time.sleep(0.1)
    exits = hub.state / "exits"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (exits.is_dir() and any(
            p.name.startswith(f"{pid}-") and not p.name.endswith(".tmp") for p in exits.iterdir())):
        time.sleep(0.2)  # until its exit watcher has written when it ended
    restarted = utcnow()
    hub.start()
    deadline = time.monotonic() + 60
    while hub.server("holder") is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    (closed,) = [i for i in Ledger(hub.ledger_url, migrate=False).run_intervals(interval.run)]
    assert closed.how == "failed"
    # Exact to its exit (the ledger keeps whole seconds), not its last heartbeat nor the hub's restart.
    assert killed - timedelta(seconds=1) <= closed.end <= restarted, (killed, closed.end, restarted)
    assert closed.end - interval.start >= timedelta(seconds=4)


def test_a_hundred_waiting_requests_all_come_back_in_order(tmp_path):
    """More requests than the HTTP client's connections, each held by the hub as long as a pending spawn is (its
    slow_spawn_timeout): all came back, not the 20 that got a connection within tornado's 20 s queue wait."""
    from tornado import web
    from tornado.httpserver import HTTPServer
    from tornado.netutil import bind_sockets

    from gpupool.policies import load_policy

    waiting = 100
    store = AllocationStore(tmp_path / "allocations.sqlite", owner="before-the-crash")
    for i in range(waiting):
        store.enqueue(Request(key=f"u{i:03}/", user=f"u{i:03}", team="vision", profile="h200",
                              display_name="1 × H200", model="H200", share=Fraction(1)), {"profile": "h200"})
    (tmp_path / "policies").mkdir()
    for name, text in POLICY.items():
        (tmp_path / "policies" / name).write_text(text)
    pool = LocalPool(declared_cards(load_policy(tmp_path / "policies")),
                     AllocationStore(tmp_path / "allocations.sqlite", owner="after-the-restart"))
    assert len(pool.restoring) == waiting
    asked: list[str] = []

    class HubDouble(web.RequestHandler):
        """The restarted hub's REST API as the requeue meets it: a POST of a spawn that waits in the queue is
        answered 202 once the hub's slow_spawn_timeout has passed (3 s here, 10 s by default); one is first
        refused with 429, as when the concurrent_spawn_limit is reached."""

        def get(self):
            self.finish({"version": "6"})

        async def post(self, user):
            assert self.request.headers["Authorization"] == "token the-queue-token"
            assert json.loads(self.request.body) == {"profile": "h200"}
            asked.append(user)
            if user == "u050" and asked.count(user) == 1:  # its concurrent_spawn_limit, reached by others' spawns
                self.set_status(429)
                self.set_header("Retry-After", "1")
                return
            await asyncio.sleep(3)
            self.set_status(202)

    async def run():
        sockets = bind_sockets(0, "127.0.0.1")
        server = HTTPServer(web.Application([(r"/hub/api/", HubDouble), (r"/hub/api/users/([^/]+)/server", HubDouble)]))
        server.add_sockets(sockets)
        try:
            await requeue(pool, f"http://127.0.0.1:{sockets[0].getsockname()[1]}/hub/api", "the-queue-token",
                          logging.getLogger("test"))
        finally:
            server.stop()

    asyncio.run(run())
    users = [f"u{i:03}" for i in range(waiting)]
    lost = {u: store.lost(u) for u in users}
    assert {u: q[0].lost for u, q in lost.items() if q} == {}  # the old client: "Timeout in request queue"
    assert sorted(asked) == sorted([*users, "u050"])  # each asked for once, u050 again after its 429
    assert [q.request.key for q in store.queued()] == [f"{u}/" for u in users]  # all still waiting, in their order
    assert not pool.restoring  # the queue moves on
