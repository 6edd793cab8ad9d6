"""The user servers of `bench/culler.py`: a spawner whose servers are small HTTP processes, enough for what the
cullers ask, and whose state says that each holds a GPU share as gpupool's spawners' state does.

Run as a script, this file is the server: it answers `api/kernels` and `api/terminals` with `[]` (no kernel,
no terminal), anything else under its prefix with `{}` (the hub's readiness check takes any answer), and appends
one line per Jupyter API request to $BENCH_REQUEST_LOG, which is how the bench counts them. Imported (the hub
imports it by module name, with bench/ on its PYTHONPATH), it is the spawner.
"""

from __future__ import annotations

import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

JUPYTER_API = ("api/kernels", "api/terminals")


def serve() -> None:
    """Answer at $JUPYTERHUB_SERVICE_URL until interrupted (the spawner's stop sends SIGINT)."""
    bind = urlsplit(os.environ["JUPYTERHUB_SERVICE_URL"])
    prefix = os.environ["JUPYTERHUB_SERVICE_PREFIX"]
    request_log = os.environ.get("BENCH_REQUEST_LOG")
    jupyter_paths = {prefix + path for path in JUPYTER_API}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path in jupyter_paths:
                if request_log:
                    # One write of one short line in append mode: lines of a hundred servers never interleave.
                    with open(request_log, "a") as log:
                        log.write(path + "\n")
                self.answer(200, b"[]")
            elif path.startswith(prefix.rstrip("/")):
                self.answer(200, b"{}")
            else:
                self.answer(404, b'{"message": "not found"}')

        def answer(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass  # a hundred servers logging every request would only slow the machine

    server = ThreadingHTTPServer((bind.hostname, bind.port), Handler)
    server.daemon_threads = True
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    # The server process stops here: it never imports JupyterHub (a hundred of them start on two cores, and
    # JupyterHub's imports take half a second of CPU and tens of MB each).
    serve()
    sys.exit(0)

import uuid  # noqa: E402

import psutil  # noqa: E402
from jupyterhub.spawner import SimpleLocalProcessSpawner  # noqa: E402
from traitlets import Unicode, default  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # tests/harness.py
from harness import free_port_block  # noqa: E402


class BenchServerSpawner(SimpleLocalProcessSpawner):
    """Starts this file as the server, and records what gpupool's culler reads of a server holding a GPU share:
    the ledger run (`usage_run`), the options chosen (`choice`: profile and team), the server's PID and its start
    time (`pid_started`, so that the culler measures the CPU of the right process tree)."""

    profile = Unicode("h200", help="The profile every server is recorded as chosen with.").tag(config=True)
    team = Unicode("vision", help="The team every server is recorded as chosen for.").tag(config=True)

    @default("cmd")
    def _default_cmd(self):
        return [sys.executable, os.path.abspath(__file__)]

    usage_run = ""
    pid_started: float | None = None

    async def start(self):
        # Outside the ephemeral range, like the hub's own ports: a random port may meanwhile be taken by one of
        # the thousands of connections the bench opens.
        self.port = free_port_block(1)
        self.usage_run = f"bench-{uuid.uuid4().hex}"
        address = await super().start()
        self.pid_started = psutil.Process(self.pid).create_time()
        return address

    def get_state(self):
        state = super().get_state()
        if self.pid:
            state.update(usage_run=self.usage_run, pid_started=self.pid_started,
                         choice={"profile": self.profile, "team": self.team})
        return state

    def load_state(self, state):
        super().load_state(state)
        self.usage_run = state.get("usage_run", "")
        self.pid_started = state.get("pid_started")

    def clear_state(self):
        super().clear_state()
        self.usage_run, self.pid_started = "", None
