"""Embedded-mode JupyterHub configuration from gpupool settings: `apply_config` only sets traits on `c`."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from gpupool.hub.lifecycle import supervised
from gpupool.policies import DEFAULT_POLICY_DIR, defaults, load_policy
from gpupool.spawner.wiring import (
    ACCOUNTING_SERVICE, CULLER_SERVICE, JOBS_SERVICE, MLFLOW_PREFIX, MLFLOW_ROLE, MLFLOW_SERVICE, mlflow_url, service_roles,
    sharing_roles, team_groups,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
#: gpupool's overrides of JupyterHub's page templates (the home page of a user in no team).
TEMPLATES = Path(__file__).resolve().parent / "templates"

#: The scopes of the `gpupool-cli` service (used by `gpupool team add-member`): nothing more.
# read:servers and delete:servers: `gpupool down --servers` stops every server through the hub.
CLI_SCOPES = ["admin:groups", "admin:users", "list:users", "read:users", "list:groups", "read:groups", "read:servers",
              "delete:servers"]


#: Set by `gpupool up --unsafe-shared-as-user`: a hub run by an ordinary Unix user lets several people in anyway.
UNSAFE_SHARED_AS_USER = "GPUPOOL_UNSAFE_SHARED_AS_USER"


def personal_workstation(environ=None) -> bool:
    """Whether the platform is a personal workstation: run by an ordinary Unix user, without
    `--unsafe-shared-as-user`. Every server then runs as that user, beside the hub's state (its admin-scoped token,
    cookie secret, database), so only the admin's account may exist: a second person could take the hub over."""
    environ = os.environ if environ is None else environ
    return os.geteuid() != 0 and environ.get(UNSAFE_SHARED_AS_USER) != "1"


def shared_as_user_warning(user: str) -> str:
    """What `gpupool up --unsafe-shared-as-user` says at every start, run by the ordinary Unix user `user`."""
    return (f"gpupool: WARNING: --unsafe-shared-as-user: a hub shared by several people but run by the ordinary user "
            f"{user}: EVERY USER'S SERVER RUNS AS {user}, beside the hub's state: any user can read its secrets (the "
            f"admin-scoped CLI token, the cookie secret, the database), every other user's files and team data, and "
            f"become admin. A shared hub needs root.")


@dataclass(frozen=True)
class PlatformSettings:
    """The embedded platform's locations, ports and switches, as `gpupool up` passes them to the hub (`GPUPOOL_*`,
    `from_env`); not the policy's `settings:` section (`gpupool.policies.model.Settings`)."""

    state_dir: Path
    policy_dir: Path = DEFAULT_POLICY_DIR
    ip: str = "127.0.0.1"
    port: int = defaults.PORT
    admin: str = "admin"
    authenticator: str = "native"
    ledger_url: str = ""
    mlflow_backend_url: str = ""
    #: The teams' shared folders (data, dataset registries); outside the 0700 state folder when servers run
    #: as their own users, who could not reach it there.
    team_root: str = ""
    #: Run the MLflow service (off: servers get no MLFLOW_* variables).
    mlflow: bool = True
    #: Only the admin's account exists and logs in (`personal_workstation`).
    personal: bool = False
    extra_services: list[dict] = field(default_factory=list)

    @property
    def hub_port(self) -> int:
        return self.port + defaults.PORT_OFFSETS["hub"]

    @property
    def proxy_api_port(self) -> int:
        return self.port + defaults.PORT_OFFSETS["proxy API"]

    @property
    def accounting_port(self) -> int:
        return self.port + defaults.PORT_OFFSETS["accounting"]

    @property
    def mlflow_port(self) -> int:
        return self.port + defaults.PORT_OFFSETS["mlflow"]

    @property
    def jobs_port(self) -> int:
        return self.port + defaults.PORT_OFFSETS["jobs"]

    @property
    def culler_port(self) -> int:
        return self.port + defaults.PORT_OFFSETS["culler"]

    @property
    def mlflow_url(self) -> str:
        """Where users reach MLflow: through the hub's proxy, behind the hub login."""
        return mlflow_url(self.url)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}/"

    @classmethod
    def from_env(cls) -> PlatformSettings:
        env = os.environ
        return cls(
            state_dir=defaults.state_dir(env),
            policy_dir=Path(env.get("GPUPOOL_POLICIES", DEFAULT_POLICY_DIR)),
            ip=env.get("GPUPOOL_IP", "127.0.0.1"),
            port=int(env.get("GPUPOOL_PORT", str(defaults.PORT))),
            admin=env.get("GPUPOOL_ADMIN", "admin"),
            authenticator=env.get("GPUPOOL_AUTHENTICATOR", "native"),
            ledger_url=env.get("GPUPOOL_LEDGER_URL", ""),
            mlflow_backend_url=env.get("GPUPOOL_MLFLOW_BACKEND_URL", ""),
            team_root=env.get("GPUPOOL_TEAM_ROOT", ""),
            mlflow=env.get("GPUPOOL_MLFLOW", "1") != "0",
            personal=personal_workstation(env),
        )

    def __post_init__(self):
        if not self.ledger_url:
            object.__setattr__(self, "ledger_url", defaults.ledger_url(self.state_dir))
        if not self.mlflow_backend_url:
            object.__setattr__(self, "mlflow_backend_url", f"sqlite:///{self.state_dir / 'mlflow.sqlite'}")
        if not self.team_root:
            object.__setattr__(self, "team_root", str(defaults.team_root(self.state_dir)))


def workstation_problem(db_url: str, settings: PlatformSettings) -> str | None:
    """Why the platform cannot start as a personal workstation (`settings.personal`), or None: the hub's database
    (`db_url`) or the policies' member lists know someone besides the admin, e.g. after a run with
    `--unsafe-shared-as-user`. Refused rather than blocked: JupyterHub's blocked users lose their groups."""
    import sqlalchemy

    others: set[str] = set()
    path = db_url.removeprefix("sqlite:///") if db_url.startswith("sqlite:///") else None
    if path is None or Path(path).exists():
        engine = sqlalchemy.create_engine(db_url)
        try:
            with engine.connect() as db:
                tables = set(sqlalchemy.inspect(db).get_table_names())
                for table, column in (("users", "name"), ("users_info", "username")):  # hub users, sign-ups
                    if table in tables:
                        others |= {n for (n,) in db.execute(sqlalchemy.text(f"SELECT {column} FROM {table}"))}
        finally:
            engine.dispose()
    policy = load_policy(settings.policy_dir)
    members = {name for team in policy.teams.values() for name in team.members}
    others = sorted((others | members) - {settings.admin})
    if not others:
        return None
    return (f"a personal workstation has the admin {settings.admin!r} alone, but the hub already knows "
            f"{', '.join(others)} (from the policies' member lists, or a run with --unsafe-shared-as-user). Run by an "
            f"ordinary Unix user, every server runs as that user beside the hub's state, so any of them could take "
            f"the hub over. Share a hub as root (README: Running as root or not); or remove them (from the "
            f"policies' members; on /hub/admin of a run with --unsafe-shared-as-user); or accept the risk with "
            f"--unsafe-shared-as-user")


def proxy_command() -> list[str]:
    local = REPO_ROOT / "node_modules" / ".bin" / "configurable-http-proxy"
    if local.exists():
        return [str(local)]
    beside = Path(sys.executable).parent / "configurable-http-proxy"  # the servers' environment (/opt/gpupool/env)
    if beside.exists():
        return [str(beside)]
    found = shutil.which("configurable-http-proxy")
    if found:
        return [found]
    raise RuntimeError("configurable-http-proxy is not installed: run `make up` (npm install into the repository)")


def mlflow_service(settings: PlatformSettings) -> dict:
    """The hub-managed `mlflow server` of the embedded mode: SQLite runs and models, artifacts in the state folder.

    Artifacts go through the server (`--serve-artifacts`), so clients never hold storage credentials; the
    `gpupool` app (mlflow/auth.py) puts the hub login and the team permissions in front of everything.
    """
    state = settings.state_dir
    return {
        "name": MLFLOW_SERVICE,
        "url": f"http://127.0.0.1:{settings.mlflow_port}",
        # `mlflow server` that becomes its uvicorn: one process, not a waiting parent beside it (hub/mlflow_server.py)
        "command": [
            sys.executable, "-m", "gpupool.hub.mlflow_server", "--app-name", "gpupool",
            "--serve-artifacts", "--artifacts-destination", str(state / "mlflow-artifacts"),
            "--host", "127.0.0.1", "--port", str(settings.mlflow_port),
            "--static-prefix", MLFLOW_PREFIX.rstrip("/"),
            # The proxy forwards the hub's public Host; the hub login in front of every route is what protects
            # the server (a rebound DNS name carries no hub cookie or token).
            "--allowed-hosts", "*",
            # One worker: the embedded mode shares its few cores with the hub and the servers.
            "--workers", "1",
        ],
        "environment": {
            # Not on the command line, which every user of the machine can read (`ps`): the URL may hold a password.
            "MLFLOW_BACKEND_STORE_URI": settings.mlflow_backend_url,
            "GPUPOOL_POLICIES": str(settings.policy_dir), "GPUPOOL_LEDGER_URL": settings.ledger_url,
            # MLflow's job runner (a huey consumer and its workers, most of MLflow's memory) serves only the
            # jobs routes (GenAI evaluation, trace rollups), which the gpupool app refuses: not started.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            # A private platform never phones home (MLflow's usage telemetry is on by default).
            "MLFLOW_DISABLE_TELEMETRY": "true",
        },
        # The hub gives up (and exits) when a managed service does not answer in time; MLflow's first start
        # creates its database and imports a lot, which takes a minute on a busy small machine.
        "timeout": 180,
        "oauth_no_confirm": True,
        "display": True,
    }


def home_page_teams(policy_dir: Path, ledger_url: str = ""):
    """`JupyterHub.template_vars["gpupool"]`: for the home page, the user's teams and every team's leads
    (`teams` is None where they are not known: then the home page is JupyterHub's own), how many named
    servers they may have, and `servers()`: their active servers with profile and cost so far (from the
    ledger at `ledger_url`; asked only by the home page).

    Read from the current policies (and the user's hub groups, which `gpupool team add-member` changes) at
    each page, so a user added to a team sees the Start button on their next visit.
    """
    def teams(user) -> dict:
        # The hot-reloading policy; imported here, at the first page, not by every `gpupool` command.
        from gpupool.policies.reload import current_policy

        if user is None:
            return {"teams": None, "leads": []}
        try:
            policy = current_policy(policy_dir)
        except Exception:  # never break the hub's pages over this: the home page shows as JupyterHub's own
            return {"teams": None, "leads": []}
        groups = {getattr(g, "name", g) for g in getattr(user, "groups", []) or []}
        mine = sorted((groups | set(policy.teams_of(user.name))
                       | set(policy.leads_of(user.name, groups))) & set(policy.teams))
        return {"teams": mine, "leads": [(t, sorted(team.leads)) for t, team in sorted(policy.teams.items())
                                         if team.leads],
                "named_servers": policy.named_server_limit(policy.teams_of(user.name, groups)),
                "servers": partial(home_servers_of, policy, ledger_url, user)}
    return teams


def home_servers_of(policy, ledger_url: str, user) -> list[dict[str, str]]:
    """`user`'s active servers (default and named) for the home page's table; empty when the ledger fails."""
    from gpupool.hub.accounting.reports import home_servers
    from gpupool.spawner.usage import get_ledger

    servers = [(name, spawner.started, spawner.user_options or {})
               for name, spawner in sorted(user.orm_spawners.items())
               if spawner.server is not None or spawner.started is not None]
    if not servers:
        return []
    try:
        return home_servers(get_ledger(ledger_url), policy, user.name, servers)
    except Exception:  # the home page shows without the table rather than not at all
        logging.getLogger("gpupool.home").exception("the home page's servers of %s", user.name)
        return []


def named_server_limit(policy_dir: Path):
    """`JupyterHub.named_server_limit_per_user`: the named servers the user whose servers are asked for may have
    (`teams.TEAM.named_servers`, the largest of their teams').

    JupyterHub calls it with the request's handler: the user is the one in the path (`/hub/api/users/NAME/…`,
    `/hub/spawn/NAME/…`), else the one asking (the home page). JupyterHub reads 0 as "no limit": a user whose
    teams allow no named server gets 0 here, and the spawner refuses to start a named server for them.
    """
    def limit(handler) -> int:
        from gpupool.policies.reload import current_policy

        user = handler.find_user(handler.path_args[0]) if handler.path_args else None
        user = user or handler.current_user
        if user is None:
            return 0
        policy = current_policy(policy_dir)
        return policy.named_server_limit(policy.teams_of(user.name, [g.name for g in user.groups]))
    return limit


#: The hub service whose token starts queued requests again after a restart (no process, scope `servers`).
QUEUE_SERVICE = "gpupool-queue"


def home_queue_notice(state_dir: str, user) -> str:
    """The home page's announcement for `user`: queued requests a restart lost, and why."""
    from gpupool.spawner.requeue import queue_notices

    return queue_notices(state_dir, user.name) if user is not None else ""


def home_announcement(state_dir: str, ledger_url: str, user) -> str:
    """The home page's announcement for `user`: queued requests a restart lost, and servers the idle culler
    is about to stop (with the way to keep them)."""
    if user is None:
        return ""
    notices = [home_queue_notice(state_dir, user)]
    try:
        notices.append(idle_notice(ledger_url, user.name))
    except Exception:  # the home page shows without the warning rather than not at all
        logging.getLogger("gpupool.home").exception("the idle warnings of %s", user.name)
    return "".join(n for n in notices if n)


def policy_notice(policy_dir: str, user) -> str:
    """For admins, atop every hub page (the admin page, sign-up approvals, home): a change of the policy files the
    hot reload refused, each problem with its file and line, while the previous policy stays in force."""
    if user is None or not getattr(user, "admin", False):
        return ""
    from markupsafe import Markup

    from gpupool.policies.reload import refused_change

    error = refused_change(policy_dir)
    if error is None:
        return ""
    problems = Markup("").join(Markup("<li><code>{}</code></li>").format(str(p)) for p in error.problems)
    return str(Markup('<div id="gpupool-policy-refused" class="text-start"><strong>A change of the policies in {} '
                      'was refused:</strong> the hub keeps the previous policy until the files are fixed '
                      '(<code>gpupool policy check</code> says the same).<ul class="mb-1">{}</ul></div>').format(
        policy_dir, problems))


def idle_notice(ledger_url: str, name: str) -> str:
    """The idle culler's warnings for `name`'s servers, as HTML, linking the culler's page to keep them."""
    from markupsafe import Markup

    from gpupool.hub.accounting.culls import IdleStore
    from gpupool.spawner.usage import get_ledger

    warned = [s for s in IdleStore(get_ledger(ledger_url).engine).running(name) if s.record.warned_for is not None]
    items = [Markup("<li>{}</li>").format(s.seen.get("message", "")) for s in warned]
    if not items:
        return ""
    return Markup('<div id="gpupool-idle-warning"><strong>Idle GPU:</strong><ul class="list-unstyled mb-1">{}</ul>'
                  '<a class="btn btn-sm btn-warning" href="{}">Keep it</a></div>').format(
        Markup("").join(items), f"../services/{CULLER_SERVICE}/")


def apply_config(c, settings: PlatformSettings) -> None:
    """Set the traits of a traitlets Config `c` for the embedded platform."""
    policy = load_policy(settings.policy_dir)
    state = settings.state_dir

    c.JupyterHub.bind_url = settings.url
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = settings.hub_port
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{settings.proxy_api_port}"
    c.ConfigurableHTTPProxy.command = proxy_command()
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    # Restarting gpupool must not stop running servers: they are re-adopted with their allocations.
    c.JupyterHub.cleanup_servers = False
    c.JupyterHub.cleanup_proxy = True
    c.JupyterHub.template_paths = [str(TEMPLATES)]

    c.JupyterHub.spawner_class = "gpupool.spawner.local.LocalGPUSpawner"
    c.LocalGPUSpawner.policy_dir = str(settings.policy_dir)
    c.LocalGPUSpawner.state_dir = str(state)
    c.LocalGPUSpawner.ledger_url = settings.ledger_url
    c.LocalGPUSpawner.team_root = settings.team_root
    c.Spawner.default_url = "/lab"
    # Named servers (`/user/NAME/SERVER`), each with its own profile, as many as the user's teams allow; all of a
    # user's servers are one user against the concurrent quotas (the pool sums them per team and user).
    c.JupyterHub.allow_named_servers = True
    c.JupyterHub.named_server_limit_per_user = named_server_limit(settings.policy_dir)
    # Who may share a server with whom (teams.TEAM.sharing): read again at each share by gpupool's hub.
    c.GPUPoolHub.policy_dir = str(settings.policy_dir)
    c.Spawner.environment = {"GPUPOOL_HUB_URL": settings.url}
    c.LocalGPUSpawner.mlflow_url = settings.mlflow_url if settings.mlflow else ""
    # Requests waiting in the queue when the hub stops are started again when it is back (spawner/requeue.py),
    # with a token made anew at every start and known only to the hub process; users whose request could not
    # come back are told why on their home page.
    queue_token = secrets.token_hex(32)
    c.LocalGPUSpawner.queue_service_token = queue_token
    notice = partial(policy_notice, str(settings.policy_dir))
    home = partial(home_announcement, str(state), settings.ledger_url)
    c.JupyterHub.template_vars = {"gpupool": home_page_teams(settings.policy_dir, settings.ledger_url),
                                  "announcement": notice,
                                  # the home page shows its own instead of the pages' one: a refused policy leads it
                                  "announcement_home": lambda user: notice(user) + home(user)}

    if settings.authenticator == "native":
        c.JupyterHub.authenticator_class = "gpupool.hub.auth.GPUPoolNativeAuthenticator"
        c.GPUPoolNativeAuthenticator.admin_password_hash_file = str(state / "admin.bcrypt")
        c.GPUPoolNativeAuthenticator.policy_dir = str(settings.policy_dir)  # team names are reserved
        c.GPUPoolNativeAuthenticator.open_signup = False
        c.GPUPoolNativeAuthenticator.minimum_password_length = 10
        c.GPUPoolNativeAuthenticator.personal_workstation = settings.personal
        # NativeAuthenticator only lets in users an admin approved, so every approved user may log in.
        c.Authenticator.allow_all = True
    else:
        c.JupyterHub.authenticator_class = settings.authenticator
    c.Authenticator.admin_users = {settings.admin}
    if settings.personal:
        # Whatever the authenticator: the admin alone logs in, not even a user an earlier run knew.
        c.Authenticator.allow_all = False
        c.Authenticator.allowed_users = {settings.admin}
        c.Authenticator.allow_existing_users = False

    # Teams are JupyterHub groups, created from policies at start-up with the members policies list.
    c.JupyterHub.load_groups = team_groups(policy)
    token_file = state / "cli-token"
    services = [{"name": "gpupool-cli", "api_token": token_file.read_text().strip()}] if token_file.exists() else []
    # tokens!user=ADMIN: `gpupool jobs` on the hub's machine acts as the admin with a token made for the command.
    roles = [{"name": "gpupool-cli", "description": "gpupool team add-member, gpupool jobs as the admin",
              "scopes": [*CLI_SCOPES, f"tokens!user={settings.admin}"], "services": ["gpupool-cli"]}] if services else []
    services.append({"name": QUEUE_SERVICE, "api_token": queue_token})
    roles.append({"name": QUEUE_SERVICE, "description": "gpupool starts the requests that waited in the queue "
                  "again after a hub restart", "scopes": ["servers"], "services": [QUEUE_SERVICE]})
    # What the hub's navigation bar lists under Services for every user, on the services' pages too.
    nav_services = ",".join([ACCOUNTING_SERVICE, JOBS_SERVICE, CULLER_SERVICE]
                            + ([MLFLOW_SERVICE] if settings.mlflow else []))
    def platform_service(name: str, port: int, module: str, **environment: str) -> dict:
        """A gpupool service the hub runs (`python -m module` on `port`), with the platform's settings."""
        return {
            "name": name,
            "url": f"http://127.0.0.1:{port}",
            "command": [sys.executable, "-m", module],
            "environment": {"GPUPOOL_STATE_DIR": str(state), "GPUPOOL_POLICIES": str(settings.policy_dir),
                            "GPUPOOL_LEDGER_URL": settings.ledger_url, "GPUPOOL_NAV_SERVICES": nav_services,
                            **environment},
            "oauth_no_confirm": True,
            "display": True,
        }

    services += [
        # Usage, budgets, bills, metrics (least-privilege role).
        platform_service(ACCOUNTING_SERVICE, settings.accounting_port, "gpupool.hub.services.accounting_service",
                         GPUPOOL_TEAM_ROOT=settings.team_root),
        # Training jobs' API and page (no hub scopes); the hub process runs the jobs themselves.
        platform_service(JOBS_SERVICE, settings.jobs_port, "gpupool.hub.services.jobs_service",
                         GPUPOOL_TEAM_ROOT=settings.team_root),
        # The idle culler: warns, then stops, servers whose GPU share sits idle (hub/culler.py).
        platform_service(CULLER_SERVICE, settings.culler_port, "gpupool.hub.culler"),
    ]
    if settings.mlflow:
        services.append(mlflow_service(settings))
    roles += [{"name": name, **role} for name, role in service_roles().items()
              if settings.mlflow or name != MLFLOW_ROLE]
    roles += sharing_roles(policy)
    # gpupool's own services run under the lifecycle supervisor: they stop with the hub, even when it crashes.
    c.JupyterHub.services = [supervised(s, state) for s in services] + list(settings.extra_services)
    c.JupyterHub.load_roles = roles
