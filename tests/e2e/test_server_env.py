"""Run as root: every server runs as its user, from the servers' environment, with the platform's tools.

A real `gpupool up` as root with its defaults (no `run_as` set), real Unix users (fresh, unique names, removed
afterwards), driven the way a person does: a JupyterLab terminal through its websocket, a notebook kernel, the
REST API with the hub's token. Also: users' own packages (`pip install --user`, `%pip install`) in their home,
the shared environment unchanged (hash of its site-packages), the platform's packages not shadowable, and the
start-time refusal when users' servers could only run as root.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import psutil
import pytest
import requests
import websocket

from harness import GPUPOOL, Hub
from gpupool.policies.identity import unix_group, unix_user
from gpupool.spawner.local import ROOT_SERVER_ENV, default_server_env, runnable_by_others, server_env_paths

pytestmark = pytest.mark.skipif(os.getuid() != 0 or shutil.which("useradd") is None,
                                reason="needs root and useradd: creates real system users and servers run as them")

ENV = Path(os.environ.get("GPUPOOL_SERVER_ENV") or ROOT_SERVER_ENV)
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\r")


def env_site_packages() -> Path:
    return Path(subprocess.check_output([ENV / "bin" / "python", "-c",
                                         "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True).strip())


def tree_hash(folder: Path) -> str:
    """Every file's path, size, mode and modification time: any install or removal changes it."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        digest.update(f"{path.relative_to(folder)}\0{info.st_size}\0{info.st_mode}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def make_wheel(folder: Path, name: str, body: str) -> Path:
    """A pure-Python wheel written directly (no build tool, no network): `name` with `body` as its __init__."""
    version, dist = "1.0", f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": body,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: gpupool-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        data = text.encode()
        hashed = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={hashed},{len(data)}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    os.chmod(wheel, 0o644)
    return wheel


class Terminal:
    """A JupyterLab terminal of a server, driven through its websocket as the browser does."""

    def __init__(self, hub: Hub, user: str):
        reply = hub.session.post(f"{hub.url}/user/{user}/api/terminals", timeout=60)
        assert reply.status_code == 200, reply.text
        self.name = reply.json()["name"]
        self.ws = websocket.create_connection(
            f"ws://127.0.0.1:{hub.port}/user/{user}/terminals/websocket/{self.name}",
            header=[f"Authorization: token {hub.token}"], timeout=300)
        self.ws.send(json.dumps(["set_size", 50, 250, 1000, 1000]))

    def run(self, command: str) -> tuple[int, str]:
        """Run `command` in the terminal's shell; its exit status and what it printed."""
        marker = uuid.uuid4().hex[:8]
        self.ws.send(json.dumps(["stdin", f"{command}; echo {marker}-$?-{marker}\r"]))
        seen = ""
        while True:
            message = json.loads(self.ws.recv())
            if message[0] != "stdout":
                continue
            seen += message[1]
            found = re.search(rf"{marker}-(\d+)-{marker}", ANSI.sub("", seen))
            if found:
                output = ANSI.sub("", seen)[:found.start()]
                # Drop the echoed command line itself: it names the marker ("echo M-$?-M"), the output never does.
                # (Not by matching the line whole: the terminal's echo of a typed line may carry redraws.)
                last = output.rfind(marker)
                if last >= 0:
                    end = output.find("\n", last)
                    output = output[end + 1:] if end >= 0 else ""
                return int(found.group(1)), output

    def close(self) -> None:
        self.ws.close()


@pytest.fixture(scope="module")
def env():
    assert (ENV / "bin" / "python").exists(), f"no servers' environment at {ENV}: run `make install` as root"
    return ENV


@pytest.fixture(scope="module")
def platform(env):
    """A root hub with gpupool's defaults, two fresh users in a fresh team, each with a running CPU server."""
    tag = uuid.uuid4().hex[:6]
    team, alice, bob = f"rmt{tag}", f"rma{tag}", f"rmb{tag}"
    # Not under pytest's tmp folders (0700, root's): the servers' users must reach the team root and wheels.
    root = Path(f"/tmp/gpupool-rootmode-{tag}")
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    policy = {
        "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [whole]}\n"
                     "inventory:\n  - {model: H200, count: 1}\n",
        "teams.yaml": f"teams:\n  {team}: {{quota: {{gpus: 1, per_user_gpus: 1}}}}\n",
        "profiles.yaml": f"profiles:\n  cpu: {{display_name: CPU only, teams: [{team}], default: true}}\n",
    }
    hub = Hub(root, policy, mlflow=False)  # no run_as: what `make up` does as root
    hub.start()
    try:
        for user in (alice, bob):
            hub.add_user(user, team)
            assert hub.api("POST", f"/users/{user}/server", json={"profile": "cpu"}).status_code in (201, 202)
        for user in (alice, bob):
            hub.wait_ready(user, timeout=300)
        yield {"hub": hub, "alice": alice, "bob": bob, "team": team, "root": root}
    finally:
        for user in (alice, bob):
            hub.api("DELETE", f"/users/{user}/server")
        hub.stop()
        for process in psutil.process_iter(["username"]):  # nothing of the test users outlives the test
            if process.info["username"] in (unix_user(alice), unix_user(bob)):
                process.kill()
        for user in (alice, bob):
            subprocess.run(["userdel", "--remove", unix_user(user)], capture_output=True, check=False)
            shutil.rmtree(f"/run/gpupool/servers/{user}", ignore_errors=True)
        subprocess.run(["groupdel", unix_group(team)], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def restart(hub: Hub, user: str) -> None:
    hub.stop_server(user, timeout=120)
    assert hub.server(user) is None, "the server did not stop"
    reply = hub.api("POST", f"/users/{user}/server", json={"profile": "cpu"})
    assert reply.status_code in (201, 202), reply.text
    hub.wait_ready(user, timeout=300)


# --- the environment ------------------------------------------------------------------------------------------


def test_the_environment_is_readable_by_every_user_and_writable_only_by_root(env):
    assert runnable_by_others(env / "bin" / "python")
    assert not str(Path(os.path.realpath(env / "bin" / "python"))).startswith("/root")
    writable = [p for p in [env, *env.rglob("*")] if not p.is_symlink()
                and (p.lstat().st_uid != 0 or p.lstat().st_mode & (stat.S_IWGRP | stat.S_IWOTH))]
    assert not writable[:5]
    # gpupool itself is installed, not an editable link into a checkout users cannot read
    shown = subprocess.run([env / "bin" / "python", "-m", "pip", "show", "-f", "gpupool"], capture_output=True,
                           text=True, check=True).stdout
    assert "Editable project location" not in shown and "spawner/local.py" in shown
    for tool in ("jupyterhub-singleuser", "dvc", "mlflow", "papermill", "gpupool", "pip"):
        assert (env / "bin" / tool).exists(), tool


def test_root_defaults_pick_the_environment_and_servers_as_users(env, monkeypatch):
    from gpupool.spawner.local import LocalGPUSpawner

    monkeypatch.delenv("GPUPOOL_SERVER_ENV", raising=False)
    monkeypatch.delenv("GPUPOOL_UNSAFE_SINGLE_USER", raising=False)
    if env == ROOT_SERVER_ENV:
        assert default_server_env() == str(ROOT_SERVER_ENV)
    spawner = LocalGPUSpawner(server_env=str(env))
    assert spawner.run_as == "user"
    assert spawner.cmd == [str(env / "bin" / "jupyterhub-singleuser")]
    paths = server_env_paths(str(env), "/home/someone", "/root/.pyenv/shims:/usr/bin", "user")
    assert paths["PATH"].split(":")[:2] == [str(env / "bin"), "/home/someone/.local/bin"]
    assert "/root" not in paths["PATH"] and paths["PYTHONUSERBASE"] == "/home/someone/.local"


# --- refusing to start when servers could only run as root -----------------------------------------------------


def up_alone(tmp: Path, server_env: str, *args: str) -> tuple[subprocess.Popen, Path]:
    state, log = tmp / "state", tmp / "up.log"
    env = {**os.environ, "GPUPOOL_SERVER_ENV": server_env}
    env.pop("GPUPOOL_UNSAFE_SINGLE_USER", None)
    process = subprocess.Popen([GPUPOOL, "up", "--state-dir", str(state), "--port", str(_port()), "--no-mlflow",
                                "--team-root", str(tmp / "teams"), "--verbose", *args],
                               stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return process, log


def _port() -> int:
    from harness import free_port_block

    return free_port_block(7)


@pytest.mark.parametrize("where", ["missing", "private"])
def test_up_refuses_to_start_when_servers_would_run_as_root(tmp_path, where):
    # the test's own .venv lives on pyenv's interpreter under /root (0700): no other user can run it
    server_env = str(tmp_path / "nothing-here") if where == "missing" else sys.prefix
    if where == "private" and runnable_by_others(Path(sys.prefix) / "bin" / "python"):
        pytest.skip("this test's own environment is runnable by other users")
    process, log = up_alone(tmp_path, server_env)
    try:
        assert process.wait(180) != 0, "gpupool up started although users' servers would run as root"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(60)
    text = log.read_text()
    assert "refusing to start" in text and "--unsafe-single-user" in text, text[-2000:]
    assert "could not run as their users" in text


def test_up_with_unsafe_single_user_starts_and_says_so_loudly(tmp_path):
    process, log = up_alone(tmp_path, str(tmp_path / "nothing-here"), "--unsafe-single-user")
    try:
        deadline = time.monotonic() + 180
        while "EVERY USER'S SERVER RUNS AS ROOT" not in log.read_text():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(90)
        # A hub stopped while it starts may leave its proxy (its own session): the next `gpupool up` would replace
        # it (state/proxy.pid); here nothing outlives the test.
        try:
            os.kill(int((tmp_path / "state" / "proxy.pid").read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


# --- a real server of a real user -----------------------------------------------------------------------------


def test_server_runs_as_its_user_and_cannot_read_the_hub_state(platform, env):
    hub, alice = platform["hub"], platform["alice"]
    terminal = Terminal(hub, alice)
    try:
        status, out = terminal.run("id -un; id -u")
        assert status == 0 and out.split()[-2:] == [unix_user(alice), str(pwd.getpwnam(unix_user(alice)).pw_uid)], out
        for secret in ("cli-token", "admin.bcrypt", "jupyterhub_cookie_secret"):
            status, out = terminal.run(f"cat {hub.state / secret}")
            assert status != 0 and "Permission denied" in out, out
        status, out = terminal.run(f"ls {hub.state}")
        assert status != 0 and "Permission denied" in out, out
    finally:
        terminal.close()
    kernel = hub.run_in_kernel(alice, "import os, sys; print(os.getuid(), sys.executable)")
    assert kernel.split() == [str(pwd.getpwnam(unix_user(alice)).pw_uid), str(env / "bin" / "python")]


def test_the_terminal_has_the_platforms_tools_first_on_path(platform, env):
    hub, alice = platform["hub"], platform["alice"]
    terminal = Terminal(hub, alice)
    try:
        for tool in ("python", "pip", "dvc", "mlflow", "papermill", "gpupool"):
            status, out = terminal.run(f"command -v {tool}")
            assert status == 0 and out.strip().splitlines()[-1] == str(env / "bin" / tool), (tool, out)
        status, out = terminal.run("dvc --version && mlflow --version && python -c 'import mlflow, dvc, gpupool.hub'")
        assert status == 0, out
        # a private platform never phones home: DVC's analytics (and its banner on init) are off
        status, out = terminal.run("cd $(mktemp -d) && git init -q && dvc init && echo $DVC_NO_ANALYTICS")
        assert status == 0 and "analytics" not in out.lower() and out.strip().endswith("1"), out
    finally:
        terminal.close()
    # in a notebook, `!dvc` finds the same command
    assert hub.run_in_kernel(alice, "!command -v dvc").strip() == str(env / "bin" / "dvc")


def test_jupyterlab_news_and_update_check_are_off(platform):
    hub, alice = platform["hub"], platform["alice"]
    setting = hub.session.get(
        f"{hub.url}/user/{alice}/lab/api/settings/@jupyterlab/apputils-extension:notification", timeout=60)
    assert setting.status_code == 200, setting.text
    defaults = setting.json()["schema"]["properties"]  # the environment's overrides.json sets the defaults
    assert defaults["fetchNews"]["default"] == "false" and defaults["checkForUpdates"]["default"] is False
    news = hub.session.get(f"{hub.url}/user/{alice}/lab/api/news", timeout=60)
    assert news.status_code == 200 and news.json()["news"] == []
    update = hub.session.get(f"{hub.url}/user/{alice}/lab/api/update", timeout=60)
    assert update.status_code == 200 and update.json()["notification"] is None


def test_users_own_packages_persist_and_touch_nobody_else(platform, env):
    hub, alice, bob, root = platform["hub"], platform["alice"], platform["bob"], platform["root"]
    site_packages = env_site_packages()
    before = tree_hash(site_packages)
    by_terminal = make_wheel(root, f"rmterm{uuid.uuid4().hex[:6]}", "VALUE = 'from the terminal'\n")
    by_kernel = make_wheel(root, f"rmkern{uuid.uuid4().hex[:6]}", "VALUE = 'from the kernel'\n")
    first, second = by_terminal.name.split("-")[0], by_kernel.name.split("-")[0]

    terminal = Terminal(hub, alice)
    try:
        status, out = terminal.run(f"pip install --user --no-index {by_terminal}")
        assert status == 0 and "Successfully installed" in out, out
    finally:
        terminal.close()
    out = hub.run_in_kernel(alice, f"%pip install --no-index {by_kernel}")
    assert "Successfully installed" in out, out
    home = Path(pwd.getpwnam(unix_user(alice)).pw_dir)
    installed = list((home / ".local" / "lib").glob(f"python3.11/site-packages/{first}/__init__.py"))
    assert installed and installed[0].stat().st_uid == pwd.getpwnam(unix_user(alice)).pw_uid
    assert tree_hash(site_packages) == before, "a user's install changed the shared environment"

    restart(hub, alice)
    code = f"import {first}, {second}; print({first}.VALUE, '|', {second}.VALUE)"
    assert hub.run_in_kernel(alice, code).strip() == "from the terminal | from the kernel"
    with pytest.raises(AssertionError, match="ModuleNotFoundError"):
        hub.run_in_kernel(bob, f"import {first}")
    assert tree_hash(site_packages) == before


def test_a_users_copy_of_a_platform_package_cannot_break_the_server(platform, env):
    hub, alice = platform["hub"], platform["alice"]
    account = pwd.getpwnam(unix_user(alice))
    site = Path(account.pw_dir) / ".local" / "lib" / "python3.11" / "site-packages"
    # What a user's stray `pip install --user --force` or copy leaves: packages of the platform's names that raise.
    for name in ("jupyter_server", "jupyterhub", "tornado"):
        (site / name).mkdir(parents=True, exist_ok=True)
        (site / name / "__init__.py").write_text(f"raise ImportError('a broken user copy of {name}')\n")
    for path in [site.parents[2], *site.parents[2].rglob("*")]:
        os.chown(path, account.pw_uid, account.pw_gid)
    try:
        restart(hub, alice)
        out = hub.run_in_kernel(alice, "import jupyter_server, sys, site; print(jupyter_server.__file__); "
                                       "print(site.getusersitepackages() in sys.path)")
        where, user_site_on_path = out.split()
        assert where.startswith(str(env)) and user_site_on_path == "True", out
        order = hub.run_in_kernel(alice, "import sys; print('\\n'.join(sys.path))").split()
        assert order.index(str(env_site_packages())) < order.index(str(site))
        assert not [p for p in order if p.startswith("/usr/lib/python3/dist-packages")]
    finally:
        for name in ("jupyter_server", "jupyterhub", "tornado"):
            shutil.rmtree(site / name)


def test_a_users_own_kernel_appears_in_jupyterlab(platform):
    hub, alice = platform["hub"], platform["alice"]
    terminal = Terminal(hub, alice)
    try:
        status, out = terminal.run("python -m ipykernel install --user --name mine --display-name 'My kernel'")
        assert status == 0, out
    finally:
        terminal.close()
    specs = hub.session.get(f"{hub.url}/user/{alice}/api/kernelspecs", timeout=60).json()["kernelspecs"]
    assert specs["mine"]["spec"]["display_name"] == "My kernel"


def test_papermill_runs_a_parameterised_notebook_in_the_terminal(platform):
    hub, alice = platform["hub"], platform["alice"]
    notebook = {
        "cells": [
            {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": "x = 1", "outputs": [],
             "execution_count": None},
            {"cell_type": "code", "metadata": {}, "source": "print('x squared is', x * x)", "outputs": [],
             "execution_count": None},
        ],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    account = pwd.getpwnam(unix_user(alice))
    home = Path(account.pw_dir)
    (home / "in.ipynb").write_text(json.dumps(notebook))
    os.chown(home / "in.ipynb", account.pw_uid, account.pw_gid)
    terminal = Terminal(hub, alice)
    try:
        status, out = terminal.run("papermill in.ipynb out.ipynb -p x 7")
        assert status == 0, out
    finally:
        terminal.close()
    assert "x squared is 49" in (home / "out.ipynb").read_text()


def test_an_nbgitpuller_link_clones_a_repository_into_the_home(platform):
    hub, alice, root = platform["hub"], platform["alice"], platform["root"]
    account = pwd.getpwnam(unix_user(alice))
    source = root / "course"
    source.mkdir()
    (source / "lesson.md").write_text("# lesson one\n")
    git = ["git", "-C", str(source), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    for step in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "lesson"]):
        subprocess.run([*git, *step], check=True)
    for path in [source, *source.rglob("*")]:  # the user's own material: git trusts only its owner's repositories
        os.chown(path, account.pw_uid, account.pw_gid)
    link = f"{hub.url}/user/{alice}/git-pull?repo=file://{source}&branch=main&urlpath=lab/tree/course/lesson.md"
    page = hub.session.get(link, timeout=60)
    assert page.status_code == 200 and "nbgitpuller" in page.text.lower()
    events = []
    with hub.session.get(f"{hub.url}/user/{alice}/git-pull/api",
                         params={"repo": f"file://{source}", "branch": "main", "targetpath": "course"},
                         stream=True, timeout=300) as stream:
        for line in stream.iter_lines(decode_unicode=True):
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                if events[-1].get("phase") in ("finished", "error"):
                    break
    assert events[-1]["phase"] == "finished", events
    cloned = Path(account.pw_dir) / "course" / "lesson.md"
    assert cloned.read_text() == "# lesson one\n" and cloned.stat().st_uid == account.pw_uid
