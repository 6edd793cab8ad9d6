"""Drive a `gpupool up` process through the hub's REST API: start, stop, users, spawns, progress, kernels.

Used by the end-to-end tests (`tests/e2e/`, imported by name: `tests` is on pytest's `pythonpath`) and the
benchmarks in `bench/` (which put `tests/` on `sys.path`); it talks to the real hub and servers, nothing is
faked. Not part of the product: it is not installed with gpupool.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests
import websocket  # websocket-client, a Jupyter Server dependency

from gpupool.policies import defaults
from gpupool.spawner.accounts import DEFAULT_RECORD, claim_machine
from gpupool.spawner.pool import AllocationStore

#: The state folders this process's root hubs took the machine's accounts over for (`claim_machine`): the session
#: gives the record back at its end only while it names one of these, not another test session's platform.
CLAIMED: set[str] = set()

GPUPOOL = Path(sys.executable).parent / "gpupool"


def platform_command(unix_user: str | None) -> Path:
    """The `gpupool` a hub run as `unix_user` uses: as the tests' own user, this environment's; as an ordinary
    user (the tests run as root), the platform root installed for every user (the servers' environment,
    /opt/gpupool/env), which that user can run wherever the checkout and the tests' interpreter live."""
    if unix_user is None:
        return GPUPOOL
    return Path(os.environ.get("GPUPOOL_SERVER_ENV") or "/opt/gpupool/env") / "bin" / "gpupool"


def service_config(token: str, extra: str = "") -> str:
    """A jupyterhub_config.d snippet adding a `harness` service with the scopes driving servers needs."""
    return f"""
c.JupyterHub.services.append({{"name": "harness", "api_token": {token!r}}})
c.JupyterHub.load_roles.append({{
    "name": "harness",
    "scopes": ["admin:users", "admin:servers", "access:servers", "admin:groups", "read:users", "tokens",
               "read:metrics"],
    "services": ["harness"],
}})
# Test machines are small and busy (servers, MLflow and the tests share two cores): servers get time to answer.
c.Spawner.http_timeout = 240
{extra}
"""


def wait_for(what, timeout: float = 180, every: float = 0.5, message: str = ""):
    """What `what()` returns once it is true, asked every `every` seconds; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s: {message}")


def _ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections (and `bind(0)`): never hand these to a server to bind later."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port_block(n: int = 3) -> int:
    """The first of `n` consecutive free ports for a hub and its services, outside the ephemeral range.

    The services bind their ports seconds after this returns; a port from the ephemeral range could meanwhile be
    taken by any outgoing connection of the machine (the tests', the hub's, PostgreSQL clients'), which made a
    hub's service fail with "address already in use". Ports below the range are only ever taken by a bind.
    """
    ephemeral = _ephemeral_ports()
    candidates = [base for base in range(10000, 65536 - n, n)
                  if not any(port in ephemeral for port in (base, base + n - 1))]
    for base in random.sample(candidates, min(200, len(candidates))):
        sockets = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
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
                 mlflow_backend_url: str | None = None, mlflow: bool = True, unix_user: str | None = None,
                 up_args: tuple[str, ...] | None = None):
        self.token = uuid.uuid4().hex
        self.policies = tmp / "policies"
        self.policies.mkdir(parents=True)
        for name, text in policy_files.items():
            (self.policies / name).write_text(text)
        self.state = tmp / "state"
        (self.state / "jupyterhub_config.d").mkdir(parents=True)
        (self.state / "jupyterhub_config.d" / "harness.py").write_text(service_config(self.token, extra_config))
        self.team_root = tmp / "teams"
        self.port = free_port_block(7)
        self.ledger_url = ledger_url or defaults.ledger_url(self.state)
        self.mlflow_backend_url = mlflow_backend_url
        self.mlflow = mlflow  # tests that do not use MLflow start faster without it
        # More of `gpupool up`'s arguments. Run by an ordinary user, gpupool is a personal workstation (the admin
        # alone): the tests' hubs serve several people, so they opt in, unless a test asks for none (`up_args=()`).
        ordinary = unix_user is not None or os.geteuid() != 0
        self.up_args = up_args if up_args is not None else ("--unsafe-shared-as-user",) if ordinary else ()
        #: Run `gpupool up` as this ordinary Unix user (the tests run as root) instead of as the tests' user.
        self.unix_user = unix_user
        self.command = platform_command(unix_user)
        #: The hub's own log into `log` with gpupool's lines (`gpupool up --verbose`): tests read what the hub logged.
        self.verbose = True
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log = tmp / "hub.log"
        # Where `gpupool up` records the running platform for the `gpupool` command: the test's own, so that
        # the CLI finds this hub (and no other test's) from any folder.
        self.env = {**os.environ, "XDG_STATE_HOME": str(tmp / "xdg-state")}
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {self.token}"

    def start(self) -> None:
        if os.geteuid() == 0 and not self.unix_user:
            # Each test's hub is a new install on this machine, the earlier tests' platforms are gone: this one
            # takes the machine's accounts over (what an admin does by removing the old state folder).
            claim_machine(self.state, DEFAULT_RECORD, take_over=True)
            CLAIMED.add(str(Path(self.state).resolve()))
        log = self.log.open("a")
        logged = self.log.stat().st_size
        env = dict(self.env)
        as_user = {}
        if self.unix_user:
            import pwd

            account = pwd.getpwnam(self.unix_user)
            as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
            env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name)
        self.process = subprocess.Popen(
            [self.command, "up", *self.up_args, "--state-dir", str(self.state), "--port", str(self.port), "--policies", str(self.policies),
             "--ledger-url", self.ledger_url, "--team-root", str(self.team_root),
             *(["--mlflow-backend-url", self.mlflow_backend_url] if self.mlflow_backend_url else []),
             *([] if self.mlflow else ["--no-mlflow"]), *(["--verbose"] if self.verbose else [])],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, **as_user,
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

    def kill_leftovers(self, *folders: Path) -> None:
        """SIGKILL every process still running from this hub's folder or `folders` (its servers, which a stopped
        hub leaves running by design, jobs, services), by command line or working directory, and the proxy of a
        killed hub (whose command line names no folder)."""
        import psutil

        with contextlib.suppress(OSError, ValueError):
            os.kill(int((self.state / "proxy.pid").read_text()), signal.SIGKILL)
        names = [str(self.log.parent), *map(str, folders)]
        for process in psutil.process_iter(["cmdline", "cwd"]):
            line, cwd = " ".join(process.info["cmdline"] or []), process.info["cwd"] or ""
            if any(name in line or name in cwd for name in names):
                with contextlib.suppress(psutil.Error):
                    process.kill()

    def cli(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run `gpupool ARGS` as a person would: from another folder (`cwd`), finding this hub by itself."""
        return subprocess.run([str(self.command), *args], cwd=cwd or self.log.parent, env=self.env, capture_output=True,
                              text=True, timeout=120, check=False)

    def api(self, method: str, path: str, **kw) -> requests.Response:
        return self.session.request(method, f"{self.url}/hub/api{path}", timeout=30, **kw)

    def add_user(self, name: str, team: str) -> None:
        assert self.api("POST", f"/users/{name}").status_code in (201, 409)
        assert self.api("POST", f"/groups/{team}/users", json={"users": [name]}).status_code == 200

    @staticmethod
    def server_path(name: str, server: str = "") -> str:
        """The REST path of `name`'s server: the default one (`server` ""), or the named server `server`."""
        return f"/users/{name}/servers/{server}" if server else f"/users/{name}/server"

    def server(self, name: str, server: str = "") -> dict | None:
        return self.api("GET", f"/users/{name}").json()["servers"].get(server)

    def wait_ready(self, name: str, timeout: float = 120, server: str = "") -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.server(name, server)
            if found and found["ready"]:
                return found
            time.sleep(0.5)
        raise TimeoutError(f"{name}'s server {server!r} not ready: {self.server(name, server)}\n"
                           f"{self.log.read_text()[-3000:]}")

    def admin_password(self) -> str:
        """The admin's password, as `gpupool up` printed it on first start."""
        (password,) = re.findall(r"with the password (\S+)", self.log.read_text())
        return password

    def log_in(self, name: str, password: str) -> requests.Session:
        """A browser's session of `name`, logged in on the login page (cookies; `_xsrf` for its forms)."""
        session = requests.Session()
        session.get(f"{self.url}/hub/login", timeout=30)
        reply = session.post(f"{self.url}/hub/login", timeout=60, allow_redirects=False,
                             data={"username": name, "password": password, "_xsrf": session.cookies.get("_xsrf", "")})
        assert reply.status_code == 302, f"{name} could not log in: {reply.status_code} {reply.text[-2000:]}"
        return session

    def sign_up(self, names: list[str], password: str) -> dict[str, requests.Session]:
        """People sign up on the sign-up page, the admin approves them, they log in: their sessions, by name."""
        for name in names:
            session = requests.Session()
            session.get(f"{self.url}/hub/signup", timeout=30)
            reply = session.post(f"{self.url}/hub/signup", timeout=60, data={
                "username": name, "signup_password": password, "signup_password_confirmation": password,
                "_xsrf": session.cookies.get("_xsrf", "")})
            assert reply.status_code == 200 and "has been sent to the admin" in reply.text, reply.text[-2000:]
        admin = self.log_in("admin", self.admin_password())
        for name in names:
            assert self.approve(admin, name).status_code == 200
        return {name: self.log_in(name, password) for name in names}

    def approve(self, admin: requests.Session, name: str) -> requests.Response:
        """The admin presses Authorize (or Unauthorize) for `name` on /hub/authorize: a form POST with the page's
        _xsrf token, as the browser sends it. The answer is the sign-up page the hub redirects to."""
        page = admin.get(f"{self.url}/hub/authorize", timeout=60)
        token = re.search(r'name="_xsrf" value="([^"]*)"', page.text)
        assert token, f"no sign-up form on /hub/authorize: {page.status_code} {page.text[-2000:]}"
        return admin.post(f"{self.url}/hub/authorize/{name}", data={"_xsrf": html.unescape(token.group(1))}, timeout=60)

    def user_token(self, name: str) -> str:
        """A new API token of user `name`, with the user's own permissions (made with the harness's `tokens`)."""
        reply = self.api("POST", f"/users/{name}/tokens", json={"note": "test"})
        assert reply.status_code == 201, reply.text
        return reply.json()["token"]

    def progress_until(self, name: str, predicate, timeout: float = 60, server: str = "") -> list[dict]:
        """Progress events of `name`'s spawn (of the named server `server`) until one satisfies `predicate`."""
        events = []
        with self.session.get(f"{self.url}/hub/api{self.server_path(name, server)}/progress", stream=True,
                              timeout=timeout) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if predicate(events[-1]):
                        break
        return events

    def run_in_kernel(self, name: str, code: str) -> str:
        """Run `code` in a new kernel of `name`'s server and return what it printed on stdout.

        Its stderr (warnings, logs) is left out: the kernel flushes the two streams apart, in no fixed order, so a
        warning could otherwise land after the last line a test reads. It is in the error when the code raises.
        """
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
        output: dict[str, list[str]] = {"stdout": [], "stderr": []}
        while True:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                output.setdefault(msg["content"]["name"], []).append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                raise AssertionError("\n".join([*msg["content"]["traceback"], "stderr:", *output["stderr"]]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        ws.close()
        self.session.delete(f"{base}/kernels/{kernel_id}", timeout=30)
        return "".join(output["stdout"])

    def stop_server(self, name: str, timeout: float = 30, server: str = "") -> None:
        reply = self.api("DELETE", self.server_path(name, server))
        assert reply.status_code in (202, 204), reply.text
        deadline = time.monotonic() + timeout
        while self.server(name, server) and time.monotonic() < deadline:
            time.sleep(0.2)

    def allocations(self) -> dict[str, tuple[str, ...]]:
        return {a.key: a.cards for a in AllocationStore(self.state / "allocations.sqlite", owner="test").all()}


#: Escape sequences a terminal emits around its output (colours, title, cursor moves, bracketed paste).
_TERMINAL_CONTROLS = re.compile(r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b\[[0-?]*[ -/]*[@-~]|\x1b[()][0-9A-B]|\x1b[=>]")


class Terminal:
    """A JupyterLab terminal of a user's server, driven as JupyterLab drives it.

    JupyterLab creates a terminal with `POST /user/NAME/api/terminals` and talks to it over the websocket
    `terminals/websocket/TERMINAL` in terminado's protocol: it sends `["stdin", text]` and `["set_size", rows,
    cols]`, it receives `["setup", {}]` and `["stdout", text]`. `run` types a command and reads until a marker
    that only the shell's own output can contain, so that it knows the command's end and exit status.
    """

    def __init__(self, hub_url: str, user: str, token: str, timeout: float = 120):
        self.user, self.timeout = user, timeout
        headers = {"Authorization": f"token {token}"}
        reply = requests.post(f"{hub_url}/user/{user}/api/terminals", headers=headers, timeout=timeout)
        assert reply.status_code == 200, f"JupyterLab did not open a terminal: {reply.status_code} {reply.text[:500]}"
        self.name = reply.json()["name"]
        ws_url = hub_url.replace("http://", "ws://", 1) + f"/user/{user}/terminals/websocket/{self.name}"
        self.ws = websocket.create_connection(ws_url, header=[f"{k}: {v}" for k, v in headers.items()],
                                              timeout=timeout)
        # Wide enough that no command line wraps (a wrapped echo would cut the marker apart).
        self.ws.send(json.dumps(["set_size", 50, 400, 900, 1200]))

    def run(self, command: str, timeout: float | None = None) -> tuple[int, str]:
        """Type `command` (one line) and wait for its end: its exit status and what the terminal showed."""
        marker = f"END{uuid.uuid4().hex}"
        # The typed line shows `MARKER:%s`; only printf's output has `MARKER:` followed by digits.
        self.ws.send(json.dumps(["stdin", f"{command}; printf '\\n{marker}:%s\\n' $?\r"]))
        end = re.compile(rf"\n{marker}:(\d+)\n")
        text = ""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"`{command}` did not end in {self.user}'s terminal; it showed:\n{text[-3000:]}")
            self.ws.settimeout(left)
            try:
                message = json.loads(self.ws.recv())
            except websocket.WebSocketTimeoutException:
                continue
            if message[0] == "stdout":
                text += _TERMINAL_CONTROLS.sub("", message[1]).replace("\r", "")
                found = end.search(text)
                if found:
                    return int(found.group(1)), text[:found.start()]
            elif message[0] == "disconnect":
                raise AssertionError(f"{self.user}'s terminal closed while running `{command}`:\n{text[-3000:]}")

    def check(self, command: str, timeout: float | None = None) -> str:
        """`run`, asserting exit status 0 (the terminal's text in the message otherwise)."""
        status, output = self.run(command, timeout)
        assert status == 0, f"`{command}` exited with {status} in {self.user}'s JupyterLab terminal:\n{output[-3000:]}"
        return output

    def close(self) -> None:
        self.ws.close()


def _address(url: str) -> str:
    """A request's URL without its query and fragment: what a page's periodic refresh asks again."""
    return url.split("#", 1)[0].split("?", 1)[0]


class Browser:
    """Headless Chromium (Debian `chromium` + `chromium-driver`) driven by selenium, logging its console and network.

    `requests()` and `console_errors()` read what the page did, as the browser's developer tools show it.
    """

    FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,900",
             "--disable-dev-shm-usage")

    def __init__(self, chromium: str, chromedriver: str):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in self.FLAGS:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
        self.driver = webdriver.Chrome(service=Service(chromedriver), options=options)
        self._responses: dict[str, dict] = {}
        self._pending: dict[str, str] = {}
        self._answered: set[str] = set()  # URLs a request of this page has finished at
        self._console: list[dict] = []

    def get(self, url: str) -> None:
        self.driver.get(url)

    def log_in_as(self, hub_url: str, session: requests.Session) -> None:
        """Take the login of `session` (a person's cookies for the hub at `hub_url`): cookies are set for the
        page's site, so a page of the hub is opened first."""
        self.get(f"{hub_url}/hub/login")
        for cookie in session.cookies:
            self.driver.add_cookie({"name": cookie.name, "value": cookie.value, "path": cookie.path or "/"})

    def screenshot_whole_page(self, path: Path) -> Path:
        """A screenshot of the whole page (the window grown to its height, at most 3000 pixels)."""
        height = self.driver.execute_script("return document.documentElement.scrollHeight")
        self.driver.set_window_size(1400, max(900, min(height + 120, 3000)))
        return self.screenshot(path)

    def wait(self, condition, timeout: float = 120, message: str = ""):
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout).until(condition, message)

    def wait_for_text(self, words: str, timeout: float = 120) -> str:
        """The page's text, once it contains `words`."""
        from selenium.common.exceptions import TimeoutException

        try:
            self.wait(lambda d: words in self.text(), timeout)
        except TimeoutException:
            raise AssertionError(f"{words!r} never appeared on {self.driver.current_url}; the page shows:\n"
                                 f"{self.text()[:3000]}") from None
        return self.text()

    def text(self) -> str:
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.common.by import By

        try:
            return self.driver.find_element(By.TAG_NAME, "body").text
        except WebDriverException:  # between two pages
            return ""

    def css(self, selector: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def fill(self, values: dict[str, str]) -> None:
        """Type into the inputs with these ids."""
        from selenium.webdriver.common.by import By

        for element_id, value in values.items():
            element = self.driver.find_element(By.ID, element_id)
            element.clear()
            element.send_keys(value)

    def click(self, selector: str) -> None:
        self.wait(lambda d: self.css(selector) and self.css(selector)[0].is_enabled(), 60, f"no {selector} to click")
        self.css(selector)[0].click()

    def forget_cookies(self) -> None:
        """A new person at the same browser: nobody is logged in."""
        self.driver.delete_all_cookies()

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        return path

    def _read_logs(self) -> int:
        """Take in the logs the browser gathered since the last call; how many network events they held."""
        events = 0
        for entry in self.driver.get_log("performance"):
            event = json.loads(entry["message"])["message"]
            params = event.get("params", {})
            if event["method"] == "Page.frameNavigated" and not params["frame"].get("parentId"):
                # A new document in the tab: what the page before it still had in flight is no longer its
                # own, and Chromium does not always report those requests as cancelled.
                self._pending.clear()
                continue
            if not event["method"].startswith("Network."):
                continue
            events += 1
            if event["method"] == "Network.requestWillBeSent" and params.get("type") != "EventSource":
                self._pending[params["requestId"]] = _address(params["request"]["url"])
            elif event["method"] == "Network.responseReceived":
                response = params["response"]
                self._responses[params["requestId"]] = {"url": response["url"], "status": response["status"]}
            elif event["method"] in ("Network.loadingFinished", "Network.loadingFailed"):
                url = self._pending.pop(params["requestId"], None)
                if url:
                    self._answered.add(url)
                if event["method"] == "Network.loadingFailed" and params.get("errorText") != "net::ERR_ABORTED":
                    self._responses[params["requestId"]] = {"url": url, "status": params.get("errorText")}
        self._console += self.driver.get_log("browser")
        return events

    def start_recording(self) -> None:
        """Forget what earlier pages requested and logged."""
        self._read_logs()
        self._responses.clear()
        self._pending.clear()
        self._answered.clear()
        self._console.clear()

    def loading(self) -> list[str]:
        """The URLs the page asked for and has no answer to yet (refreshes of answered ones aside)."""
        self._read_logs()
        return sorted(set(self._pending.values()) - self._answered)

    def wait_page_loaded(self, timeout: float = 300) -> None:
        """Until every request the page has made has been answered, except repeats of requests answered before.

        A page that refreshes itself (MLflow's UI polls, with the time window in the query) is never quiet on a
        busy machine, so "no network for N seconds" depends on the load; a repeat of an address (the URL
        without its query) already answered is such a refresh, anything else is the page still loading.
        Checked on two reads a quarter second apart, so that requests a finished one has just caused are seen.
        Requests that never end (workers, long polls) and those of the page before this one do not count.
        """
        deadline = time.monotonic() + timeout
        settled = 0
        while settled < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page kept loading: {sorted(set(self._pending.values()))[:20]}")
            time.sleep(0.25)
            self._read_logs()
            loading = set(self._pending.values()) - self._answered
            settled = 0 if loading else settled + 1

    def failed_requests(self) -> list[str]:
        """`STATUS URL` of every request since `start_recording` that got a 4xx/5xx or failed."""
        self._read_logs()
        return sorted({f"{r['status']} {r['url']}" for r in self._responses.values()
                       if not isinstance(r["status"], int) or r["status"] >= 400})

    def console_errors(self) -> list[str]:
        self._read_logs()
        return [entry["message"] for entry in self._console if entry["level"] == "SEVERE"]

    def quit(self) -> None:
        self.driver.quit()
