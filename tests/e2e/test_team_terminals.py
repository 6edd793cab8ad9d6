"""Team data shared inside the team and closed outside it, as three people use it in JupyterLab terminals.

Issue 19.4 (and its acceptance, "each through the JupyterLab terminal"): after alice's `dvc push` to the team
remote, carol of the same team got "Permission denied" on the objects, and `dvc get` of the team's registry
failed with "repository path … is not owned by current user". Here a real `gpupool up` runs as root, so each
server runs as its own Unix account (gp-alice, gp-carol, gp-bob); every command is typed into the user's own
JupyterLab terminal (its websocket, as JupyterLab drives it): alice makes the team's registry and its first
version, carol imports it and adds a second, alice imports carol's, bob of another team is refused both.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

from harness import Hub, Terminal
from gpupool.policies.identity import unix_group

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="servers run as their own Unix users only under a "
                                                           "hub run as root (CI runs the tests as root)")

POLICY = {
    "policy.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 1}]
teams:
  vision: {}
  nlp: {}
profiles:
  cpu: {display_name: CPU only, teams: [vision, nlp], default: true}
""",
}
PEOPLE = {"alice": "vision", "carol": "vision", "bob": "nlp"}


@pytest.fixture(scope="module")
def terminals():
    # The servers' accounts enter the team folders beside the state folder, so the folder is one of our own
    # in the system's temporary folder: pytest's are private, and every pytest that starts (JupyterHub's
    # contract tests run one) makes them private again.
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-team-terminals-"))
    os.chmod(tmp, 0o755)
    for parent in tmp.parents:
        assert parent.stat().st_mode & 0o005 == 0o005, f"{parent} is not open to every user"
    hub = Hub(tmp, POLICY, mlflow=False)
    accounts_before = {a.pw_name for a in pwd.getpwall()}
    hub.start()
    opened: dict[str, Terminal] = {}
    try:
        for user, team in PEOPLE.items():
            hub.add_user(user, team)
            reply = hub.api("POST", f"/users/{user}/server", json={"profile": "cpu"})
            assert reply.status_code in (201, 202), reply.text
        for user in PEOPLE:
            hub.wait_ready(user, timeout=300)
            token = hub.api("POST", f"/users/{user}/tokens", json={"note": "terminal"}).json()["token"]
            opened[user] = Terminal(hub.url, user, token, timeout=300)
        yield hub, opened
    finally:
        for terminal in opened.values():
            terminal.close()
        for user in PEOPLE:
            if hub.server(user):
                hub.stop_server(user, timeout=60)
        hub.stop()
        for process in psutil.process_iter(["cmdline"]):  # no server outlives the test
            if str(hub.state) in " ".join(process.info["cmdline"] or []):
                process.kill()
        for name in {a.pw_name for a in pwd.getpwall()} - accounts_before:
            subprocess.run(["userdel", "--remove", name], capture_output=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def test_each_server_is_its_own_account(terminals):
    _, term = terminals
    for user in PEOPLE:
        assert term[user].check("id -un").split()[-1] == f"gp-{user}"


def test_teammates_share_the_registry_and_remote_and_another_team_is_refused(terminals):
    hub, term = terminals
    registry = hub.team_root / "vision" / "datasets.git"
    alice, carol, bob = term["alice"], term["carol"], term["bob"]

    alice.check("mkdir -p ~/cats && echo 'version one' > ~/cats/labels.txt")
    alice.check("gpupool datasets init")
    alice.check("gpupool datasets add cats ~/cats --version v1")
    assert registry.is_dir()

    # carol imports alice's version (the registry is alice's, the objects were pushed by alice) ...
    carol.check("mkdir ~/work && cd ~/work && git init -q && dvc init -q")
    carol.check(f"cd ~/work && dvc import {registry} cats --rev cats@v1 -o cats-v1")
    assert "version one" in carol.check("cat ~/work/cats-v1/labels.txt")
    # ... and adds a version of her own, into folders alice's push made.
    carol.check("mkdir -p ~/cats2 && echo 'version two' > ~/cats2/labels.txt")
    carol.check("gpupool datasets add cats ~/cats2 --version v2")
    listed = carol.check("gpupool datasets list cats")
    assert "v1" in listed and "v2" in listed, listed

    # alice gets carol's version.
    alice.check("mkdir ~/work && cd ~/work && git init -q && dvc init -q")
    alice.check(f"cd ~/work && dvc import {registry} cats --rev cats@v2 -o cats-v2")
    assert "version two" in alice.check("cat ~/work/cats-v2/labels.txt")

    # Everything in the team's folder belongs to the team's group, which reads and writes it.
    team_gid = grp.getgrnam(unix_group("vision")).gr_gid
    for path in (hub.team_root / "vision").rglob("*"):
        if path.is_symlink():
            continue
        mode = path.lstat().st_mode
        assert path.lstat().st_gid == team_gid, (path, path.lstat().st_gid)
        if path.is_dir():  # anyone in the team adds files; they inherit the group
            assert mode & 0o070 == 0o070 and mode & stat.S_ISGID, (path, oct(mode))
        else:  # objects are read-only to their owner too (git, DVC); the team reads them
            assert mode & 0o040, (path, oct(mode))

    # bob, of team nlp, reaches none of it.
    status, shown = bob.run(f"ls {hub.team_root / 'vision'}")
    assert status != 0 and "Permission denied" in shown, shown
    bob.check("mkdir ~/work && cd ~/work && git init -q && dvc init -q")
    status, shown = bob.run(f"cd ~/work && dvc import {registry} cats --rev cats@v1 -o stolen")
    assert status != 0, shown
    status, _ = bob.run("test -e ~/work/stolen/labels.txt")
    assert status != 0


def test_homes_are_private_between_teammates(terminals):
    _, term = terminals
    status, shown = term["carol"].run("ls ~gp-alice")
    assert status != 0 and "Permission denied" in shown, shown
