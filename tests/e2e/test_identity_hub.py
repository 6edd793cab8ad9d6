"""The identity rule at the door of a real hub: the sign-up page, the REST API, and a server's git author.

A real `gpupool up` (JupyterHub, NativeAuthenticator, proxy, JupyterLab servers); names are sent as a person
or an admin's script would send them.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from urllib.parse import quote

import psutil
import pytest
import requests
import websocket

from harness import Hub

POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}\ninventory:\n"
                 "  - {model: H200, count: 1}\n",
    "teams.yaml": "teams:\n  vision: {}\n  nlp: {}\n",
    "profiles.yaml": "profiles:\n  cpu: {display_name: CPU only, teams: [vision, nlp], default: true}\n",
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub(tmp_path_factory.mktemp("identity"), POLICY, 'c.LocalGPUSpawner.run_as = "self"\n', mlflow=False)
    hub.start()
    yield hub
    for user in hub.api("GET", "/users").json():
        if user["servers"]:
            hub.api("DELETE", f"/users/{user['name']}/server")
    hub.stop()
    for process in psutil.process_iter(["cmdline"]):  # no server outlives the test
        if str(hub.state) in " ".join(process.info["cmdline"] or []):
            process.kill()


def test_rest_api_creates_only_names_that_pass_the_rule(hub):
    assert hub.api("POST", "/users/alice").status_code in (201, 409)
    refused = {
        "Alice": "did you mean 'alice'", "ALICE": "did you mean 'alice'",
        "аlice": "not accepted",  # Cyrillic а: NFKC keeps it, the pattern refuses it
        "-rf": "not accepted", "a.b": "not accepted", "alice.": "not accepted",
        "vision": "team's name", "postgres": "reserved", "root": "reserved", "sysadmin": "administrator",
        "a-lice": "existing user 'alice'",
    }
    for name, why in refused.items():
        reply = hub.api("POST", f"/users/{quote(name)}")
        assert reply.status_code == 400, (name, reply.status_code, reply.text)
        assert why in reply.json()["message"], (name, reply.json())
        assert hub.api("GET", f"/users/{quote(name)}").status_code == 404, name
    assert hub.api("POST", "/users/frank").status_code == 201
    reply = hub.api("PATCH", "/users/frank", json={"name": "vision"})
    assert reply.status_code == 400 and "team's name" in reply.json()["message"]
    assert hub.api("PATCH", "/users/frank", json={"name": "frank2"}).status_code == 200
    reply = hub.api("POST", "/users", json={"usernames": ["carol", "-rf"]})
    assert reply.status_code == 400 and "'-rf'" in reply.json()["message"]
    assert hub.api("GET", "/users/carol").status_code == 404, "nothing is half-made"


def test_group_members_are_named_exactly(hub):
    hub.add_user("alice", "nlp")
    for name, why in (("Alice", "did you mean 'alice'"), ("-rf", "not accepted"), ("аlice", "not accepted")):
        reply = hub.api("POST", "/groups/vision/users", json={"users": [name]})
        assert reply.status_code == 400 and why in reply.json()["message"], (name, reply.text)
    assert "alice" not in hub.api("GET", "/groups/vision").json()["users"]


def _signup(hub: Hub, username: str) -> str:
    browser = requests.Session()
    page = browser.get(f"{hub.url}/hub/signup", timeout=30)
    assert page.status_code == 200, page.text[-500:]
    xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page.text).group(1)
    reply = browser.post(f"{hub.url}/hub/signup", timeout=30, data={
        "username": username, "signup_password": "a long enough password 42",
        "signup_password_confirmation": "a long enough password 42", "_xsrf": xsrf})
    assert reply.status_code == 200
    return reply.text


@pytest.mark.parametrize("name, why", [
    ("vision", "team&#39;s name"), ("postgres", "reserved"), ("-rf", "not accepted"), ("a.b", "not accepted"),
    ("аlice", "not accepted"), ("adm1n", "administrator"),
])
def test_signup_page_says_why_a_name_is_refused(hub, name, why):
    page = _signup(hub, name)
    assert "Sign-up refused" in page and why in page, page[-3000:]


def test_signup_normalises_the_name(hub):
    tag = uuid.uuid4().hex[:6]
    page = _signup(hub, f"Dora{tag}")
    assert "Your information has been sent to the admin" in page, page[-3000:]
    page = _signup(hub, f"DORA{tag}")
    assert "already in use" in page  # the same person, not a second user


def test_a_signup_never_takes_an_existing_users_name_however_written(hub):
    """Issue 33: a sign-up as `ａｖａ` (full-width) filed a request for the existing, password-less hub user `ava`,
    whose approval would have given ava's account to whoever signed up."""
    assert hub.api("POST", "/users/ava").status_code in (201, 409)  # made by the admin: no sign-up, no password
    for typed in ("ａｖａ", "AVA", "ava"):
        page = _signup(hub, typed)
        assert "Sign-up refused" in page and "already in use" in page, (typed, page[-3000:])
        assert "has been sent to the admin" not in page
    admin = hub.log_in("admin", hub.admin_password())
    sign_ups = admin.get(f"{hub.url}/hub/authorize", timeout=60)
    assert sign_ups.status_code == 200 and not re.search(r'authorize/ava"', sign_ups.text), (
        "a sign-up request for the existing user ava was filed: approving it would give ava's account away")


def terminal(hub: Hub, name: str, command: str, until: str, timeout: float = 120) -> str:
    """Run `command` in a new JupyterLab terminal of `name`'s server, as the browser does; its output."""
    base = f"{hub.url}/user/{name}/api/terminals"
    made = hub.session.post(base, timeout=60)
    assert made.status_code == 200, made.text
    term = made.json()["name"]
    ws = websocket.create_connection(f"ws://127.0.0.1:{hub.port}/user/{name}/terminals/websocket/{term}",
                                     header=[f"Authorization: token {hub.token}"], timeout=timeout)
    try:
        ws.send(json.dumps(["stdin", command + "\r"]))
        seen, deadline = "", time.monotonic() + timeout
        ws.settimeout(2)  # short reads: the server's pings would keep a long one waiting forever
        while until not in seen and time.monotonic() < deadline:
            try:
                message = json.loads(ws.recv())
            except websocket.WebSocketTimeoutException:
                continue
            if message[0] == "stdout":
                seen += message[1]
        assert until in seen, seen
        return seen
    finally:
        ws.close()
        hub.session.delete(f"{base}/{term}", timeout=30)


def test_git_commit_works_in_a_new_servers_terminal(hub):
    """Issue 12.10: `git commit` in a server failed with "Author identity unknown"."""
    hub.add_user("erin", "vision")
    reply = hub.api("POST", "/users/erin/server", json={"profile": "cpu"})
    assert reply.status_code in (201, 202), reply.text
    hub.wait_ready("erin", timeout=240)
    out = terminal(hub, "erin", "cd $(mktemp -d) && git init -q && git commit -q --allow-empty -m first && "
                                "git log --format='author=%an <%ae>' && echo DONE-$((6*7))", "DONE-42")
    assert "Author identity unknown" not in out
    assert re.search(r"author=erin <erin@[^>\s]+>", out), out
