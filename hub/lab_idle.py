"""The idle culler's side in every user server (a Jupyter Server extension): the server's activity reported to the
culler, and the culler's warning inside JupyterLab.

Every minute it posts its kernels' state and latest kernel or terminal activity to the culler (`report_activity`).

`GET /gpupool/idle` says whether the culler has warned that this server will be stopped (and its message);
`POST /gpupool/idle/keep` (`{"hours": 1}`) postpones the stop. The browser asks its own server, with its own
login, so it never needs the culler service's OAuth; the server asks the culler with its own hub token
($JUPYTERHUB_API_TOKEN, whose scopes include `access:services!service=culler`: spawner/wiring.py) at the hub's
public address ($GPUPOOL_HUB_URL, which gpupool sets in every server). The labextension `gpupool-idle`
(images/base/labextension) shows the warning. `make install` enables this extension in the servers'
environments (images/base/jupyter_server_config.d/gpupool-idle.json).
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Mapping
from datetime import datetime, timezone

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.ioloop import IOLoop, PeriodicCallback
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from gpupool.spawner.wiring import CULLER_SERVICE

#: The culler's states of a server whose user has been told it will be stopped.
WARNED = ("warn", "warned")
#: Bodies of "keep it" are a few bytes; anything longer is refused before it is read as JSON.
MAX_BODY_BYTES = 1024
#: Seconds the culler has to answer through the hub's proxy.
TIMEOUT_S = 30
#: Seconds between two of JupyterLab's checks of the warning: the culler's pass (60 s by default), within these.
CHECK_SECONDS, MIN_CHECK_S = 60.0, 5.0


def culler_url(env: Mapping[str, str] = os.environ) -> str | None:
    """The culler service as this server reaches it, through the hub's public proxy; None where nothing says
    where the hub is (a server gpupool did not start)."""
    hub = env.get("GPUPOOL_HUB_URL") or env.get("JUPYTERHUB_PUBLIC_HUB_URL", "").removesuffix("hub/")
    return f"{hub.rstrip('/')}/services/{CULLER_SERVICE}/" if hub else None


def _when(text: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(text) if text else None
    except ValueError:
        return None


def warned(server: dict | None) -> bool:
    """Whether the culler's row of a server stands as a warning now.

    A keep made since the culler's last look moves `keep_until` past the stop the warning announced: that
    warning is over though the culler has not looked again yet (its next look says `active` or `idle`, or warns
    anew for a stop at the end of the keep, `cull_at >= keep_until`)."""
    if not server or server.get("state") not in WARNED:
        return False
    cull_at, keep_until = _when(server.get("cull_at")), _when(server.get("keep_until"))
    return not (cull_at and keep_until and keep_until > cull_at)


def check_every(reply: Mapping) -> float:
    """Seconds between two of JupyterLab's checks of the warning: as often as the culler looks (`interval_s` of
    its answer; a warning's words change no more often), never more often than MIN_CHECK_S (every open JupyterLab
    asks through the proxy), and CHECK_SECONDS when the culler does not say."""
    interval = reply.get("interval_s")
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
        return CHECK_SECONDS
    return max(MIN_CHECK_S, min(float(interval), CHECK_SECONDS))


def this_server(servers: list[dict], user: str, name: str) -> dict | None:
    """The culler's row of `user`'s server `name` ("" the default one), if the culler watches it."""
    return next((s for s in servers if s.get("user") == user and s.get("server", "") == name), None)


class IdleHandler(APIHandler):
    """Base: the culler's address and this server's identity, from the environment the hub gave the server."""

    @property
    def user(self) -> str:
        return os.environ.get("JUPYTERHUB_USER", "")

    @property
    def server(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVER_NAME", "")

    async def ask_culler(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """The culler's status and JSON answer; 502 when it cannot be asked or refuses this server's token."""
        url, token = culler_url(), os.environ.get("JUPYTERHUB_API_TOKEN", "")
        if url is None or not token:
            raise web.HTTPError(503, "this server was not started by gpupool's hub: no culler to ask "
                                     "(GPUPOOL_HUB_URL and JUPYTERHUB_API_TOKEN are not set)")
        request = HTTPRequest(url + path, method=method, request_timeout=TIMEOUT_S, follow_redirects=False,
                              headers={"Authorization": f"token {token}", "Accept": "application/json",
                                       **({"Content-Type": "application/json"} if body is not None else {})},
                              body=json.dumps(body) if body is not None else None)
        try:
            answer = await AsyncHTTPClient().fetch(request, raise_error=False)
        except (OSError, HTTPClientError) as error:
            raise web.HTTPError(502, f"the idle culler at {url} did not answer: {error}") from None
        try:
            reply = json.loads(answer.body or b"{}")
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise web.HTTPError(502, f"the idle culler at {url} answered {answer.code} without JSON")
        if answer.code in (401, 403):
            raise web.HTTPError(502, f"the idle culler refused this server's token ({answer.code}: "
                                     f"{reply.get('message', '')}); it needs the scope access:services!service="
                                     f"{CULLER_SERVICE}")
        return answer.code, reply

    def write_json(self, status: int, body: dict) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))


class WarningHandler(IdleHandler):
    """GET: `{"warned": bool, "server": the culler's row of this server or null, "check_every_s": seconds until
    JupyterLab's next check}`."""

    # Asked by an open JupyterLab as often as the culler looks: not the user's activity (JupyterHub's last_activity).
    _track_activity = False

    @web.authenticated
    async def get(self):
        status, reply = await self.ask_culler("GET", "api/servers")
        if status != 200:
            raise web.HTTPError(502, f"the idle culler answered {status}: {reply.get('message', '')}")
        server = this_server(reply.get("servers") or [], self.user, self.server)
        self.write_json(200, {"warned": warned(server), "server": server, "check_every_s": check_every(reply)})


class KeepHandler(IdleHandler):
    """POST `{"hours": 1}` (the culler's default without it): the culler's answer, as it gave it (200 with the
    server's row and its new `keep_until`; 409 with the reason when the policy allows no more)."""

    @web.authenticated
    async def post(self):
        if len(self.request.body) > MAX_BODY_BYTES:
            raise web.HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            raise web.HTTPError(400, 'the body is not JSON: send {"hours": 1}') from None
        if not isinstance(body, dict) or set(body) - {"hours"}:
            raise web.HTTPError(400, 'the body must be a JSON object such as {"hours": 1} (accepted key: hours)')
        path = "/".join(urllib.parse.quote(part, safe="") for part in (self.user, self.server) if part)
        status, reply = await self.ask_culler("POST", f"api/servers/{path}/keep", body)
        self.write_json(status, reply)


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "gpupool.hub.lab_idle"}]


#: Seconds between two reports of the server's Jupyter activity to the culler (GPUPOOL_IDLE_REPORT_SECONDS).
REPORT_SECONDS = 60


async def jupyter_activity(serverapp) -> tuple[int, datetime | None]:
    """This server's kernels executing now, and the latest kernel or terminal activity (never an HTTP request:
    an open browser tab polls the API, and that is not work)."""
    kernels = serverapp.kernel_manager.list_kernels()
    moments = [k.get("last_activity") for k in kernels]
    terminals = serverapp.web_app.settings.get("terminal_manager")
    if terminals is not None:
        listed = terminals.list()
        listed = await listed if hasattr(listed, "__await__") else listed
        moments += [t.get("last_activity") for t in listed]
    parsed = [m if isinstance(m, datetime) else _when(m) if isinstance(m, str) else None for m in moments]
    latest = max((m.astimezone(timezone.utc) for m in parsed if m is not None and m.tzinfo), default=None)
    return sum(1 for k in kernels if k.get("execution_state") == "busy"), latest


async def report_activity(serverapp) -> None:
    """Tell the culler what this server's kernels do (`POST api/activity`, with the server's own token): the culler
    never asks a server itself, so no token of the culler's ever reaches one."""
    url, token = culler_url(), os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if url is None or not token:
        return
    try:
        busy, latest = await jupyter_activity(serverapp)
        body = {"server": os.environ.get("JUPYTERHUB_SERVER_NAME", ""), "busy_kernels": busy,
                "last_activity": latest.isoformat() if latest else None}
        await AsyncHTTPClient().fetch(HTTPRequest(
            url + "api/activity", method="POST", body=json.dumps(body), request_timeout=TIMEOUT_S,
            follow_redirects=False, headers={"Authorization": f"token {token}", "Content-Type": "application/json"}))
    except Exception as error:  # the culler restarting, or not there: the next report tries again
        serverapp.log.debug("gpupool: the idle culler did not take this server's activity report: %s", error)


def _load_jupyter_server_extension(serverapp) -> None:
    base = serverapp.web_app.settings["base_url"]
    serverapp.web_app.add_handlers(".*$", [
        (url_path_join(base, "gpupool/idle"), WarningHandler),
        (url_path_join(base, "gpupool/idle/keep"), KeepHandler),
    ])
    if culler_url() is not None and os.environ.get("JUPYTERHUB_API_TOKEN"):
        seconds = float(os.environ.get("GPUPOOL_IDLE_REPORT_SECONDS") or REPORT_SECONDS)
        report = PeriodicCallback(lambda: report_activity(serverapp), seconds * 1000)
        report.start()
        IOLoop.current().add_callback(report_activity, serverapp)
