"""What every gpupool spawner shares: policies, the profile form, and server-side checks of `user_options`.

Both `LocalGPUSpawner` and the Kubernetes spawner mix this in. A user may send anything through the REST
API, so every choice is checked (`gpupool.policies.choice`) against the profiles of the user's teams before
anything starts; a refusal becomes an HTTP 400 or 403 here.
"""

from __future__ import annotations

import copy
import html
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from jupyterhub.spawner import SpawnException
from sqlalchemy.orm import object_session
from sqlalchemy.orm.exc import UnmappedInstanceError
from tornado import web
from traitlets import Unicode, default
from traitlets.config import LoggingConfigurable

from gpupool.policies import DEFAULT_POLICY_DIR, Policy
from gpupool.policies.admission import Reason
from gpupool.policies.choice import Choice, ChoiceRefused, check_choice
from gpupool.policies.identity import server_username_problem
from gpupool.policies.model import Profile
from gpupool.policies.reload import current_policy
from gpupool.policies.resources import profile_share
from gpupool.policies.sharing import share_refusal
from gpupool.spawner.datasets import ServerDatasets, read_credentials_file, server_datasets
from gpupool.spawner.usage import UsageLedgerMixin
from gpupool.spawner.wiring import SERVER_TOKEN_SCOPES


def mlflow_env(url: str, token: str, team: str | None) -> dict[str, str]:
    """The MLflow client's variables in a user server: the hub-served tracking server, the server's hub token."""
    # A private platform never phones home: MLflow's client telemetry is on by default.
    env = {"MLFLOW_TRACKING_URI": url.rstrip("/"), "MLFLOW_TRACKING_TOKEN": token, "MLFLOW_DISABLE_TELEMETRY": "true"}
    if team:
        env["MLFLOW_EXPERIMENT_NAME"] = team
    return env


def choice_env(choice: Choice, policy: Policy) -> dict[str, str]:
    """What a server or a training job of `choice` runs as, for the user's code and `gpupool` in it."""
    env = {}
    env["GPUPOOL_TEAM"] = choice.team
    env["GPUPOOL_PROFILE"] = choice.slug
    env["GPUPOOL_SHARE"] = str(profile_share(choice.profile, policy))
    if choice.profile.gpu is not None:
        env["GPUPOOL_GPU_MODEL"] = choice.profile.gpu.model
    if choice.image is not None:
        env["GPUPOOL_IMAGE"] = choice.image
    return env


@dataclass(frozen=True)
class ProfileAvailability:
    """What a spawn of one profile would do now: `start`, `wait` (in the queue) or `refuse`, and why."""

    action: Literal["start", "wait", "refuse"]
    reason: str = ""
    code: str = ""


@dataclass(frozen=True)
class Availability:
    """The spawn page's view of the pool: per profile slug what a spawn would do now, and the queue's length."""

    profiles: Mapping[str, ProfileAvailability] = field(default_factory=dict)
    queue_length: int | None = None  # requests waiting in the pool's queue now; None: not known
    team_queue_length: int | None = None  # of them, the user's teams'

    WORDS = {"start": ("starts now", "success"), "wait": ("would wait", "warning"), "refuse": ("cannot start", "danger")}

    def as_json(self) -> dict:
        return {"queue_length": self.queue_length, "team_queue_length": self.team_queue_length,
                "profiles": {slug: {"action": seen.action, "reason": seen.reason, "code": seen.code}
                             for slug, seen in self.profiles.items()}}

    def badge(self, slug: str) -> str:
        seen = self.profiles.get(slug)
        if seen is None:
            return ""
        words, colour = self.WORDS[seen.action]
        reason = f": {html.escape(seen.reason)}" if seen.reason and seen.action != "start" else ""
        return (f'<div class="small gpupool-availability" id="availability-{html.escape(slug)}" '
                f'data-action="{seen.action}"><span class="badge bg-{colour} text-bg-{colour}">{words}</span>'
                f"{reason}</div>")

    def summary(self) -> str:
        if self.queue_length is None:
            return ""
        return (f'<p class="small gpupool-availability" id="availability-queue">Queue now: {self.queue_length} '
                f"request(s) waiting, {self.team_queue_length} of them from your team(s). Under each profile: what "
                "it would do if you started it now (refreshed every 15 s).</p>")

    def script(self) -> str:
        if not self.profiles:
            return ""
        # Refreshed while the page is open: the same page fetched again, only its availability lines replaced
        # (the user's choice in the form is left as it is). Without the query: JupyterHub's spawn page starts a
        # server when its query carries options.
        return ("<script>setInterval(function(){fetch(window.location.pathname,{credentials:'same-origin'})"
                ".then(function(r){return r.ok?r.text():null}).then(function(t){if(!t)return;"
                "var d=new DOMParser().parseFromString(t,'text/html');"
                "document.querySelectorAll('.gpupool-availability').forEach(function(e){"
                "var n=d.getElementById(e.id);if(n){e.outerHTML=n.outerHTML}})})},15000)</script>")


class AdmissionRefused(SpawnException):
    """A spawn the pool refused or gave up on, as JupyterHub's `SpawnException` with the reason code.

    JupyterHub counts it as a handled rejection (status `failure`, not an error) under `reason=<code>` in
    `jupyterhub_server_spawn_duration_seconds`, logs no traceback, and shows `jupyterhub_message` on the spawn
    page, in the progress stream's failed event and as the REST error's `message`: the message for people
    with the code after it, `(reason: quota-never-fits)`, so a script can tell why without parsing prose.
    """

    def __init__(self, message: str, code: Reason, status_code: int):
        super().__init__(message, reason=str(code), status_code=status_code)
        self.code = code
        self.jupyterhub_message = f"{message} (reason: {code})"


#: The HTTP status of each refusal: a decision of the policy is 403, a profile the pool can never hold 409
#: (the administrator's to fix), a wait that ended 503 (try again later).
REFUSAL_STATUS = {"deny": 403, "end": 503}


def refusal(message: str, code: Reason) -> AdmissionRefused:
    """The exception a spawner raises for an admission that ended without a server."""
    status = 409 if code is Reason.NEVER_FITS_POOL else REFUSAL_STATUS[code.action]
    return AdmissionRefused(message, code, status)


class GPUPoolSpawnerMixin(UsageLedgerMixin, LoggingConfigurable):
    """Profiles from policies, filtered by the user's teams and checked on the server; usage in the ledger.

    A `LoggingConfigurable` so that its traits take part in the spawner's configuration.
    """

    policy_dir = Unicode(
        help="""
        Directory of gpupool policy files (models, profiles, teams).

        Re-read when its files change; a change that does not pass `gpupool policy check` is logged and
        ignored, so an invalid policy never replaces a valid one.

            c.LocalGPUSpawner.policy_dir = "/etc/gpupool/policies"
        """,
    ).tag(config=True)

    @default("policy_dir")
    def _default_policy_dir(self):
        return os.environ.get("GPUPOOL_POLICIES", str(DEFAULT_POLICY_DIR))

    dataset_credentials_file = Unicode(
        "",
        help="""
        Embedded mode with `datasets.storage: s3`: an AWS shared credentials file (readable by the hub only)
        holding one profile per team, `[gpupool-vision]` with `aws_access_key_id` and
        `aws_secret_access_key`. Each server gets a private copy with the profiles of its user's teams only,
        outside every repository.

            c.LocalGPUSpawner.dataset_credentials_file = "/etc/gpupool/datasets-credentials"
        """,
    ).tag(config=True)

    dataset_secret_name = Unicode(
        "gpupool-datasets-{team}",
        help="""
        Kubernetes mode with `datasets.storage: s3`: the Secret holding a team's S3 credentials (keys
        `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`); `{team}` is replaced by the team. The chart makes
        `<release>-datasets-<team>` from `datasets.credentials` and sets this.

            c.GPUKubeSpawner.dataset_secret_name = "gpupool-datasets-{team}"
        """,
    ).tag(config=True)

    git_email = Unicode(
        "{username}@{hostname}",
        help="""
        Embedded mode: the commit e-mail of each server's git config (the author name is the hub user's
        name), so that `git commit` works in a new server. `{username}` is the hub user, `{hostname}` this
        machine's name. A user's own `git config --global user.email` still takes precedence.

            c.LocalGPUSpawner.git_email = "{username}@lab.example.org"
        """,
    ).tag(config=True)

    mlflow_url = Unicode(
        "",
        help="""
        The URL of gpupool's MLflow service as user servers reach it (through the hub's proxy), e.g.

            c.LocalGPUSpawner.mlflow_url = "https://hub.example.org/services/mlflow/"

        Every server then gets MLFLOW_TRACKING_URI (this URL), MLFLOW_TRACKING_TOKEN (the server's own hub
        token, which may call the MLflow service) and MLFLOW_EXPERIMENT_NAME (its team), so that
        `import mlflow; mlflow.start_run()` logs into the team's experiment. Empty: no MLflow variables.
        `gpupool up` sets it; the Helm chart sets it to the in-cluster proxy address.
        """,
    ).tag(config=True)

    @default("server_token_scopes")
    def _default_server_token_scopes(self):
        return list(SERVER_TOKEN_SCOPES)

    gpupool_choice: Choice | None = None

    def get_env(self):
        env = super().get_env()
        choice = self.gpupool_choice
        if self.mlflow_url and env.get("JUPYTERHUB_API_TOKEN"):
            env.update(mlflow_env(self.mlflow_url, env["JUPYTERHUB_API_TOKEN"], choice.team if choice else None))
        if choice is not None:
            env.update(choice_env(choice, self.policy))
        return env

    @property
    def policy(self) -> Policy:
        return current_policy(self.policy_dir, self.log)

    def user_teams(self) -> list[str]:
        """The user's teams, in policy order: hub groups that are policy teams, plus policy member lists."""
        return self.policy.teams_of(self.user.name, [g.name for g in getattr(self.user, "groups", [])])

    def available_profiles(self) -> dict[str, Profile]:
        return self.policy.profiles_for_teams(set(self.user_teams()))

    def availability_candidates(self, teams: list[str]) -> tuple[dict[str, ProfileAvailability],
                                                                 list[tuple[str, Profile, str]]]:
        """What both modes' `profile_availability` start from: CPU-only profiles start (they never queue), and
        each GPU profile the user may pick, with the first of the user's teams it is offered to."""
        seen: dict[str, ProfileAvailability] = {}
        gpu: list[tuple[str, Profile, str]] = []
        for slug, profile in self.available_profiles().items():
            if profile.gpu is None:
                seen[slug] = ProfileAvailability("start", "no GPU: it never queues")
            else:
                gpu.append((slug, profile, next(t for t in teams if t in profile.teams)))
        return seen, gpu

    # --- the form -------------------------------------------------------------------------------------

    @default("options_form")
    def _default_options_form(self):
        return GPUPoolSpawnerMixin._form_with_availability

    async def profile_availability(self) -> Availability:
        """Whether each profile the user may pick would start now or wait, and why; empty where the spawner
        cannot tell before trying (the Kubernetes mode: Volcano decides in the cluster)."""
        return Availability()

    @staticmethod
    async def _form_with_availability(spawner) -> str:
        try:
            availability = await spawner.profile_availability()
        except Exception:  # noqa: BLE001 - a comfort: the form works without it
            spawner.log.exception("The spawn page's availability could not be computed; the form goes without it")
            availability = Availability()
        return GPUPoolSpawnerMixin._render_form(spawner, availability)

    @staticmethod
    def _render_form(spawner, availability: Availability | None = None) -> str:
        availability = availability or Availability()
        profiles = spawner.available_profiles()
        if not profiles:
            owner = getattr(spawner, "user", None)
            name = html.escape(getattr(owner, "name", None) or "USER")
            if getattr(owner, "admin", False) is True:  # an admin does it themself: say how, not "ask an administrator"
                return ("<p>You are not in any team yet, so there is no profile to start. You are an administrator: "
                        f"put yourself in a team with <code>gpupool team add-member TEAM {name}</code> on the hub's "
                        "machine, or on the Admin page (Groups).</p>")
            return ("<p>You are not in any team yet, so there is no profile to start. Ask an administrator "
                    f"to add you to a team (<code>gpupool team add-member TEAM {name}</code>).</p>")
        default_slug = next((s for s, p in profiles.items() if p.default), next(iter(profiles)))
        policy = spawner.policy
        rows = []
        for slug, profile in profiles.items():
            share = profile_share(profile, policy)
            checked = " checked" if slug == default_slug else ""
            images = ""
            if len(profile.images) > 1:
                options = "".join(
                    f'<option value="{html.escape(i)}"{" selected" if img.default else ""}>'
                    f"{html.escape(img.display_name)}</option>"
                    for i, img in profile.images.items()
                )
                images = f'<select name="image-{html.escape(slug)}" class="form-control">{options}</select>'
            rows.append(
                f'<label class="list-group-item"><input type="radio" name="profile" value="{html.escape(slug)}"'
                f"{checked}> <strong>{html.escape(profile.display_name)}</strong>"
                f'{" · " + html.escape(profile.description) if profile.description else ""}'
                f'{" · " + str(share) + " GPU" if share else ""}'
                f'{" · teams: " + html.escape(", ".join(t for t in profile.teams if t in spawner.user_teams())) if len(spawner.user_teams()) > 1 else ""}'
                f"{availability.badge(slug)}{images}</label>"
            )
        return availability.summary() + '<div class="list-group">' + "".join(rows) + "</div>" + availability.script()

    # A trait default, not a method: a method would shadow JupyterHub's configurable `options_from_form`
    # (a callable, 'simple' or 'passthrough' set in the configuration must win), as in KubeSpawner.
    @default("options_from_form")
    def _default_options_from_form(self):
        return GPUPoolSpawnerMixin._profile_options_from_form

    @staticmethod
    def _profile_options_from_form(formdata):
        options = {}
        if formdata.get("profile"):
            options["profile"] = formdata["profile"][0]
            image = formdata.get(f"image-{options['profile']}")
            if image:
                options["image"] = image[0]
        if formdata.get("team"):
            options["team"] = formdata["team"][0]
        return options

    # --- checking user_options ---------------------------------------------------------------------------

    @default("apply_user_options")
    def _default_apply_user_options(self):
        return GPUPoolSpawnerMixin._apply_choice

    @staticmethod
    def _apply_choice(spawner, user_options) -> None:
        problem = server_username_problem(spawner.user.name, spawner.policy.teams)
        if problem:
            raise web.HTTPError(403, f"no server can start for this user: {problem}. An administrator renames "
                                     "the user (PATCH /hub/api/users/NAME with a new name)")
        orm_spawner = getattr(spawner, "orm_spawner", None)
        try:
            spawner.check_named_server()
            choice = spawner.check_user_options(user_options or {})
        except web.HTTPError:
            # JupyterHub stored the raw options before handing them over: a refused request leaves behind the
            # last choice that passed (or nothing), never what was refused.
            if orm_spawner is not None:
                previous = spawner.gpupool_choice
                orm_spawner.user_options = _resolved(previous) if previous else {}
                try:
                    session = object_session(orm_spawner)
                except UnmappedInstanceError:  # a spawner outside a hub (tests)
                    session = None
                if session is not None:
                    session.commit()
            raise
        spawner.gpupool_choice = choice
        # The choice as checked, defaults filled in, is what the hub keeps and shows (`read:servers`): the
        # accounting service reads a server's team and profile there, and a restart spawns the same again.
        resolved = _resolved(choice)
        spawner.user_options = resolved
        if orm_spawner is not None:
            orm_spawner.user_options = resolved  # committed with the spawner's state after start
            spawner.revoke_shares_outside_team(orm_spawner, choice.team)
        spawner.apply_choice(choice)

    def revoke_shares_outside_team(self, orm_spawner, team: str) -> None:
        """Revoke the server's shares that the policy does not allow now that it starts for `team`.

        A share is checked when it is made (`gpupool.hub.sharing`); this keeps the rule when the server starts
        for another team, the team's `sharing` was turned off, or a teammate left the team since.
        """
        shares = list(getattr(orm_spawner, "shares", None) or [])
        if not shares:
            return
        policy, revoked = self.policy, []
        for share in shares:
            if share.user is not None:
                their_teams = policy.teams_of(share.user.name, [g.name for g in share.user.groups])
                problem = share_refusal(policy, self.user.name, self.name, team, user=share.user.name,
                                        user_teams=their_teams)
            else:
                problem = share_refusal(policy, self.user.name, self.name, team, group=share.group.name)
            if problem:
                self.log.warning("Revoking the share of %s with %s: %s", self._log_name,
                                 share.user.name if share.user is not None else f"group {share.group.name}", problem)
                revoked.append(share)
        if not revoked:
            return
        try:
            session = object_session(orm_spawner)
        except UnmappedInstanceError:  # a spawner outside a hub (tests)
            session = None
        if session is not None:
            for share in revoked:
                session.delete(share)
            session.commit()

    #: Whether the spawner itself counts a user's named servers against their teams' limit: where the hub's own
    #: `named_server_limit_per_user` cannot say it per user (the Kubernetes mode's one static number); the embedded
    #: hub's limit is the teams' already, per user, and JupyterHub's own counting stays the contract there.
    counts_named_servers = False

    def check_named_server(self) -> None:
        """A 403 for a named server of a user whose teams allow none (`named_servers: 0`), and, where the spawner
        counts them (`counts_named_servers`), for one beyond what the user's teams allow.

        JupyterHub counts named servers against `named_server_limit_per_user` but reads 0 as "no limit", so the
        teams' 0 is enforced here, before anything starts.
        """
        teams = self.user_teams()
        if not self.name or not teams:
            return
        limit = self.policy.named_server_limit(teams)
        if limit == 0:
            raise web.HTTPError(
                403, f"{self.user.name}'s teams ({', '.join(teams)}) allow no named servers "
                     f"(teams.TEAM.named_servers is 0): start the default server instead"
            )
        if not self.counts_named_servers:
            return
        others = sorted(name for name, spawner in (getattr(self.user, "spawners", None) or {}).items()
                        if name and name != self.name and (spawner.active or spawner.ready))
        if len(others) >= limit:
            raise web.HTTPError(
                403, f"{self.user.name}'s teams ({', '.join(teams)}) allow {limit} named server"
                     f"{'' if limit == 1 else 's'} at once (teams.TEAM.named_servers), and "
                     f"{', '.join(others)} run{'s' if len(others) == 1 else ''}: stop one first"
            )

    def check_user_options(self, options: dict) -> Choice:
        """A `Choice` from untrusted `options`, or an HTTP 400/403 naming what is wrong and what is accepted."""
        try:
            return check_choice(self.policy, self.user.name, self.user_teams(), options)
        except ChoiceRefused as refused:
            raise web.HTTPError(403 if refused.forbidden else 400, refused.message) from None

    def server_datasets(self, team_root: str, kubernetes: bool = False) -> ServerDatasets:
        """The DVC remotes of this server (default: the team it is charged to) and how to reach them."""
        choice = self.gpupool_choice
        if kubernetes:
            return server_datasets(self.policy, self.user_teams(), choice.team, team_root,
                                   secret_name=self.dataset_secret_name)
        credentials = {}
        if self.policy.datasets.storage == "s3" and not self.dataset_credentials_file:
            self.log.warning("datasets.storage is s3 but no dataset_credentials_file is set: the team remotes "
                             "of %s's server will have no credentials", self.user.name)
        if self.dataset_credentials_file and self.policy.datasets.storage == "s3":
            credentials = read_credentials_file(Path(self.dataset_credentials_file).read_text())
            missing = [t for t in self.user_teams() if t not in credentials]
            if missing:
                self.log.warning("%s has no profile for team(s) %s: their S3 remotes will refuse access",
                                 self.dataset_credentials_file, ", ".join(missing))
        email = self.git_email.format(username=self.user.name, hostname=socket.gethostname())
        return server_datasets(self.policy, self.user_teams(), choice.team, team_root, credentials=credentials,
                               git_user=self.user.name, git_email=email)

    def apply_choice(self, choice: Choice) -> None:
        """Set the spawner's traits from a checked choice (subclasses add what their backend needs)."""

    def ensure_choice(self) -> Choice:
        """The checked choice, checked now when the start did not go through `apply_user_options` (a spawn
        from the REST API of a hub whose `apply_user_options` is configured otherwise, an adopted server)."""
        if self.gpupool_choice is None:
            self._apply_choice(self, self.user_options)
        return self.gpupool_choice

    def queued_start_timeout(self, base: float, choice: Choice, can_queue: bool) -> float:
        """`start_timeout` for `choice`: waiting in the queue must not count against the configured `base`, so a
        start that can queue gets the team's queue timeout on top."""
        return base + (self.policy.queue_timeout(choice.team) if can_queue else 0)

    # --- the choice across hub restarts -------------------------------------------------------------------

    def get_state(self):
        state = super().get_state()
        if self.gpupool_choice:
            state["choice"] = {"profile": self.gpupool_choice.slug, "team": self.gpupool_choice.team,
                               "image": self.gpupool_choice.image}
        return state

    def load_state(self, state):
        super().load_state(state)
        choice = state.get("choice")
        if choice and choice["profile"] in self.policy.profiles:
            # A copy: a spawner's choice is its own (the policy's objects are shared by every spawner).
            self.gpupool_choice = Choice(choice["profile"], copy.deepcopy(self.policy.profiles[choice["profile"]]),
                                         choice["team"], choice["image"])


def _resolved(choice: Choice) -> dict:
    return {"profile": choice.slug, "team": choice.team, **({"image": choice.image} if choice.image else {})}
