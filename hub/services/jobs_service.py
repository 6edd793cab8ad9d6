"""The jobs service (`/services/jobs/`): training jobs' REST API and the Jobs page, behind the hub login.

Submissions and cancels are written to the jobs table of the ledger's database (`accounting.jobs.JobStore`);
the job runner (in the hub process, embedded mode) starts, watches and stops the runs. A job belongs to its
user; the leads of its team and admins see (and may cancel) it too; anyone else gets 404, as if it did not
exist. API clients authenticate with a hub token (`Authorization: token …`): a server's own
`$JUPYTERHUB_API_TOKEN` works from a notebook or a terminal (`gpupool jobs`), as does a token made on the
hub's token page. The API is described at `openapi.json`.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import subprocess
from datetime import datetime
from decimal import Decimal
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuthCallbackHandler
from markupsafe import Markup
from pydantic import ValidationError
from tornado import ioloop, web

from gpupool.hub.accounting.bills import hours_text
from gpupool.hub.accounting.jobs import (
    DEFAULT_CHECKPOINT_MOUNT, JOB_ID, Job, JobRefused, JobStore, JobSubmission, default_checkpoint_dir,
    collapse_progress, job_log, log_tail, resolve,
)
from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.accounting.reports import job_usage, money
from gpupool.hub.services.accounting_service import (
    MAX_BODY_BYTES, AccountingHandler, HealthHandler, NotFoundHandler, page_templates,
)
from gpupool.policies import periods
from gpupool.policies import DEFAULT_POLICY_DIR, defaults
from gpupool.policies.identity import TEAM_PREFIX, unix_group, unix_user
from gpupool.spawner.images import default_images_dir, image_prefix

log = logging.getLogger("gpupool.jobs")
#: The most of a log one request returns (`GET …/log`); more comes with the next offset.
LOG_CHUNK = 256 * 1024
#: `embedded` (the default: the hub process runs the jobs on this machine) or `kubernetes` (the hub submits them
#: as Volcano Jobs: images are the cluster's to pull, checkpoints go on the policy's claim, and the output is what
#: the hub read from the pods' logs into the database).
MODE_ENV = "GPUPOOL_JOBS_MODE"
#: Lines of the log's tail on the job's page and in `GET /api/jobs/ID`.
TAIL_LINES = 40
#: `user` when the hub runs each job as its user's own Unix account (`gp-NAME`, root mode), else `self` (jobs run
#: as the account running the hub, as this service does): whose identity a job's working folder is checked with.
RUN_AS_ENV = "GPUPOOL_JOBS_RUN_AS"
#: Stands in for the uid of an account not made yet (a user who never started anything): it owns no folder.
NOBODY = 65534


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return ""


def workdir_problem(workdir: str, user: str, teams: list[str], as_users: bool) -> str | None:
    """Why a run of `user`'s could not start in `workdir`, or None: tried as the run would, by entering it with
    its identity (its Unix account and its teams' groups in root mode, this process's otherwise), so that modes,
    groups and ACLs all count as they will at the run's start."""
    ids: dict = {}
    who = "the account that runs the platform"
    if as_users:
        account = unix_user(user)
        try:
            entry = pwd.getpwnam(account)
            # its groups at the run's start: the ones an admin gave it, and exactly its teams' (added below)
            groups = {g for g in os.getgrouplist(account, entry.pw_gid)
                      if not _group_name(g).startswith(TEAM_PREFIX)}
            uid, gid = entry.pw_uid, entry.pw_gid
            who = f"your account {account}"
        except KeyError:  # made at its first server or job, in its teams' groups
            uid, gid, groups = NOBODY, NOBODY, set()
            who = f"your account {account} (made at your first start) in your teams' groups"
        for team in teams:
            try:
                groups.add(grp.getgrnam(unix_group(team)).gr_gid)
            except KeyError:
                pass
        ids = {"user": uid, "group": gid, "extra_groups": sorted(groups)}
    # Why, told by the same shell as the run's identity: this process (root, with users' runs) would tell anyone
    # whether a file exists in a folder of another user's that they cannot enter.
    script = 'cd -- "$1" && exit 0; [ -e "$1" ] || exit 3; [ -d "$1" ] || exit 4; exit 5'
    try:  # the system's shell: the hub's environment may be closed to users
        entered = subprocess.run(["/bin/sh", "-c", script, "sh", workdir], capture_output=True, cwd="/",
                                 env={"PATH": "/usr/bin:/bin"}, timeout=30, check=False, **ids)
    except (OSError, ValueError, subprocess.SubprocessError) as error:
        return f"working folder {workdir!r} could not be checked: {error}"
    if entered.returncode == 0:
        return None
    why = {3: "No such file or directory" + (", or a folder on its way that it cannot enter" if as_users else ""),
           4: "Not a directory"}.get(entered.returncode, "Permission denied")
    return (f"working folder {workdir!r} cannot be entered by {who} ({why}): give a folder you can enter as "
            f"`workdir` (`--workdir` of `gpupool jobs submit`; default: your home)")


def _when(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment is not None else None


class JobsHandler(AccountingHandler):
    """Base: the store, who may see which job, and the job's view for API and page."""

    @property
    def store(self) -> JobStore:
        return self.settings["store"]

    def may_see(self, job: Job) -> bool:
        viewer = self.viewer()
        return viewer.admin or job.user == viewer.name or job.team in viewer.leads

    def job_or_404(self, job_id: str) -> Job:
        job = self.store.get(job_id)
        if job is None or not self.may_see(job):
            raise web.HTTPError(404, f"no job {job_id!r} that you may see")
        return job

    def visible_jobs(self) -> list[Job]:
        viewer = self.viewer()
        if viewer.admin:
            return self.store.jobs()
        return self.store.jobs(users=[viewer.name], teams=sorted(viewer.leads))

    def detail(self, job: Job, tail: bool = True) -> dict:
        policy, runs = self.policy, self.store.runs(job.id)
        hours, cost = job_usage(self.ledger, policy, [r.holding for r in runs if r.holding])
        out = job.as_json()
        out.update({
            # The bills' precision (4 places), on the pages and in `gpupool jobs show` alike.
            "gpu_hours": hours_text(hours), "cost": str(cost), "currency": policy.billing.currency,
            "checkpoint_dir": job.checkpoint_dir,
            "runs": [{"attempt": r.attempt, "started_at": _when(r.started_at), "ended_at": _when(r.ended_at),
                      "event": r.event, "exit_code": r.exit_code, "counted": r.counted, "reason": r.reason}
                     for r in runs],
        })
        if tail:
            out["log_tail"] = (self.store.log_tail(job.id, TAIL_LINES) if self.settings["kubernetes"]
                               else log_tail(job_log(self.settings["state_dir"], job.id), TAIL_LINES))
        return out

    def body(self) -> dict:
        try:
            data = json.loads(self.request.body or b"{}")
        except ValueError as error:
            raise web.HTTPError(400, f"the body is not JSON: {error}") from None
        if not isinstance(data, dict):
            raise web.HTTPError(400, "the body must be a JSON object (see openapi.json: JobSubmission)")
        return data

    def cancel(self, job: Job) -> Job:
        if job.ended:
            raise web.HTTPError(409, f"job {job.id} has already ended ({job.state}): nothing to cancel")
        return self.store.cancel(job.id, periods.utcnow())

    def suspend(self, job: Job) -> Job:
        if job.state not in ("queued", "restarting", "running") or job.cancel_requested:
            raise web.HTTPError(409, f"job {job.id} is {job.state}: only a queued, restarting or running job can be "
                                     "suspended")
        return self.store.suspend(job.id, periods.utcnow())

    def resume(self, job: Job) -> Job:
        if job.state == "running" and job.suspend_requested:
            raise web.HTTPError(409, f"job {job.id} is being suspended (its run is stopping): resume it once it "
                                     "is suspended")
        if job.state != "suspended":
            raise web.HTTPError(409, f"job {job.id} is {job.state}, not suspended: nothing to resume")
        return self.store.resume(job.id, periods.utcnow())


class ListHandler(JobsHandler):
    @web.authenticated
    def get(self):
        self.write_json({"jobs": [job.as_json() for job in self.visible_jobs()]})

    @web.authenticated
    async def post(self):
        viewer = self.viewer()
        try:
            submission = JobSubmission.model_validate(self.body())
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                                 for e in error.errors())
            raise web.HTTPError(400, f"invalid job: {problems} (see openapi.json: JobSubmission)") from None
        policy = self.policy
        try:
            resolved = resolve(policy, viewer.name, policy.teams_of(viewer.name, self.current_user.get("groups") or []),
                               submission)
        except JobRefused as refused:
            raise web.HTTPError(refused.status, str(refused)) from None
        kubernetes = self.settings["kubernetes"]
        if submission.workdir is not None and not kubernetes:  # here, not three failed runs later
            teams = policy.teams_of(viewer.name, self.current_user.get("groups") or [])
            # in a thread: the check runs a shell, which a hung mount could hold, and the service serves everyone
            problem = await ioloop.IOLoop.current().run_in_executor(
                None, workdir_problem, submission.workdir, viewer.name, teams, self.settings["run_as"] == "user")
            if problem:
                raise web.HTTPError(400, problem)
        if resolved.image is not None and not kubernetes:  # its runs start from the image's environment here
            environment = policy.profiles[resolved.profile].images[resolved.image].environment
            if image_prefix(self.settings["images_dir"], environment, "") is None:
                raise web.HTTPError(409, f"image {resolved.image!r} of profile {resolved.profile!r} is not installed "
                                         f"on this machine yet: an administrator runs `gpupool images build "
                                         f"{environment}`")
        key = self.request.headers.get("Idempotency-Key")
        if key is not None and not (0 < len(key) <= 200 and key.isprintable()):
            raise web.HTTPError(400, "Idempotency-Key must be 1 to 200 printable characters")
        job = self.store.submit(viewer.name, resolved, submission, periods.utcnow(), key=key)
        if job.checkpoint_dir is None and not kubernetes:  # its own folder in the team's storage, now it has an id
            job = self.store.set_checkpoint_dir(
                job.id, str(default_checkpoint_dir(self.settings["team_root"], job.team, job.user, job.id)))
        elif job.checkpoint_dir is None and policy.jobs.checkpoint_claim:  # its folder of the claim, mounted there
            job = self.store.set_checkpoint_dir(job.id, DEFAULT_CHECKPOINT_MOUNT)
        self.set_status(201)
        self.set_header("Location", f"{self.settings['prefix']}api/jobs/{job.id}")
        self.write_json(self.detail(job, tail=False))


class JobHandler(JobsHandler):
    @web.authenticated
    def get(self, job_id: str):
        self.write_json(self.detail(self.job_or_404(job_id)))

    @web.authenticated
    def delete(self, job_id: str):
        self.write_json(self.detail(self.cancel(self.job_or_404(job_id)), tail=False))


class ActionHandler(JobsHandler):
    """POST …/cancel, …/suspend, …/resume: JSON for the REST API, back to the job's page for its buttons."""

    @web.authenticated
    def post(self, job_id: str, action: str):
        job = getattr(self, action)(self.job_or_404(job_id))
        if self.request.path.startswith(self.settings["prefix"] + "api/"):
            self.write_json(self.detail(job, tail=False))
        else:  # the page's button
            self.redirect(f"{self.settings['prefix']}jobs/{job.id}")


class LogHandler(JobsHandler):
    """The log from byte `offset` on (at most `LOG_CHUNK`); `X-Log-Offset` is where the next read starts.
    Progress bars come at their last state (`collapse_progress`); a read ends at a line's end where it can, so
    a bar is never cut in two but the one still drawing at the log's end."""

    @web.authenticated
    def get(self, job_id: str):
        job = self.job_or_404(job_id)
        text = self.get_argument("offset", "0")
        if not text.isdigit():
            raise web.HTTPError(400, f"offset must be a whole number of bytes, not {text[:20]!r}")
        offset = int(text)
        # One byte before the offset too: whether the read starts inside a line (a bar still drawing).
        start = max(0, offset - 1)
        if self.settings["kubernetes"]:  # its pods' output, kept by the hub's job runner (`VolcanoBackend`)
            data = self.store.read_log(job.id, start, LOG_CHUNK + offset - start)
        else:
            try:
                with open(job_log(self.settings["state_dir"], job.id), "rb") as log_file:
                    log_file.seek(start)
                    data = log_file.read(LOG_CHUNK + offset - start)
            except FileNotFoundError:
                data = b""
        continued = offset > 0 and data[:1] not in (b"", b"\n")
        data = data[offset - start:]
        if len(data) == LOG_CHUNK and b"\n" in data:
            data = data[:data.rindex(b"\n") + 1]
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.set_header("X-Log-Offset", str(offset + len(data)))
        self.set_header("X-Job-State", job.state)
        self.finish(collapse_progress(data, continued))


class PageHandler(JobsHandler):
    """The Jobs page: my jobs and, for team leads, their teams' jobs; how to submit one."""

    @web.authenticated
    def get(self):
        viewer, policy = self.viewer(), self.policy
        rows = []
        for job in self.visible_jobs():
            detail = self.detail(job, tail=False)
            rows.append({**detail, "cost": money(Decimal(detail["cost"]), policy.billing.currency),
                         "submitted": detail["submitted_at"][:16].replace("T", " "),
                         "href": f"jobs/{job.id}", "profile_name": self._profile_name(job)})
        self.render_jobs("jobs.html", "Training jobs", jobs=rows, teams=sorted(viewer.teams),
                         profiles=sorted(policy.profiles_for_teams(set(viewer.teams))))

    def _profile_name(self, job: Job) -> str:
        """The profile as the spawn page names it, and the image it runs in where the profile offers images."""
        profile = self.policy.profiles.get(job.profile)
        if profile is None:
            return job.profile
        image = profile.images.get(job.image) if job.image else None
        return f"{profile.display_name} · {image.display_name}" if image else profile.display_name

    def render_jobs(self, template: str, title: str, **values) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(self.settings["templates"].get_template(template).render(
            **self.hub_namespace(self.current_user), title=title, currency=self.policy.billing.currency,
            service_prefix=self.settings["prefix"], xsrf_form_html=lambda: Markup(self.xsrf_form_html()), **values))


class JobPageHandler(PageHandler):
    @web.authenticated
    def get(self, job_id: str):
        job = self.job_or_404(job_id)
        detail = self.detail(job)
        detail["cost"] = money(Decimal(detail["cost"]), self.policy.billing.currency)
        self.render_jobs("job.html", f"Job {job.id}", job=detail, profile_name=self._profile_name(job))


SUBMISSION = JobSubmission.model_json_schema()
JOB_ID_PARAMETER = {"name": "job", "in": "path", "required": True, "schema": {"type": "string",
                                                                              "pattern": f"^{JOB_ID.pattern}$"}}
OPENAPI = {
    "openapi": "3.1.0",
    "info": {"title": "gpupool-jobs", "version": "1",
             "description": "Training jobs: submit, follow, cancel. A job is its user's; its team's leads and "
                            "admins see it too; anyone else gets 404."},
    "components": {
        "securitySchemes": {"jupyterhub": {"type": "apiKey", "in": "header", "name": "Authorization",
                                           "description": "token <JupyterHub API token>"}},
        "schemas": {"JobSubmission": SUBMISSION},
    },
    "security": [{"jupyterhub": []}],
    "paths": {
        "/api/jobs": {
            "get": {"summary": "My jobs (and, for a team's leads, the team's; admins: all), newest first"},
            "post": {"summary": "Submit a job; `Idempotency-Key` makes a retried submission one job",
                     "parameters": [{"name": "Idempotency-Key", "in": "header", "schema": {"type": "string",
                                                                                           "maxLength": 200}}],
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": "#/components/schemas/JobSubmission"}}}},
                     "responses": {"201": {"description": "the job, queued"},
                                   "400": {"description": "what is wrong with the submission, and what is accepted"},
                                   "403": {"description": "a team, profile or priority you may not use"}}},
        },
        "/api/jobs/{job}": {
            "parameters": [JOB_ID_PARAMETER],
            "get": {"summary": "The job: state, reason (queue position), runs with their causes, GPU-hours and "
                               "cost so far, the log's tail"},
            "delete": {"summary": "Cancel (as POST …/cancel)"},
        },
        "/api/jobs/{job}/cancel": {"parameters": [JOB_ID_PARAMETER], "post": {
            "summary": "Cancel: a waiting job never starts; a running one gets SIGTERM, then SIGKILL after the "
                       "policy's grace period", "responses": {"409": {"description": "the job has ended"}}}},
        "/api/jobs/{job}/suspend": {"parameters": [JOB_ID_PARAMETER], "post": {
            "summary": "Suspend: a waiting job is held (it keeps its place); a running one gets SIGTERM, then "
                       "SIGKILL after the policy's grace period, and waits suspended. Never counted as a restart",
            "responses": {"409": {"description": "the job is not queued, restarting or running"}}}},
        "/api/jobs/{job}/resume": {"parameters": [JOB_ID_PARAMETER], "post": {
            "summary": "Resume a suspended job: it goes back to the queue at its place and resumes from its last "
                       "checkpoint", "responses": {"409": {"description": "the job is not suspended"}}}},
        "/api/jobs/{job}/log": {"parameters": [JOB_ID_PARAMETER], "get": {
            "summary": "The log from byte `offset` on (text/plain), each progress bar at its last state; header "
                       "X-Log-Offset: where to read next (a line still being drawn at the log's end comes again "
                       "from there, as \\r and its new state); X-Job-State: the job's state",
            "parameters": [{"name": "offset", "in": "query", "schema": {"type": "integer", "minimum": 0}}]}},
        "/": {"get": {"summary": "The Jobs page (HTML)"}},
        "/jobs/{job}": {"parameters": [JOB_ID_PARAMETER], "get": {"summary": "A job's page (HTML)"}},
        "/health": {"get": {"summary": "No login: status and version"}},
    },
}


class OpenAPIHandler(web.RequestHandler):
    def get(self):
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(OPENAPI))


def make_app(ledger: Ledger, policy_dir: str, prefix: str, state_dir: str, team_root: str, base_url: str = "/",
             nav_services: tuple[str, ...] = ("jobs",), images_dir: str | None = None,
             kubernetes: bool = False, run_as: str = "self") -> web.Application:
    job = r"([a-f0-9]{12})"
    return web.Application(
        [
            (prefix, PageHandler),
            (prefix + f"jobs/{job}", JobPageHandler),
            (prefix + f"jobs/{job}/(cancel|suspend|resume)", ActionHandler),
            (prefix + "api/jobs", ListHandler),
            (prefix + f"api/jobs/{job}", JobHandler),
            (prefix + f"api/jobs/{job}/(cancel|suspend|resume)", ActionHandler),
            (prefix + f"api/jobs/{job}/log", LogHandler),
            (prefix + "openapi.json", OpenAPIHandler),
            (prefix + "health", HealthHandler),
            (prefix + "oauth_callback", HubOAuthCallbackHandler),
        ],
        ledger=ledger, store=JobStore(ledger.engine), policy_dir=policy_dir, state_dir=state_dir,
        team_root=team_root, images_dir=images_dir or default_images_dir(), cookie_secret=os.urandom(32),
        prefix=prefix, base_url=base_url, kubernetes=kubernetes, run_as=run_as,
        nav_services=tuple(nav_services), templates=page_templates(), max_body_size=MAX_BODY_BYTES, home_label="Your jobs",
        default_handler_class=NotFoundHandler,
    )


def main(argv=None) -> None:
    """`python -m gpupool.hub.services.jobs_service`: configured from the environment the hub gives it."""
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s %(asctime)s jobs] %(message)s")
    state_dir = defaults.env("GPUPOOL_STATE_DIR", str(defaults.state_dir()))
    ledger = Ledger(defaults.env("GPUPOOL_LEDGER_URL", defaults.ledger_url(state_dir)))
    prefix = defaults.env("JUPYTERHUB_SERVICE_PREFIX", "/services/jobs/")
    nav = tuple(n for n in defaults.env("GPUPOOL_NAV_SERVICES", "jobs").split(",") if n)
    app = make_app(ledger, defaults.env("GPUPOOL_POLICIES", str(DEFAULT_POLICY_DIR)), prefix, state_dir,
                   defaults.env("GPUPOOL_TEAM_ROOT", str(defaults.team_root(state_dir))), defaults.env("JUPYTERHUB_BASE_URL", "/"),
                   nav, kubernetes=defaults.env(MODE_ENV, "embedded") == "kubernetes", run_as=defaults.env(RUN_AS_ENV, "self"))
    url = urlparse(defaults.env("JUPYTERHUB_SERVICE_URL", defaults.service_url("jobs")))
    app.listen(url.port or 80, url.hostname or "127.0.0.1")
    log.info("gpupool-jobs at %s%s", url.geturl(), prefix)
    ioloop.IOLoop.current().start()


if __name__ == "__main__":
    main()
