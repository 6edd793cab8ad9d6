"""One culling pass over N running servers: gpupool's GPU-aware idle culler (`gpupool.hub.culler.IdleCuller`)
against jupyterhub-idle-culler (its `cull_idle`), on the same hub, passes interleaved in one run.

The hub is a real JupyterHub behind its real proxy (configurable-http-proxy); its servers are small HTTP processes
(`bench/culler_servers.py`) whose state holds a GPU share as gpupool's spawners' does. gpupool's culler reads each
server's process tree (CPU), NVML (unavailable without a driver, which it says) and its record in the ledger, and
asks no server anything (servers report their kernels to it; the reports are not part of a pass). Both cullers
run in this process, configured as their services are, each with its service's token and scopes. Per pass, after
one warm-up pass of each: wall time, requests to the hub's REST API (gpupool: its `hub_requests` metric;
jupyterhub-idle-culler: its tornado fetches to the hub) and requests the servers received. Neither stops anything
(idle limits of years); the bench checks that every server still runs at the end. Prints a table and the ratio of
the median passes.

    .venv/bin/python bench/culler.py [--servers 100] [--passes 5] [--batch 10] [--gpu-source nvml|none]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests
from jupyterhub_idle_culler import cull_idle
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from gpupool.hub.culler import IdleCuller
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harness, tests/harness.py
from harness import free_port_block  # noqa: E402
from gpupool.policies import defaults
from gpupool.spawner.wiring import CULLER_SCOPES

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
JUPYTERHUB = Path(sys.executable).parent / "jupyterhub"
PROXY = ROOT / "node_modules" / ".bin" / "configurable-http-proxy"
#: jupyterhub-idle-culler's README: the scopes its service needs when it culls servers and not users.
IDLE_CULLER_SCOPES = ("list:users", "read:users:activity", "read:servers", "delete:servers")
#: Neither culler may stop a server during the bench: idle limits far beyond its length.
NEVER_MINUTES = 10**6
POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [whole]}\n"
                 "inventory:\n  - {model: H200, count: 2}\n",
    "teams.yaml": "teams:\n  vision: {quota: {gpus: 4, per_user_gpus: 1}}\n",
    "profiles.yaml": "profiles:\n  h200: {display_name: 1 × H200, gpu: {model: H200, count: 1}, teams: [vision]}\n",
    "settings.yaml": f"settings:\n  idle: {{after_minutes: {NEVER_MINUTES}}}\n",
}


def hub_config(tmp: Path, port: int, tokens: dict[str, str], request_log: Path) -> str:
    """jupyterhub_config.py: the bench's spawner, the proxy, and one service (token and role) per client."""
    scopes = {"gpupool-culler": list(CULLER_SCOPES), "idle-culler": list(IDLE_CULLER_SCOPES),
              "bench": ["admin:users", "admin:servers"]}
    services = [{"name": name, "api_token": token} for name, token in tokens.items()]
    roles = [{"name": f"{name}-role", "scopes": scopes[name], "services": [name]} for name in tokens]
    return f"""
c.JupyterHub.bind_url = "http://127.0.0.1:{port}/"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{port + 1}/"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{port + 2}"
c.ConfigurableHTTPProxy.command = [{str(PROXY)!r}]
c.ConfigurableHTTPProxy.pid_file = {str(tmp / "proxy.pid")!r}
c.JupyterHub.db_url = {f"sqlite:///{tmp / 'jupyterhub.sqlite'}"!r}
c.JupyterHub.cookie_secret_file = {str(tmp / "cookie_secret")!r}
c.JupyterHub.authenticator_class = "null"
c.JupyterHub.spawner_class = "culler_servers.BenchServerSpawner"
c.SimpleLocalProcessSpawner.home_dir_template = {str(tmp / "homes" / "{username}")!r}
c.Spawner.ip = "127.0.0.1"
c.Spawner.environment = {{"BENCH_REQUEST_LOG": {str(request_log)!r}}}
# Two cores start a hundred servers: each gets time to answer, and the hub time to come back after a restart.
c.Spawner.http_timeout = 120
c.Spawner.start_timeout = 120
c.JupyterHub.init_spawners_timeout = 120
c.JupyterHub.services = {json.dumps(services)}
c.JupyterHub.load_roles = {json.dumps(roles)}
"""


class BenchHub:
    """A JupyterHub process (and its proxy) in `tmp`, and the servers the bench starts on it."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = free_port_block(3)  # the proxy's public port, the hub's, the proxy's API
        self.public_url = f"http://127.0.0.1:{self.port}/"
        self.api_url = f"http://127.0.0.1:{self.port + 1}/hub/api"
        self.tokens = {name: uuid.uuid4().hex for name in ("gpupool-culler", "idle-culler", "bench")}
        self.request_log = tmp / "server-requests.log"
        self.request_log.touch()
        self.log = tmp / "hub.log"
        self.process: subprocess.Popen | None = None
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {self.tokens['bench']}"

    def api(self, method: str, path: str, **kw) -> requests.Response:
        return self.session.request(method, self.api_url + path, timeout=120, **kw)

    def start(self) -> None:
        config = self.tmp / "jupyterhub_config.py"
        config.write_text(hub_config(self.tmp, self.port, self.tokens, self.request_log))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
        with self.log.open("w") as log:
            # Its own session: a Ctrl-C of the bench reaches the bench only, which then stops the hub in order.
            self.process = subprocess.Popen([str(JUPYTERHUB), "-f", str(config)], cwd=self.tmp, env=env,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the hub exited ({self.process.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(requests.ConnectionError, requests.Timeout):
                if self.session.get(self.public_url + "hub/api/", timeout=5).status_code == 200:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"the hub did not answer in 120 s:\n{self.log_tail()}")

    def log_tail(self, size: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-size:]

    def ready_servers(self) -> int:
        reply = self.api("GET", "/users?state=ready&limit=1",
                         headers={"Accept": "application/jupyterhub-pagination+json"})
        reply.raise_for_status()
        return reply.json()["_pagination"]["total"]

    def start_servers(self, count: int, batch: int) -> None:
        """Create `count` users and start their servers, `batch` spawns at a time, with progress on stderr."""
        names = [f"user{i:04d}" for i in range(count)]
        reply = self.api("POST", "/users", json={"usernames": names})
        assert reply.status_code == 201, reply.text
        began = time.monotonic()
        for first in range(0, count, batch):
            for name in names[first:first + batch]:
                reply = self.api("POST", f"/users/{name}/server", json={})
                assert reply.status_code in (201, 202), f"{name}: {reply.status_code} {reply.text}"
            self.wait_ready(min(first + batch, count), timeout=180)
            print(f"servers: {min(first + batch, count)}/{count} ready ({time.monotonic() - began:.0f} s)",
                  file=sys.stderr, flush=True)

    def wait_ready(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (ready := self.ready_servers()) < count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise TimeoutError(f"{ready} of {count} servers ready after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the hub, which stops its servers and its proxy; then end whatever of them outlived it."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            started = psutil.Process(self.process.pid).children(recursive=True)  # the proxy and the servers
        except psutil.Error:
            started = []
        print(f"stopping the hub, its proxy and {max(0, len(started) - 1)} servers", file=sys.stderr, flush=True)
        self.process.terminate()  # JupyterHub's cleanup stops every server and the proxy
        try:
            self.process.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # the hub and the proxy: the servers have their sessions
            self.process.wait()
        for process in started:
            with contextlib.suppress(psutil.Error):
                if process.is_running():  # the same process still (psutil checks its start time)
                    process.kill()
        self.session.close()


@dataclass
class Passes:
    seconds: list[float] = field(default_factory=list)
    hub_requests: list[int] = field(default_factory=list)
    server_requests: list[int] = field(default_factory=list)


@contextlib.contextmanager
def counted_fetches(prefix: str):
    """Count the tornado requests to URLs under `prefix` (jupyterhub-idle-culler's to the hub) while open."""
    original, count = AsyncHTTPClient.fetch, [0]

    def fetch(self, request, *args, **kwargs):
        if (request.url if isinstance(request, HTTPRequest) else request).startswith(prefix):
            count[0] += 1
        return original(self, request, *args, **kwargs)

    AsyncHTTPClient.fetch = fetch
    try:
        yield count
    finally:
        AsyncHTTPClient.fetch = original


def server_requests(hub: BenchHub) -> int:
    return hub.request_log.read_bytes().count(b"\n")


async def measure(hub: BenchHub, servers: int, passes: int, gpu_source: str, policies: Path) -> dict[str, Passes]:
    gpupool = IdleCuller(hub_api_url=hub.api_url, api_token=hub.tokens["gpupool-culler"], public_url=hub.public_url,
                         policy_dir=str(policies), ledger_url=defaults.ledger_url(hub.tmp), gpu_source=gpu_source,
                         interval=60)
    gpupool.initialize([])  # no argv: the bench's own arguments are not the culler's
    idle_log = logging.getLogger("bench.jupyterhub-idle-culler")
    idle_log.setLevel(logging.WARNING)

    def hub_requests_so_far() -> int:
        return int(gpupool.metrics.registry.get_sample_value("gpupool_culler_hub_requests_total") or 0)

    async def gpupool_pass() -> int:
        before = hub_requests_so_far()
        await gpupool.cull_pass()
        return hub_requests_so_far() - before

    async def idle_culler_pass() -> int:
        # Its service's defaults (concurrency 10, the hub's default page size), an inactivity limit of years.
        with counted_fetches(hub.api_url) as count:
            await cull_idle(hub.api_url, hub.tokens["idle-culler"], inactive_limit=NEVER_MINUTES * 60,
                            logger=idle_log, concurrency=10)
        return count[0]

    cullers = {"gpupool IdleCuller": gpupool_pass, "jupyterhub-idle-culler": idle_culler_pass}
    results = {name: Passes() for name in cullers}
    for round_ in range(passes + 1):  # round 0 warms up: imports, connections, the culler's first look
        for name, one_pass in cullers.items():
            served = server_requests(hub)
            began = time.perf_counter()
            hub_count = await one_pass()
            took = time.perf_counter() - began
            if round_:
                results[name].seconds.append(took)
                results[name].hub_requests.append(hub_count)
                results[name].server_requests.append(server_requests(hub) - served)
        if round_:
            took = ", ".join(f"{name} {r.seconds[-1]:.3f} s" for name, r in results.items())
            print(f"pass {round_}/{passes}: {took}", file=sys.stderr, flush=True)
    culled = sum(sample.value for metric in gpupool.metrics.culled.collect() for sample in metric.samples
                 if sample.name.endswith("_total"))  # summed over its labels (team, cause)
    assert not culled, f"gpupool's culler stopped {culled:g} servers"
    looked = results["gpupool IdleCuller"].server_requests
    if any(count != 2 * servers for count in looked):  # kernels and terminals, once per server and pass
        print(f"warning: gpupool's culler asked the servers {looked} times per pass, not {2 * servers}: some "
              "servers went unexamined", file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=100, help="running servers on the hub")
    parser.add_argument("--passes", type=int, default=5, help="measured passes of each culler (after a warm-up)")
    parser.add_argument("--batch", type=int, default=10, help="servers started at a time")
    parser.add_argument("--gpu-source", choices=["nvml", "none"], default="nvml",
                        help="gpupool's GPU signal (nvml, its embedded default, is unavailable without a driver)")
    args = parser.parse_args()
    # A SIGTERM ends the bench through its `finally`, as a Ctrl-C does: no server outlives it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-bench-culler-"))
    hub, kept = BenchHub(tmp), False
    try:
        policies = tmp / "policies"
        policies.mkdir()
        for name, text in POLICY.items():
            (policies / name).write_text(text)
        hub.start()
        hub.start_servers(args.servers, args.batch)
        results = asyncio.run(measure(hub, args.servers, args.passes, args.gpu_source, policies))
        still = hub.ready_servers()
        assert still == args.servers, f"{args.servers - still} servers were stopped during the bench"
    except Exception:
        kept = True
        print(f"the hub's log and configuration are kept in {tmp}", file=sys.stderr)
        raise
    finally:
        hub.stop()
        if not kept:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"{'culler':<26}{'servers':>9}{'median pass s':>15}{'min pass s':>12}{'hub requests/pass':>19}"
          f"{'server requests/pass':>22}")
    for name, measured in results.items():
        print(f"{name:<26}{args.servers:>9}{statistics.median(measured.seconds):>15.3f}{min(measured.seconds):>12.3f}"
              f"{statistics.median(measured.hub_requests):>19g}{statistics.median(measured.server_requests):>22g}")
    gpupool, baseline = (statistics.median(r.seconds) for r in results.values())
    print(f"ratio (gpupool / jupyterhub-idle-culler, median pass time): {gpupool / baseline:.2f}")
    print(f"(whole bench: {time.monotonic() - began:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
