"""Drive a `gpupool up` process through the hub's REST API: start, stop, users, spawns, progress, kernels.

Used by the end-to-end tests and `bench/spawn.py`; it talks to the real hub and servers, nothing is faked.
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
from pathlib import Path

import requests
import websocket  # websocket-client, a Jupyter Server dependency

from gpupool.spawner.pool import AllocationStore

GPUPOOL = Path(sys.executable).parent / "gpupool"


def service_config(token: str, extra: str = "") -> str:
    """A jupyterhub_config.d snippet adding a `harness` service with the scopes driving servers needs."""
    return f"""
c.JupyterHub.services.append({{"name": "harness", "api_token": {token!r}}})
c.JupyterHub.load_roles.append({{
    "name": "harness",
    "scopes": ["admin:users", "admin:servers", "access:servers", "admin:groups", "read:users", "tokens"],
    "services": ["harness"],
}})
# Test machines are small and busy (servers, MLflow and the tests share two cores): servers get time to answer.
c.Spawner.http_timeout = 240
{extra}
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

    def __init__(self, tmp: Path, policy_files: dict[str, str], extra_config: str = "", ledger_url: str | None = None,
                 mlflow_backend_url: str | None = None, mlflow: bool = True):
        self.token = uuid.uuid4().hex
        self.policies = tmp / "policies"
        self.policies.mkdir(parents=True)
        for name, text in policy_files.items():
            (self.policies / name).write_text(text)
        self.state = tmp / "state"
        (self.state / "jupyterhub_config.d").mkdir(parents=True)
        (self.state / "jupyterhub_config.d" / "harness.py").write_text(service_config(self.token, extra_config))
        self.team_root = tmp / "teams"
        self.port = free_port_block(5)
        self.ledger_url = ledger_url or f"sqlite:///{self.state / 'ledger.sqlite'}"
        self.mlflow_backend_url = mlflow_backend_url
        self.mlflow = mlflow  # tests that do not use MLflow start faster without it
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = tmp / "hub.log"
        # Where `gpupool up` records the running platform for the `gpupool` command: the test's own, so that
        # the CLI finds this hub (and no other test's) from any folder.
        self.env = {**os.environ, "XDG_STATE_HOME": str(tmp / "xdg-state")}
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {self.token}"

    def start(self) -> None:
        log = self.log.open("a")
        logged = self.log.stat().st_size
        env = self.env
        self.process = subprocess.Popen(
            [GPUPOOL, "up", "--state-dir", str(self.state), "--port", str(self.port), "--policies", str(self.policies),
             "--ledger-url", self.ledger_url, "--team-root", str(self.team_root),
             *(["--mlflow-backend-url", self.mlflow_backend_url] if self.mlflow_backend_url else []),
             *([] if self.mlflow else ["--no-mlflow"])],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        # The hub answers once its managed services are up (MLflow takes a while on a busy machine); `gpupool up`
        # prints the login line then, which is what a person waits for.
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if (self.session.get(f"{self.url}/hub/api/users", timeout=5).status_code == 200
                        and b"gpupool: open " in self.log.read_bytes()[logged:]):
                    return
            except (requests.ConnectionError, requests.Timeout):
                pass
            time.sleep(0.3)
        raise TimeoutError(self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            # JupyterHub stops its managed services (MLflow among them) first: interrupt, then terminate.
            self.process.wait(90)

    def wait_service(self, name: str, path: str = "", timeout: float = 120) -> None:
        """Wait until the managed service `name` answers `path` through the proxy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/services/{name}/{path}", timeout=5).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"service {name} does not answer\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL the hub process (a crash): its services, proxy and servers are left as they are."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def cli(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run `gpupool ARGS` as a person would: from another folder (`cwd`), finding this hub by itself."""
        return subprocess.run([str(GPUPOOL), *args], cwd=cwd or self.log.parent, env=self.env, capture_output=True,
                              text=True, timeout=120, check=False)

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
            header=[f"Authorization: token {self.token}"], timeout=60,
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

    def stop_server(self, name: str, timeout: float = 30) -> None:
        reply = self.api("DELETE", f"/users/{name}/server")
        assert reply.status_code in (202, 204), reply.text
        deadline = time.monotonic() + timeout
        while self.server(name) and time.monotonic() < deadline:
            time.sleep(0.2)

    def allocations(self) -> dict[str, tuple[str, ...]]:
        return {a.key: a.cards for a in AllocationStore(self.state / "allocations.sqlite", owner="test").all()}
