"""The platform's process lifecycle with real processes: services die with their hub, even when it is killed;
a hub that starts stops what an earlier run left; one platform per state folder; the login line comes when the
hub answers.

The supervisor tests run `python -m gpupool.hub.lifecycle` under a stand-in parent process that plays the hub
(a real process that is killed with SIGKILL); the end-to-end test does the same to a real `gpupool up`.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest
import requests

from gpupool.hub import lifecycle
from harness import GPUPOOL, Hub
from gpupool.spawner.pool import process_alive

#: A service that listens, starts a child of its own (as `mlflow server` starts uvicorn and job runners), and
#: on SIGTERM closes its socket and then takes "forever" to exit (as MLflow's interpreter teardown does).
SERVICE = textwrap.dedent("""
    import signal, socket, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
    print(listener.getsockname()[1], child.pid, flush=True)
    def teardown(*_):
        listener.close()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
    signal.signal(signal.SIGTERM, teardown)
    time.sleep(3600)
""")

#: Plays the hub: starts the supervised service the way JupyterHub does (own session), then waits.
HUB = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen(sys.argv[1:], start_new_session=True)
    time.sleep(3600)
""")


def wait_for(predicate, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


def service_processes(state: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(lifecycle.MARKER, "").startswith(f"{state}\x1f"):
                found.append(process)
        except psutil.Error:
            continue
    return found


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if process_alive(p.pid, p.create_time())]  # not gone, not a zombie


@pytest.fixture
def fake_hub(tmp_path):
    """A stand-in hub running one supervised SERVICE; yields (hub process, state folder)."""
    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "service.py").write_text(SERVICE)
    command = lifecycle.supervised({"name": "svc", "command": [sys.executable, str(tmp_path / "service.py")]},
                                   state)["command"]
    hub = subprocess.Popen([sys.executable, "-c", HUB, *command])
    record = state / "services" / "svc.json"
    wait_for(lambda: record.exists() and len(service_processes(state)) == 2, 60, "the service and its child")
    yield hub, state
    hub.kill()
    for process in service_processes(state):
        process.kill()


def test_a_service_and_its_children_die_when_their_hub_is_killed(fake_hub):
    hub, state = fake_hub
    supervisor = psutil.Process(lifecycle._read_json(state / "services" / "svc.json")["pid"])
    processes = [supervisor, *service_processes(state)]
    hub.kill()  # SIGKILL: nothing of the hub runs any clean-up
    hub.wait()
    wait_for(lambda: not alive(processes), 60, "the orphaned service and its child ending")
    assert not (state / "services" / "svc.json").exists()


def test_a_stop_request_ends_a_service_whose_teardown_hangs(fake_hub):
    hub, state = fake_hub
    supervisor = psutil.Process(lifecycle._read_json(state / "services" / "svc.json")["pid"])
    processes = service_processes(state)
    supervisor.send_signal(signal.SIGINT)  # what JupyterHub sends first to stop a service
    wait_for(lambda: not alive([supervisor]), 60, "the supervisor finishing the stop")
    assert not alive(processes)


def test_a_starting_hub_stops_the_services_an_earlier_run_left(fake_hub):
    hub, state = fake_hub
    processes = [psutil.Process(lifecycle._read_json(state / "services" / "svc.json")["pid"]),
                 *service_processes(state)]
    stopped = lifecycle.stop_stale_services(state)
    assert len(stopped) == 3, stopped
    assert not alive(processes)
    assert lifecycle.stale_service_processes(state) == []


def test_gpupool_up_refuses_a_second_platform_on_the_same_state_folder(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from gpupool.hub import lifecycle
        lifecycle.lock_state(Path({str(state)!r}))
        print("locked", flush=True)
        time.sleep(3600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        done = subprocess.run([GPUPOOL, "up", "--state-dir", str(state), "--port", "1"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg")})
        assert done.returncode == 1
        assert f"another gpupool platform runs on the state folder {state}" in done.stderr
        assert not (state / "admin.bcrypt").exists(), "nothing of a second platform is written"
    finally:
        holder.kill()


def free_base_port() -> int:
    """A PORT whose PORT..PORT+6 are free right now, as far as this machine can tell."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1] - 3
        if base > 1024 and not lifecycle.ports_in_use({base + offset: "" for offset in range(7)}):
            return base


def test_gpupool_up_refuses_ports_another_program_holds(tmp_path):
    port = free_base_port()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port + 3))  # where gpupool would put its accounting service
        squatter.listen()
        done = subprocess.run([GPUPOOL, "up", "--state-dir", str(tmp_path / "state"), "--port", str(port)],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg")})
    assert done.returncode == 1, done.stderr
    # Another program on this busy machine may hold one more of the seven ports in the meantime: then the message
    # names both, as "ports A (...), B (...) are in use"; the squatted one is always named.
    named = re.search(r"gpupool up: ports? (.*) (?:is|are) in use by another program", done.stderr)
    assert named, done.stderr
    assert f"{port + 3} (the accounting service)" in named.group(1).split(", "), done.stderr
    assert not (tmp_path / "state" / "admin.bcrypt").exists(), "nothing of the platform is written"


POLICY = {
    "policy.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 1}]
teams:
  vision: {members: [alice]}
profiles:
  cpu: {display_name: CPU only, teams: [vision], default: true}
billing: {prices: {H200: '3.20'}}
""",
}


def health(hub: Hub, service: str) -> dict:
    reply = requests.get(f"{hub.url}/services/{service}/health", timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()


def listening_on(ports: set[int]) -> list[psutil.Process]:
    """What listens on `ports`, with every process of the listeners' process groups (MLflow's children)."""
    groups = set()
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port in ports and connection.pid:
            try:
                groups.add(os.getpgid(connection.pid))
            except OSError:
                continue
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) in groups:
                found.append(process)
        except OSError:
            continue
    return found


def server_pid(hub: Hub, name: str) -> int:
    return hub.api("GET", f"/users/{name}").json()["servers"][""]["state"]["pid"]


def test_after_a_hub_crash_gpupool_up_serves_fresh_services_and_gpupool_down_stops_it(tmp_path):
    """Also `make up`'s terminal (the hub's log in a file, one block to act on) and `gpupool down`."""
    hub = Hub(tmp_path, POLICY, 'c.LocalGPUSpawner.run_as = "self"  # per-user system accounts: test_system_users.py')
    hub.verbose = False  # what `make up` shows: the harness's log is the terminal
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    seen = {}

    def open_the_printed_url():
        # What a person does: wait for the login line, then open the URL at once.
        wait_for(lambda: hub.log.exists() and b"gpupool: open " in hub.log.read_bytes(), 600, "the login line")
        try:
            seen["login"] = requests.get(f"{hub.url}/hub/login", timeout=30).status_code
        except requests.ConnectionError as error:
            seen["login"] = f"no answer: {error}"

    opener = threading.Thread(target=open_the_printed_url)
    opener.start()
    try:
        hub.start()
        opener.join()
        assert seen.get("login") == 200, f"the URL answers once the login line is printed, not {seen}"
        # The terminal: a few lines of gpupool's own, ending with one block: the URL, the admin's login, the log
        # file, how to stop. The hub's own log is in the state folder.
        terminal = hub.log.read_text()
        lines = terminal.splitlines()
        assert len(lines) <= 12 and all(line.startswith(("gpupool", " ")) for line in lines), terminal
        block = terminal[terminal.index("gpupool: open "):]
        assert f"open {hub.url}/ and log in as 'admin' with the password {hub.admin_password()}" in block
        assert f"the hub's log is in {hub.state / 'hub.log'}" in block, block
        assert "Ctrl-C here, or `gpupool down`" in block and "`gpupool down --servers`" in block, block
        assert "JupyterHub" in (hub.state / "hub.log").read_text()
        # The helper that printed the line leaves the hub no exited child to reap (no zombie per `gpupool up`).
        zombies = [c for c in psutil.Process(hub.process.pid).children() if c.status() == psutil.STATUS_ZOMBIE]
        assert not zombies, zombies
        hub.wait_service("mlflow", "health")
        before = {name: health(hub, name) for name in ("accounting", "mlflow")}
        assert before["accounting"]["version"] and before["mlflow"]["mlflow"]
        ports = {hub.port + 3, hub.port + 4}  # the accounting service's and MLflow's
        old = listening_on(ports)
        assert {"gpupool.hub.services.accounting_service", "uvicorn"} <= {
            part for p in old for part in p.cmdline()}
        # MLflow at rest is one process, its uvicorn, beside its supervisor (`mlflow server` waiting for a uvicorn
        # child held 232 MiB for nothing: issue 33)
        mlflow = [p.cmdline() for p in service_processes(hub.state)  # (the supervisor carries no marker)
                  if p.environ()[lifecycle.MARKER].endswith("\x1fmlflow")]
        assert len(mlflow) == 1 and "uvicorn" in mlflow[0], mlflow
        proxy = psutil.Process(int((hub.state / "proxy.pid").read_text()))

        # A second platform on the same state folder is refused while this one runs.
        second = hub.cli("up", "--state-dir", str(hub.state), "--port", str(hub.port + 10))
        assert second.returncode == 1 and "another gpupool platform runs" in second.stderr

        hub.kill()
        crashed = datetime.now(UTC)
        # The services end with their hub, the proxy is left (it keeps running servers reachable).
        wait_for(lambda: not alive(old), 60, "the crashed hub's services ending")
        hub.start()
        for name in ("accounting", "mlflow"):
            hub.wait_service(name, "health", timeout=60)
            fresh = health(hub, name)
            assert datetime.fromisoformat(fresh["started"]) > crashed, (name, before[name], fresh)
        assert not alive(old)
        assert not proxy.is_running(), "the old proxy was replaced"
        new = listening_on(ports)
        assert new and not {p.pid for p in new} & {p.pid for p in old}, "the services' ports are the new run's"

        # `gpupool down` from another folder stops the hub, its services and proxy, and leaves alice's server.
        hub.add_user("alice", "vision")
        assert hub.api("POST", "/users/alice/server").status_code in (201, 202)
        hub.wait_ready("alice")
        server = psutil.Process(server_pid(hub, "alice"))
        proxy = psutil.Process(int((hub.state / "proxy.pid").read_text()))
        services = service_processes(hub.state)
        down = hub.cli("down", cwd=elsewhere)
        assert down.returncode == 0, down.stderr
        assert hub.process.wait(30) is not None, "the hub has ended when `gpupool down` returns"
        assert not alive([proxy, *services]) and not alive(service_processes(hub.state)), down.stdout
        assert alive([server]), "a user's server keeps running"
        assert "users' servers and jobs keep running" in down.stdout and "--servers" in down.stdout, down.stdout

        # Started again, the hub takes the server back; `gpupool down --servers` stops it too.
        hub.start()
        hub.wait_ready("alice")
        assert server_pid(hub, "alice") == server.pid
        down = hub.cli("down", "--servers", cwd=elsewhere)
        assert down.returncode == 0, down.stderr
        assert "stopped 1 server(s): alice" in down.stdout, down.stdout
        hub.process.wait(30)
        wait_for(lambda: not alive([server]), 60, "alice's server ending")
        assert not alive(service_processes(hub.state))
        with pytest.raises(requests.ConnectionError):  # nothing listens: the hub and its proxy are gone
            requests.get(f"{hub.url}/hub/api/", timeout=10)

        again = hub.cli("down", cwd=elsewhere)
        assert again.returncode == 0 and "nothing of gpupool runs" in again.stdout, again.stdout + again.stderr
    finally:
        hub.stop()
        opener.join(5)
        for process in service_processes(hub.state):
            process.kill()
        hub.kill_leftovers()
    assert not alive(service_processes(hub.state)), "a clean stop ends every service process"


def test_gpupool_down_by_root_stops_only_processes_of_the_state_folders_owner(tmp_path):
    """A state folder an ordinary user owns is that user's word: root's `gpupool down --state-dir` on it never stops,
    because its hub.json or proxy.pid names them, processes that are not that user's (here: root's own)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the state folder is given to another user")
    state = tmp_path / "state"
    state.mkdir()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        started = psutil.Process(victim.pid).create_time()
        lifecycle.write_json(state / "hub.json", {"pid": victim.pid, "started": started})
        (state / "proxy.pid").write_text(str(victim.pid))
        assert lifecycle.running_hub(state) is not None  # root's own folder: its hub is root's process
        os.chown(state, 65534, 65534)  # the folder is nobody's now
        assert lifecycle.running_hub(state) is None
        assert lifecycle.stop_platform(state, timeout=5) == []
        assert victim.poll() is None, "root's process was stopped on the word of a folder it does not own"
    finally:
        victim.kill()
        victim.wait()
