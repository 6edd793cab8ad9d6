"""gpupool's GPU-aware idle culler: a hub service that warns, then stops servers that hold a GPU share and use it
not (`python -m gpupool.hub.culler`).

In the style of jupyterhub-idle-culler (a traitlets `Application`, every option with help, each pass bounded and
logged), with what that culler cannot see: the GPU and CPU use of the server's own processes and whether a kernel
executes (`idle_signals`), judged against the server's `idle` rule in the policies (`idleness.decide`). Each pass:

1. asks the hub which servers run (`GET /hub/api/users?state=active`, with their state: PID, cards, ledger run);
2. looks at each one that holds a GPU share, keeps what it saw in the ledger's database (`accounting_idle_servers`);
3. warns the user `warn_minutes` before the stop (the hub's home page shows it, this service's page offers "keep
   it", the alert webhook gets it), and stops the server through the hub's REST API when its time comes; the
   run's interval then ends `culled`, and the share goes to the head of the queue at once.

Jupyter's own activity (kernels executing, the latest kernel or terminal activity) is reported by each server:
gpupool's Jupyter Server extension in it (`gpupool.hub.lab_idle`) posts it here every minute with the server's own
token (`POST api/activity`), so the culler never sends a token of its own to a server, where its user's code runs.

Its hub scopes (README, "Scopes of the services"): `list:users`, `read:users:name`, `read:servers`,
`admin:server_state` (a server's PID, cards and ledger run) and `delete:servers` (the stop).

It reads the time through one `Clock`: the system clock, unless its admin names an offset file for tests
(`clock_offset_file`), which then let idle rules written in minutes pass without waiting them out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import os
import time
import urllib.parse
from dataclasses import asdict
from datetime import datetime, timedelta
from fractions import Fraction
from pathlib import Path

from jupyterhub.services.auth import HubOAuthCallbackHandler
from markupsafe import Markup
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from tornado import ioloop, web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Bool, Enum, Float, Integer, List, Unicode, default
from traitlets.config import Application

from gpupool.hub.accounting import notify
from gpupool.hub.accounting.culls import IdleServer, IdleStore
from gpupool.hub.accounting.jobs import JobStore
from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.idle_signals import CPUMeter, NVMLGPU, PodGPUMetrics, ProcessTable, ProcessTree
from gpupool.hub.services.accounting_service import MAX_BODY_BYTES, AccountingHandler, HealthHandler, NotFoundHandler, page_templates
from gpupool.policies import periods
from gpupool.policies import DEFAULT_POLICY_DIR, defaults
from gpupool.policies.idleness import Action, IdleRecord, KeepRefused, Signals, active, decide, keep
from gpupool.policies.resources import profile_share

log = logging.getLogger("gpupool.culler")

#: Hours a "keep it" asks for when the request names none.
DEFAULT_KEEP_HOURS = 1


class Metrics:
    """The culler's Prometheus metrics (its own registry, served at `metrics` to admins)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.passes = Histogram("gpupool_culler_pass_seconds", "Duration of one culling pass", registry=self.registry)
        self.hub_requests = Counter("gpupool_culler_hub_requests", "Requests to the hub's REST API",
                                    registry=self.registry)
        self.warned = Counter("gpupool_culler_warnings", "Idle warnings sent", ["team"], registry=self.registry)
        self.culled = Counter("gpupool_culler_culled_servers", "Servers stopped as idle", ["team", "cause"],
                              registry=self.registry)
        self.idle = Gauge("gpupool_culler_idle_servers", "Servers idle at the last pass", ["team"],
                          registry=self.registry)
        self.held = Gauge("gpupool_culler_idle_shares", "GPU shares held by servers idle at the last pass",
                          ["team"], registry=self.registry)


def _options_of(state: dict) -> tuple[str, str] | None:
    choice = state.get("choice") or {}
    if not choice.get("profile") or not choice.get("team"):
        return None
    return choice["team"], choice["profile"]


def _started(server: dict, clock: Clock) -> datetime:
    started = server.get("started")
    if not started:
        return clock.now()
    return clock.from_system(periods.ensure_utc(datetime.fromisoformat(started.replace("Z", "+00:00"))))


class Clock:
    """The culler's time: the system clock (`periods.utcnow`), moved by the seconds written in `offset_file` when
    the admin names one (`IdleCuller.clock_offset_file`). Tests move it forward instead of waiting out idle
    windows, as jupyterhub-idle-culler's tests move its `utcnow`.

    The file is read at every reading of the clock. Its offset may only grow: the culler's records (idle since,
    warned for, kept until) are in its time, which never goes back. Times that other processes give in the system
    clock (a server's start, its latest kernel activity) are moved by the offset in force when they happened, as
    far as the culler saw it.
    """

    def __init__(self, offset_file: str = ""):
        self.offset_file = offset_file
        #: (system time at which the culler first read an offset, that offset), oldest first.
        self._offsets: list[tuple[datetime, timedelta]] = []
        self._refused = ""  # the last refusal logged: said once, not at every look
        if offset_file:
            self.now()  # a file that is not an offset fails the start, naming it

    def _read(self) -> timedelta:
        try:
            text = Path(self.offset_file).read_text().strip()
        except FileNotFoundError:
            text = ""
        try:
            seconds = float(text or 0)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds):
            raise ValueError(f"{self.offset_file}: the culler's clock offset must be a number of seconds, such as 0 "
                             f"or -7200, not {text[:40]!r}")
        return timedelta(seconds=seconds)

    def now(self) -> datetime:
        system = periods.utcnow()
        if not self.offset_file:
            return system
        refused = ""
        try:
            offset = self._read()
        except (OSError, ValueError) as error:
            if not self._offsets:
                raise
            offset, refused = self._offsets[-1][1], str(error)
        if self._offsets and offset < self._offsets[-1][1]:
            refused = (f"{self.offset_file}: the culler's clock never goes back: not {offset.total_seconds()} s "
                       f"after {self._offsets[-1][1].total_seconds()} s")
            offset = self._offsets[-1][1]
        if refused and refused != self._refused:
            log.error("%s; the culler's clock keeps its offset of %s s", refused, offset.total_seconds())
        self._refused = refused
        if not self._offsets or offset != self._offsets[-1][1]:
            self._offsets.append((system, offset))
        return system + offset

    def from_system(self, moment: datetime) -> datetime:
        """`moment`, a time of the system clock (another process's), in the culler's time."""
        offset = self._offsets[0][1] if self._offsets else timedelta(0)
        for since, value in self._offsets:
            if since > moment:
                break
            offset = value
        return moment + offset


class IdleCuller(Application):
    """Warn, then stop, servers whose GPU share sits idle."""

    name = "gpupool-culler"
    description = __doc__.split("\n\n")[0]

    hub_api_url = Unicode(help="""The hub's REST API (JUPYTERHUB_API_URL, which the hub gives its services).

        c.IdleCuller.hub_api_url = "http://127.0.0.1:8081/hub/api"
        """).tag(config=True)

    @default("hub_api_url")
    def _default_hub_api_url(self):
        return os.environ.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api")

    api_token = Unicode(help="""The culler's hub token (JUPYTERHUB_API_TOKEN, which the hub gives its services).
        Its role needs exactly the scopes listed in the module's documentation.""").tag(config=True)

    @default("api_token")
    def _default_api_token(self):
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    policy_dir = Unicode(help="The policies (each server's `idle` rule); GPUPOOL_POLICIES by default.").tag(config=True)

    @default("policy_dir")
    def _default_policy_dir(self):
        return os.environ.get("GPUPOOL_POLICIES", str(DEFAULT_POLICY_DIR))

    ledger_url = Unicode(help="The ledger's database (GPUPOOL_LEDGER_URL by default).").tag(config=True)

    @default("ledger_url")
    def _default_ledger_url(self):
        return os.environ.get("GPUPOOL_LEDGER_URL") or defaults.ledger_url(defaults.state_dir())

    interval = Float(60, help="""Seconds between two passes. A server is stopped at most this long after its time;
        its processes' CPU use is averaged over it.

        c.IdleCuller.interval = 60
        """).tag(config=True)

    concurrency = Integer(8, help="Servers looked at in parallel during a pass.").tag(config=True)

    report_max_age = Float(180, help="""Seconds a server's report of its Jupyter activity (kernels, terminals) counts;
        an older one, or none, leaves that signal unknown. Servers report every minute.""").tag(config=True)

    gpu_source = Enum(["nvml", "hami", "dcgm", "none"], "nvml", help="""Where the GPU use of a server's processes
        comes from.

        - `nvml`: the embedded mode; NVML's per-process samples on the server's cards (no driver: unavailable).
        - `hami`: the Kubernetes mode with HAMi; `Device_utilization_desc_of_container` and
          `Device_last_kernel_of_container` per pod, from `metrics_urls`.
        - `dcgm`: the Kubernetes mode with NVIDIA's DCGM exporter (its pod mapping on), where each pod has its own
          device or MIG slice; `DCGM_FI_PROF_GR_ENGINE_ACTIVE` per pod, from `metrics_urls`.
        - `none`: no GPU signal; kernels and CPU decide.
        """).tag(config=True)

    metrics_urls = List(Unicode(), help="""With `gpu_source` `hami` or `dcgm`: URLs serving the exporter's metrics in
        Prometheus' text format: each node's exporter (HAMi's vGPU monitor `http://NODE:9394/metrics`, DCGM
        exporter `http://NODE:9400/metrics`), or one Prometheus server's federation endpoint
        (`http://prometheus:9090/federate?match[]={__name__=~"Device_.*_of_container"}`).
        """).tag(config=True)

    namespace = Unicode("", help="The Kubernetes namespace of the user pods (`hami` and `dcgm`).").tag(config=True)

    clock_offset_file = Unicode("", help="""A file holding a number of seconds added to the culler's clock (negative:
        behind), read at every look; empty, the default: the system clock, as in production. For tests of the idle
        rules as written, in minutes and hours, without waiting them out: the test starts the culler behind the
        system clock and moves it forward (the offset may only grow). Only whoever configures the hub's services
        sets it, to a file only the hub's account may write; the culler's page and API neither show nor change it.

        c.IdleCuller.clock_offset_file = "/tmp/gpupool-test/culler-clock"
        """).tag(config=True)

    cpu = Bool(True, help="Count the CPU use of the server's processes (embedded mode: they run on this machine).").tag(
        config=True)

    port = Integer(help="Where this service's page and API listen (from JUPYTERHUB_SERVICE_URL).").tag(config=True)

    @default("port")
    def _default_port(self):
        return urllib.parse.urlparse(defaults.env("JUPYTERHUB_SERVICE_URL", defaults.service_url("culler"))).port

    prefix = Unicode(help="The service's path behind the proxy (JUPYTERHUB_SERVICE_PREFIX).").tag(config=True)

    @default("prefix")
    def _default_prefix(self):
        return os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/culler/")

    aliases = {"interval": "IdleCuller.interval", "gpu-source": "IdleCuller.gpu_source",
               "policies": "IdleCuller.policy_dir", "ledger-url": "IdleCuller.ledger_url",
               "concurrency": "IdleCuller.concurrency", "log-level": "Application.log_level"}

    # --- running -------------------------------------------------------------------------------------------

    def initialize(self, argv=None):
        super().initialize(argv)
        self.clock = Clock(self.clock_offset_file)
        self.ledger = Ledger(self.ledger_url)
        self.store = IdleStore(self.ledger.engine)
        self.metrics = Metrics()
        self.cpu_meter = CPUMeter()
        self.gpu = NVMLGPU() if self.gpu_source == "nvml" else None
        self.pod_metrics = (PodGPUMetrics(self.metrics_urls, self.gpu_source)
                            if self.gpu_source in ("hami", "dcgm") else None)
        self.http = AsyncHTTPClient()
        self._pass_lock = asyncio.Lock()
        # The looks block (NVML, /proc, the servers' API): their own threads, as many as `concurrency`.
        self.threads = concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="culler-look")
        #: (user, server) → (when received, monotonic; kernels busy; latest kernel or terminal activity).
        self.reports: dict[tuple[str, str], tuple[float, int, datetime | None]] = {}
        self._table: ProcessTable | None = None
        self.jobs = JobStore(self.ledger.engine)
        #: When each running job's run was last looked at (in memory: a restarted culler begins anew).
        self._job_looks: dict[str, datetime] = {}

    @property
    def policy(self):
        from gpupool.policies.reload import current_policy

        return current_policy(self.policy_dir, self.log)

    async def hub(self, method: str, path: str, **kwargs) -> tuple[int, dict | list | None]:
        self.metrics.hub_requests.inc()
        request = HTTPRequest(self.hub_api_url.rstrip("/") + path, method=method,
                              headers={"Authorization": f"token {self.api_token}",
                                       "Accept": "application/jupyterhub-pagination+json"},
                              request_timeout=60, allow_nonstandard_methods=True, **kwargs)
        answer = await self.http.fetch(request)
        return answer.code, (json.loads(answer.body) if answer.body else None)

    async def running_servers(self) -> list[tuple[dict, str, dict]]:
        """(user, server name, server model) of every running server, all pages of the hub's answer."""
        found, offset = [], 0
        while True:
            _, page = await self.hub("GET", f"/users?state=active&offset={offset}&limit=200")
            items = page["items"] if isinstance(page, dict) else page
            for user in items:
                for name, server in (user.get("servers") or {}).items():
                    if server.get("ready") and not server.get("pending"):
                        found.append((user, name, server))
            following = page.get("_pagination", {}).get("next") if isinstance(page, dict) else None
            if not following:
                return found
            offset = following["offset"]

    async def cull_pass(self) -> None:
        if self._pass_lock.locked():
            self.log.warning("the previous pass is still running: this one is skipped")
            return
        async with self._pass_lock:
            begun = time.monotonic()
            try:
                servers = await self.running_servers()
            except Exception as error:
                self.log.error("the hub did not list the servers (%s): no culling this pass", error)
                return
            loop = asyncio.get_running_loop()
            if self.pod_metrics is not None:
                await loop.run_in_executor(self.threads, self.pod_metrics.refresh)
            if self.cpu or self.gpu is not None:
                self._table = await loop.run_in_executor(self.threads, ProcessTable)
            if self.gpu is not None:
                self.gpu.new_pass()
            gate = asyncio.Semaphore(self.concurrency)

            async def one(user, name, server):
                async with gate:
                    try:
                        return await self.look_at(user, name, server)
                    except Exception:
                        self.log.exception("looking at %s/%s failed", user["name"], name)
                        return None

            outcomes = await asyncio.gather(*(one(*s) for s in servers))
            if self.cpu or self.gpu is not None:
                try:
                    await self.look_at_jobs()
                except Exception:
                    self.log.exception("looking at the training jobs failed")
            runs = {o[0] for o in outcomes if o} | set(self._job_looks)
            self.cpu_meter.forget_except(runs)
            listed = {(user["name"], name) for user, name, _ in servers}
            for gone in set(self.reports) - listed:
                del self.reports[gone]
            idle: dict[str, tuple[int, float]] = {}
            for outcome in outcomes:
                if outcome and outcome[1] is not Action.ACTIVE and outcome[1] is not Action.EXEMPT:
                    count, shares = idle.get(outcome[2], (0, 0.0))
                    idle[outcome[2]] = (count + 1, shares + outcome[3])
            self.metrics.idle.clear()
            self.metrics.held.clear()
            for team, (count, shares) in idle.items():
                self.metrics.idle.labels(team).set(count)
                self.metrics.held.labels(team).set(shares)
            took = time.monotonic() - begun
            self.metrics.passes.observe(took)
            self.log.info("pass: %d servers looked at, %d idle, in %.2f s", len(servers),
                          sum(c for c, _ in idle.values()), took)

    def signals(self, run: str, user: dict, name: str, server: dict) -> Signals:
        """What the server did since the last look (blocking: NVML and /proc), and its last report."""
        state = server.get("state") or {}
        gpu = cpu = None
        gpu_note = cpu_note = ""
        tree = ProcessTree(state.get("pid"), state.get("pid_started"), self._table)
        processes = tree.processes() if (self.cpu or self.gpu is not None) else []
        if self.cpu:
            cpu, cpu_note = self.cpu_meter.percent(run, processes) if state.get("pid") else (
                None, "the server's processes are not on this machine")
        if self.gpu is not None:
            cards = list((state.get("allocation") or {}).get("cards") or [])
            reading = self.gpu.reading(cards, {p.pid for p in processes})
            gpu, gpu_note = reading.percent, reading.note
        elif self.pod_metrics is not None:
            pod = state.get("pod_name") or ""
            reading = self.pod_metrics.reading(self.namespace, pod, self.interval)
            gpu, gpu_note = reading.percent, reading.note
        else:
            gpu_note = "no GPU signal configured (gpu_source: none)"
        report = self.reports.get((user["name"], name))
        if report is None or time.monotonic() - report[0] > self.report_max_age:
            busy, last, note = None, None, ("no recent report of its kernels from the server (gpupool's Jupyter "
                                            "Server extension reports every minute)")
        else:
            busy, last, note = report[1], report[2], ""
        return Signals(gpu_percent=gpu, gpu_note=gpu_note, cpu_percent=cpu, cpu_note=cpu_note,
                       busy_kernels=busy, jupyter_activity=last, jupyter_note=note)

    async def look_at_jobs(self) -> None:
        """Training jobs of the embedded mode, for the reports only (a job is never warned or stopped here): the
        time each running job's processes sat under its rule's GPU and CPU thresholds between two looks is added
        to its team's idle GPU-hours."""
        loop = asyncio.get_running_loop()
        running = await loop.run_in_executor(self.threads, self.jobs.running)
        policy, now, looked = self.policy, self.clock.now(), {}
        cards = self.gpu.all_cards() if self.gpu is not None else []
        for job, run in running:
            chosen = policy.profiles.get(job.profile)
            if not run.holding or not run.pid or chosen is None or chosen.gpu is None:
                continue
            tree = ProcessTree(run.pid, run.pid_started_ms / 1000 if run.pid_started_ms else None, self._table)
            processes = tree.processes()
            cpu, _ = self.cpu_meter.percent(run.holding, processes) if self.cpu else (None, "")
            gpu = self.gpu.reading(cards, {p.pid for p in processes}).percent if self.gpu is not None else None
            looked[run.holding] = now
            before = self._job_looks.get(run.holding)
            if before is None or (cpu is None and gpu is None):
                continue  # nothing known yet: neither idle nor busy
            rule = policy.idle_rule(job.team, job.profile)
            if active(rule, Signals(gpu_percent=gpu, cpu_percent=cpu)):
                continue
            await loop.run_in_executor(self.threads, self.store.add_idle, run.holding, job.team, chosen.gpu.model,
                                       profile_share(chosen, policy), before, now, "job")
        self._job_looks = looked

    async def look_at(self, user: dict, name: str, server: dict):
        state = server.get("state") or {}
        run = state.get("usage_run")
        options = _options_of(state)
        if not run or options is None:
            return None  # holds no GPU share: not this culler's business
        team, profile = options
        policy = self.policy
        rule = policy.idle_rule(team, profile)
        signals = await asyncio.get_running_loop().run_in_executor(self.threads, self.signals, run, user, name, server)
        now = self.clock.now()
        known = await asyncio.to_thread(self.store.get, run)
        # A server first seen has its whole `after_minutes` from now (it may have started a while ago, before
        # this culler ran): idle since it was first seen, never since before.
        record = (known.record if known is not None
                  else IdleRecord(started=_started(server, self.clock), last_active=now))
        label = f"{user['name']}'s server {name!r}" if name else f"{user['name']}'s server"
        decision = decide(rule, signals, record, now, label)
        seen = {"action": str(decision.action), "cause": decision.cause,
                "cull_at": decision.cull_at.isoformat() if decision.cull_at else None,
                "idle_minutes": round((now - decision.record.last_active).total_seconds() / 60, 1),
                "message": decision.message,
                "signals": {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(signals).items()}}
        await asyncio.to_thread(self.store.save, run, user["name"], name, team, profile, decision.record, now, seen)
        chosen = policy.profiles.get(profile)
        share = profile_share(chosen, policy) if chosen is not None and chosen.gpu is not None else Fraction(0)
        if known is not None and share and decision.record.last_active < now:
            # Idle since the last look (or since its last activity, if that came after), for the reports; a gap of
            # more than two passes (the culler was down) is not counted: nobody looked.
            since = max(known.seen_at, decision.record.last_active, now - timedelta(seconds=2 * self.interval))
            await asyncio.to_thread(self.store.add_idle, run, team, chosen.gpu.model, share, since, now)
        display = chosen.display_name if chosen is not None else profile
        if decision.action is Action.WARN:
            self.metrics.warned.labels(team).inc()
            self.log.warning("warned: %s", decision.message)
            self.webhook(policy, "idle-warning", user["name"], name, team, display, decision)
        elif decision.action is Action.CULL:
            await self.cull(user["name"], name, run, team, display, decision, record.kept)
        return run, decision.action, team, float(share)

    async def cull(self, user: str, name: str, run: str, team: str, display: str, decision,
                   kept: timedelta) -> None:
        # Asked for in the ledger first, so that the interval the stop closes ends `culled`; and only if its user
        # did not keep it since this look read its record (then the next look decides again).
        if not await asyncio.to_thread(self.store.request_cull, run, self.clock.now(), decision.message, kept):
            self.log.info("%s/%s was kept while the culler looked at it: not stopped", user, name)
            return
        path = f"/users/{urllib.parse.quote(user)}/servers/{urllib.parse.quote(name)}" if name else \
            f"/users/{urllib.parse.quote(user)}/server"
        try:
            code, _ = await self.hub("DELETE", path)
        except Exception as error:  # refused, or the hub not answering: a later stop by its user is not a cull
            await asyncio.to_thread(self.store.cull_failed, run)
            self.log.error("the hub did not stop %s/%s: %s", user, name, error)
            return
        self.metrics.culled.labels(team, decision.cause).inc()
        self.log.warning("culled (%s): %s", "stopping" if code == 202 else "stopped", decision.message)
        self.webhook(self.policy, "idle-cull", user, name, team, display, decision)

    def webhook(self, policy, kind: str, user: str, name: str, team: str, display: str, decision) -> None:
        url = policy.settings.alert_webhook
        if url:
            body = {"kind": kind, "user": user, "server": name, "team": team, "profile": display,
                    "cull_at": decision.cull_at.isoformat() if decision.cull_at else None,
                    "cause": decision.cause, "message": decision.message}
            asyncio.get_running_loop().run_in_executor(None, notify.post_webhook, url, body, self.log)

    def start(self):
        app = make_app(self)
        app.listen(self.port, "127.0.0.1" if not os.environ.get("GPUPOOL_CULLER_BIND_ALL") else "")
        self.log.info("gpupool-culler: a pass every %s s, GPU from %s, page at %s", self.interval, self.gpu_source,
                      self.prefix)
        loop = ioloop.IOLoop.current()
        loop.add_callback(self.cull_pass)
        ioloop.PeriodicCallback(self.cull_pass, self.interval * 1000).start()
        loop.start()


# --- the page and the API --------------------------------------------------------------------------------------


class CullerHandler(AccountingHandler):
    @property
    def culler(self) -> IdleCuller:
        return self.settings["culler"]

    def idle_server_or_404(self, user: str, name: str) -> IdleServer:
        viewer = self.viewer()
        if user != viewer.name and not viewer.admin:
            raise web.HTTPError(404, f"no running server {user}/{name} of yours")
        found = [s for s in self.culler.store.running(user) if s.server == name]
        if not found:
            raise web.HTTPError(404, f"no running server {user}/{name} holding a GPU share: nothing to keep")
        return max(found, key=lambda s: s.record.started)

    def keep_it(self, user: str, name: str, hours_text: str | None) -> dict:
        server = self.idle_server_or_404(user, name)
        try:
            hours = float(hours_text) if hours_text not in (None, "") else DEFAULT_KEEP_HOURS
        except ValueError:
            raise web.HTTPError(400, f"hours must be a number of hours such as 1 or 0.5, not {hours_text[:20]!r}")
        if not 0 < hours <= 24 * 7:
            raise web.HTTPError(400, "hours must be more than 0 and at most 168")
        rule = self.policy.idle_rule(server.team, server.profile)
        try:
            record = keep(rule, server.record, self.culler.clock.now(), timedelta(hours=hours))
        except KeepRefused as refused:
            raise web.HTTPError(409, str(refused)) from None
        self.culler.store.keep(server.run, record)
        log.info("%s kept %s/%s until %s (kept %s in all)", self.viewer().name, user, name, record.keep_until,
                 record.kept)
        return describe(self.culler.store.get(server.run), rule)

    def render_culler(self, servers: list[dict]) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(self.settings["templates"].get_template("culler.html").render(
            **self.hub_namespace(self.current_user), title="Idle servers", servers=servers,
            service_prefix=self.settings["prefix"], xsrf_form_html=lambda: Markup(self.xsrf_form_html())))


def describe(server: IdleServer, rule) -> dict:
    seen = server.seen
    return {
        "user": server.user, "server": server.server, "team": server.team, "profile": server.profile,
        "state": seen.get("action", "active"), "idle_minutes": seen.get("idle_minutes", 0.0),
        "cull_at": seen.get("cull_at"), "cause": seen.get("cause", ""),
        "message": seen.get("message", ""), "signals": seen.get("signals", {}),
        "keep_until": server.record.keep_until.isoformat() if server.record.keep_until else None,
        "kept_hours": round(server.record.kept.total_seconds() / 3600, 2),
        "keep_max_hours": float(rule.keep_max_hours), "after_minutes": float(rule.after_minutes),
        "seen_at": server.seen_at.isoformat(),
    }


class PageHandler(CullerHandler):
    @web.authenticated
    def get(self):
        viewer, policy = self.viewer(), self.policy
        rows = []
        for server in self.culler.store.running(viewer.name):
            row = describe(server, policy.idle_rule(server.team, server.profile))
            profile = policy.profiles.get(server.profile)
            row["profile_name"] = profile.display_name if profile else server.profile
            row["cull_time"] = row["cull_at"][11:16] if row["cull_at"] else ""
            rows.append(row)
        self.render_culler(rows)


class KeepPageHandler(CullerHandler):
    """The page's "keep it" button (form fields `server` and `hours`): back to the page."""

    @web.authenticated
    def post(self):
        self.keep_it(self.viewer().name, self.get_body_argument("server", ""), self.get_body_argument("hours", None))
        self.redirect(self.settings["prefix"])


class ServersHandler(CullerHandler):
    """GET api/servers: the caller's servers as the culler sees them (admins: `?all=1` for everyone's)."""

    @web.authenticated
    def get(self):
        viewer, policy = self.viewer(), self.policy
        users = None if viewer.admin and self.get_argument("all", "") == "1" else viewer.name
        rows = [describe(s, policy.idle_rule(s.team, s.profile)) for s in self.culler.store.running(users)]
        # How often the culler looks: a warning's words change no more often (JupyterLab's check follows it).
        self.write_json({"servers": rows, "interval_s": self.culler.interval})


class KeepHandler(CullerHandler):
    """POST api/servers/USER[/SERVER]/keep {"hours": 1}: postpone the stop, within the rule's `keep_max_hours`."""

    @web.authenticated
    def post(self, user: str, name: str | None = None):
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError as error:
            raise web.HTTPError(400, f"the body is not JSON: {error}") from None
        if not isinstance(body, dict) or set(body) - {"hours"}:
            raise web.HTTPError(400, 'the body must be a JSON object such as {"hours": 1} (accepted key: hours)')
        hours = body.get("hours")
        if hours is not None and (isinstance(hours, bool) or not isinstance(hours, (int, float))):
            raise web.HTTPError(400, "hours must be a number")
        self.write_json(self.keep_it(urllib.parse.unquote(user), urllib.parse.unquote(name or ""),
                                     None if hours is None else str(hours)))


class ActivityHandler(CullerHandler):
    """POST api/activity {"server": NAME, "busy_kernels": N, "last_activity": ISO or null}: a server's report of its
    own Jupyter activity (gpupool.hub.lab_idle, with the server's token). A token may report for a server of its
    user that it may access; anything else is refused."""

    @web.authenticated
    def post(self):
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError as error:
            raise web.HTTPError(400, f"the body is not JSON: {error}") from None
        if not isinstance(body, dict) or set(body) - {"server", "busy_kernels", "last_activity"}:
            raise web.HTTPError(400, 'the body must be a JSON object {"server": NAME, "busy_kernels": N, '
                                     '"last_activity": ISO-8601 or null}')
        name, busy, last = body.get("server", ""), body.get("busy_kernels"), body.get("last_activity")
        if not isinstance(name, str) or isinstance(busy, bool) or not isinstance(busy, int) or not 0 <= busy <= 10**6:
            raise web.HTTPError(400, "server must be a server's name and busy_kernels a whole number of kernels")
        when = None
        if last is not None:
            try:
                when = periods.ensure_utc(datetime.fromisoformat(str(last).replace("Z", "+00:00")))
                when = self.culler.clock.from_system(when)
            except ValueError:
                raise web.HTTPError(400, "last_activity must be an ISO-8601 time with its zone, or null") from None
        user = self.current_user
        scopes = set(user.get("scopes") or [])
        allowed = {"access:servers", f"access:servers!user={user['name']}",
                   f"access:servers!server={user['name']}/{name}"}
        if user.get("kind", "user") != "user" or not scopes & allowed:
            raise web.HTTPError(403, f"this token may not report for server {user['name']}/{name}: a server reports "
                                     "with its own token")
        self.culler.reports[(user["name"], name)] = (time.monotonic(), busy, when)
        self.set_status(204)
        self.finish()


class MetricsHandler(CullerHandler):
    @web.authenticated
    def get(self):
        self.admin_or_403()
        self.set_header("Content-Type", "text/plain; version=0.0.4")
        self.finish(generate_latest(self.culler.metrics.registry))


def make_app(culler: IdleCuller) -> web.Application:
    prefix = culler.prefix
    name = r"([^/]+)"
    return web.Application(
        [
            (prefix, PageHandler),
            (prefix + "keep", KeepPageHandler),
            (prefix + "api/servers", ServersHandler),
            (prefix + "api/activity", ActivityHandler),
            (prefix + f"api/servers/{name}/keep", KeepHandler),
            (prefix + f"api/servers/{name}/{name}/keep", KeepHandler),
            (prefix + "metrics", MetricsHandler),
            (prefix + "health", HealthHandler),
            (prefix + "oauth_callback", HubOAuthCallbackHandler),
        ],
        culler=culler, ledger=culler.ledger, policy_dir=culler.policy_dir, cookie_secret=os.urandom(32), prefix=prefix,
        base_url=os.environ.get("JUPYTERHUB_BASE_URL", "/"),
        nav_services=tuple(n for n in os.environ.get("GPUPOOL_NAV_SERVICES", "").split(",") if n),
        templates=page_templates(), max_body_size=MAX_BODY_BYTES, home_label="Idle servers",
        default_handler_class=NotFoundHandler,
    )


main = IdleCuller.launch_instance

if __name__ == "__main__":
    main()
