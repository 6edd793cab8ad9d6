"""Memory at rest: the whole embedded platform (`gpupool up`: hub, proxy, services) idle, next to a plain
`jupyterhub` with the same proxy, in one run.

Each is started on a fresh temporary state, left until it is idle (its process tree used under 2 % of a core
over 3 s, after its services answer), and measured by PSS (proportional set size: shared pages split among the
processes sharing them, so the sum is what the platform costs the machine), summed over its process tree. Prints
each process and the totals, and the ratio. Issue 33's target: at most 600 MB for gpupool. Needs what `make up`
installs (the proxy in node_modules/); PSS of other users' processes needs root.

    .venv/bin/python bench/footprint.py [--no-mlflow] [--before]

`--before` measures gpupool a second time with MLflow run as before issue 33 (the `mlflow server` command
waiting for its uvicorn child), for the before/after figures of docs/tests.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

from gpupool.hub.config import proxy_command
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harness, tests/harness.py
from harness import Hub, free_port_block  # noqa: E402

JUPYTERHUB = Path(sys.executable).parent / "jupyterhub"
MIB = 1024 * 1024
TARGET_MB = 600
POLICY = {
    "policy.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 1}]
teams:
  vision: {members: []}
profiles:
  cpu: {display_name: CPU only, teams: [vision], default: true}
billing: {prices: {H200: '3.20'}}
""",
}


def tree(root: int) -> list[psutil.Process]:
    top = psutil.Process(root)
    return [top, *top.children(recursive=True)]


def wait_idle(root: int, timeout: float = 300, window: float = 3.0, share: float = 0.02) -> float:
    """Wait until the process tree of `root` used under `share` of a core over `window` seconds; the wait."""
    began = time.monotonic()

    def cpu() -> float:
        total = 0.0
        for process in tree(root):
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                total += times.user + times.system
        return total

    while time.monotonic() - began < timeout:
        before = cpu()
        time.sleep(window)
        if cpu() - before < share * window:
            return time.monotonic() - began
    raise TimeoutError(f"pid {root}'s processes never went idle in {timeout:.0f} s")


def describe(process: psutil.Process) -> str:
    line = process.cmdline()
    words = [Path(line[0]).name] + line[1:] if line else [process.name()]
    # `python -m MODULE` and the supervisor's `... -- COMMAND`: the words that say which service it is.
    if "--" in words:
        words = ["(supervisor)", *[Path(w).name for w in words[words.index("--") + 1:]]]
    return " ".join(words)[:90]


def measure(title: str, root: int) -> float:
    rows = []
    for process in tree(root):
        with contextlib.suppress(psutil.Error):
            rows.append((process.memory_full_info().pss / MIB, process.pid, describe(process)))
    total = sum(pss for pss, _, _ in rows)
    print(f"\n{title}: {len(rows)} processes, {total:.0f} MiB PSS ({total * MIB / 1e6:.0f} MB)")
    for pss, pid, what in sorted(rows, reverse=True):
        print(f"  {pss:7.1f} MiB  {pid:>7}  {what}")
    return total


#: A jupyterhub_config.d snippet: MLflow's service as `mlflow server` with its uvicorn as a child (before issue 33).
MLFLOW_AS_BEFORE = f"""
for service in c.JupyterHub.services:
    if service["name"] == "mlflow":
        command = service["command"]
        at = command.index("gpupool.hub.mlflow_server")
        service["command"] = command[:at - 2] + [{str(Path(sys.executable).parent / "mlflow")!r}, "server"] + command[at + 1:]
"""


def gpupool(tmp: Path, mlflow: bool, before: bool = False) -> float:
    # Its own record of the machine's accounts: one platform per machine as root, and this one is the bench's.
    own = f"c.LocalGPUSpawner.identity_record = {str(tmp / 'identities.json')!r}\n"
    hub = Hub(tmp, POLICY, own + (MLFLOW_AS_BEFORE if before else ""), mlflow=mlflow)
    hub.start()
    try:
        for service in ("accounting", "jobs", "culler", *(["mlflow"] if mlflow else [])):
            hub.wait_service(service, "health" if service in ("accounting", "mlflow") else "")
        waited = wait_idle(hub.process.pid)
        print(f"gpupool up: idle after {waited:.0f} s", file=sys.stderr)
        return measure("gpupool up (hub, proxy, services)" + (", MLflow as before" if before else ""),
                       hub.process.pid)
    finally:
        hub.stop()
        hub.kill_leftovers()


def plain_jupyterhub(tmp: Path) -> float:
    port = free_port_block(3)
    config = tmp / "jupyterhub_config.py"
    config.write_text(f"""
c.JupyterHub.bind_url = "http://127.0.0.1:{port}/"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {port + 1}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{port + 2}"
c.ConfigurableHTTPProxy.command = {proxy_command()!r}
c.JupyterHub.db_url = "sqlite:///{tmp / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = "{tmp / 'cookie_secret'}"
""")
    with (tmp / "jupyterhub.log").open("w") as log:
        process = subprocess.Popen([str(JUPYTERHUB), "-f", str(config)], cwd=tmp, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp / "jupyterhub.log").read_text()[-3000:]
            with contextlib.suppress(requests.ConnectionError, requests.Timeout):
                if requests.get(f"http://127.0.0.1:{port}/hub/api/", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError((tmp / "jupyterhub.log").read_text()[-3000:])
            time.sleep(0.3)
        waited = wait_idle(process.pid)
        print(f"jupyterhub: idle after {waited:.0f} s", file=sys.stderr)
        return measure("plain jupyterhub (hub, proxy)", process.pid)
    finally:
        process.terminate()  # its cleanup stops the proxy
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-mlflow", action="store_true", help="gpupool without its MLflow service")
    parser.add_argument("--before", action="store_true",
                        help="also gpupool with MLflow as before issue 33 (`mlflow server` and its uvicorn child)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpupool-footprint-") as tmp:
        if args.before and not args.no_mlflow:
            before = gpupool(Path(tmp) / "before", True, before=True)
            print(f"\ngpupool up, MLflow as before: {before:.0f} MiB ({before * MIB / 1e6:.0f} MB)")
        ours = gpupool(Path(tmp) / "gpupool", not args.no_mlflow)
        plain_dir = Path(tmp) / "jupyterhub"
        plain_dir.mkdir()
        plain = plain_jupyterhub(plain_dir)
    print(f"\ngpupool up: {ours:.0f} MiB ({ours * MIB / 1e6:.0f} MB, target <= {TARGET_MB} MB); plain jupyterhub: "
          f"{plain:.0f} MiB; ratio {ours / plain:.2f}")
    return 0 if ours * MIB / 1e6 <= TARGET_MB else 1


if __name__ == "__main__":
    sys.exit(main())
