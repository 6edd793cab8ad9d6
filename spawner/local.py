"""`LocalGPUSpawner`: JupyterHub's local process spawner with a GPU share from the embedded pool.

A spawn asks the pool for the profile's share, waiting in the team's queue (with progress messages) until it
fits; the server then runs with `CUDA_VISIBLE_DEVICES` set to its card and the MPS limits of its share.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner
from sqlalchemy.orm import object_session
from tornado import web
from traitlets import Unicode, default

from gpupool.hub.accounting import notify
from gpupool.hub.accounting.ledger import HowEnded, Ledger
from gpupool.policies import periods
from gpupool.policies import defaults
from gpupool.policies.admission import AdmissionRequest, Holdings, decide
from gpupool.policies.choice import Choice
from gpupool.policies.identity import unix_group, unix_user
from gpupool.policies.model import Policy, parse_quantity
from gpupool.policies.placement import placement_for
from gpupool.policies.resources import profile_share
from gpupool.spawner.accounts import (
    DEFAULT_RECORD, Account, IdentityConflict, ensure_account, is_shared_with_group, share_with_group,
)
from gpupool.spawner.datasets import ServerDatasets
from gpupool.spawner.images import default_images_dir, image_prefix
from gpupool.spawner.mixin import Availability, GPUPoolSpawnerMixin, ProfileAvailability, refusal
from gpupool.spawner.pool import (
    AllocationStore, Decide, Hold, LocalPool, Refused, Request, Verdict, discover_cards, process_alive,
    process_start_time,
)
from gpupool.spawner.requeue import requeue

_pools: dict[str, LocalPool] = {}


def _verdict(decision) -> Verdict:
    return Verdict(decision.action, "" if decision.admitted else decision.reason, decision.priority, code=decision.code)


def admission(policy_of: Callable[[], Policy], ledger: Ledger) -> Decide:
    """The accounting's decision for ordering and explaining the pool's queue (pure: nothing is written).

    The period's usage is read from the ledger once per state of the queue (per `Holdings` a pass of the queue
    decides against: a new pass, or a placement within one), not once per waiting request: a queue of 50 asks
    the ledger once per pass, and the decisions of one pass all see the same usage.
    """
    seen: list = [None, None]  # the holdings last decided against, and the usage read for them

    def decide_queued(request: Request, holdings: Holdings) -> Verdict:
        at = periods.utcnow()
        period = periods.period_of(at)
        if seen[0] is not holdings or seen[1].period != period:
            seen[:] = holdings, ledger.usage(period, at)
        asked = AdmissionRequest(user=request.user, team=request.team, at=at, profile=request.profile)
        return _verdict(decide(policy_of(), asked, holdings, seen[1]))

    return decide_queued


def door(policy_of: Callable[[], Policy], ledger: Ledger, log) -> Hold:
    """The pool's placements through the ledger's one door (`notify.admit` → `Ledger.admit`): decided again and
    held as `reserved` under the request's holding key in one transaction, with the budget alerts it crosses."""

    def hold(request: Request) -> Verdict:
        asked = AdmissionRequest(user=request.user, team=request.team, at=periods.utcnow(), profile=request.profile)
        return _verdict(notify.admit(policy_of(), ledger, asked, request.holding, log).decision)

    return hold


def exit_record(state_dir: str, pid: int, started: float | None) -> Path:
    """Where the exit watcher of the server process `pid` (started at `started`) writes when it ended."""
    return Path(state_dir) / "exits" / f"{pid}-{int(started or 0)}"


def watch_exit(pid: int, record: Path) -> None:
    """Record when process `pid` ends, even while the hub is down: a detached `tail --pid`, then the time.

    Run by the hub's user, outside the server's session, into the hub's own state folder, so a server cannot
    write its own end. It notices an end within a second once the process is reaped (at once when the hub is
    down: orphans are reaped by init). The shell and `tail` cost about 2 MB per server.
    """
    record.parent.mkdir(mode=0o700, exist_ok=True)
    script = ('(tail --pid="$1" -s 1 -f /dev/null; date -u +%s.%N > "$2.tmp" && mv "$2.tmp" "$2") '
              '</dev/null >/dev/null 2>&1 &')
    # The outer shell exits at once (so nothing is left for the hub to reap); its background child goes on.
    subprocess.run(["sh", "-c", script, "gpupool-exit-watch", str(pid), str(record)], check=False,
                   start_new_session=True, stdin=subprocess.DEVNULL)


def read_exit_record(record: Path) -> datetime | None:
    """When the watched process ended (aware UTC), consuming the record; None when there is none."""
    try:
        ended = datetime.fromtimestamp(float(record.read_text().strip()), UTC)
    except (OSError, ValueError):
        return None
    record.unlink(missing_ok=True)
    return ended


def get_pool(state_dir: str, policy_of: Callable[[], Policy], ledger: Ledger, log) -> LocalPool:
    """The hub process's pool for `state_dir` (one per process: the queue lives in memory)."""
    pool = _pools.get(state_dir)
    if pool is None:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        cards, source = discover_cards(policy_of())
        # What is held against the quotas is the ledger's (reserved and running holdings); the store says which
        # cards are taken.
        pool = LocalPool(cards, AllocationStore(Path(state_dir) / "allocations.sqlite"), admission(policy_of, ledger),
                         lambda model: placement_for(policy_of(), model), holdings=ledger.holdings,
                         hold=door(policy_of, ledger, log),
                         unhold=lambda request: ledger.close_run(request.holding, periods.utcnow(), HowEnded.FAILED))
        pool.devices_are_real = source == "nvml"
        _pools[state_dir] = pool
        # Exit records nobody read (servers the hub stopped itself) are only clutter after a day.
        for record in (Path(state_dir) / "exits").glob("*"):
            if time.time() - record.stat().st_mtime > 86400:
                record.unlink(missing_ok=True)
    return pool


def mps_env(state_dir: str, share, card_memory_gib: int) -> dict[str, str]:
    """The CUDA MPS limits of a share: a thread percentage and a pinned device memory limit."""
    env = {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, int(share * 100))),
        # device 0 is the one card CUDA_VISIBLE_DEVICES leaves visible
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={int(share * card_memory_gib * 1024)}M",
    }
    pipe = Path(state_dir) / "mps" / "pipe"
    if pipe.is_dir():
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(pipe.parent / "log")
    return env


def ensure_mps_daemon(state_dir: str, log) -> bool:
    """Start the NVIDIA MPS control daemon for the pool when the driver ships it; False when it cannot run."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return False
    pipe, logs = Path(state_dir) / "mps" / "pipe", Path(state_dir) / "mps" / "log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    if (pipe / "control").exists():
        return True
    result = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        log.warning("NVIDIA MPS daemon did not start (%s); GPU share limits are advisory", result.stderr.strip())
        return False
    return True


def runnable_by_others(path: Path) -> bool:
    """Whether users other than the owner can run `path` (every folder above it searchable by others)."""
    real = Path(os.path.realpath(path))
    return bool(real.stat().st_mode & 0o001) and all(p.stat().st_mode & 0o001 for p in real.parents)


#: Where `make install` builds the servers' environment when run as root.
ROOT_SERVER_ENV = Path("/opt/gpupool/env")
#: Set by `gpupool up --unsafe-single-user`: servers may run as root (no isolation between users).
UNSAFE_SINGLE_USER = "GPUPOOL_UNSAFE_SINGLE_USER"


def default_server_env() -> str:
    """The servers' environment: `$GPUPOOL_SERVER_ENV`, the root install's, else the hub's own."""
    configured = os.environ.get("GPUPOOL_SERVER_ENV")
    if configured:
        return configured
    if os.getuid() == 0 and (ROOT_SERVER_ENV / "bin" / "python").exists():
        return str(ROOT_SERVER_ENV)
    return sys.prefix


def root_servers_problem(server_env: str) -> str | None:
    """Why users' servers could not run as their users on this root hub (None: they can, or this is not root).

    Checked once when the platform starts, not per spawn: a root hub whose users' servers would fall back to
    running as root (and could read the hub's state, its admin-scoped CLI token among it) refuses to start
    unless told `--unsafe-single-user`.
    """
    if os.getuid() != 0:
        return None
    python = Path(server_env) / "bin" / "python"
    if not python.exists():
        return (f"there is no servers' environment at {server_env} (build it with `make install` as root, or "
                f"set GPUPOOL_SERVER_ENV), so users' servers could not run as their users")
    if not runnable_by_others(python):
        return (f"{os.path.realpath(python)} cannot be run by other users (is it under /root?), so users' "
                f"servers could not run as their users; build the servers' environment with `make install` as "
                f"root (/opt/gpupool/env)")
    return None


def ensure_system_user(name: str, teams: list[str], log, record: str | Path = DEFAULT_RECORD) -> Account:
    """Root mode: hub user `name` as gpupool's account `gp-NAME`, in gpupool's group of each of its teams.

    Team groups are made first; an account or group of those names gpupool did not create is an error
    (`IdentityConflict`), never adopted (see `gpupool.spawner.accounts`).
    """
    return ensure_account(name, teams, log, record)


def ensure_team_folder(root: Path, team: str, as_root: bool) -> Path:
    """A group-private folder for the team's shared data: setgid 2770, owned by the team's group, default ACLs.

    As root the folder belongs to gpupool's group of the team (`gpteam-TEAM`), which must exist already
    (`ensure_system_user` makes it), and its default ACLs make whatever a member adds inside readable and
    writable by the team.
    """
    folder = root / team
    folder.mkdir(parents=True, exist_ok=True)
    if as_root:
        gid = grp.getgrnam(unix_group(team)).gr_gid
        if not is_shared_with_group(folder, gid):
            share_with_group(folder, gid)
    else:
        os.chmod(folder, 0o2770)
    return folder


#: The comment above the line gpupool adds to a user's `~/.gitconfig` (once).
SAFE_INCLUDE_NOTE = "# gpupool: your teams' dataset registries as safe.directory (for dvc get/import)"


def include_in_git_config(home: Path, include: Path) -> None:
    """Make `~/.gitconfig` include `include` (once), run as the user: libgit2 reads safe.directory only there.

    Called in the server's preexec after it became the user, so a symlink the user planted can only lead to
    the user's own files; a failure leaves the config as it was and the server starts anyway.
    """
    config = home / ".gitconfig"
    line = f"\tpath = {include}\n"
    try:
        text = config.read_text() if config.exists() else ""
        if line not in text:
            with open(config, "a") as out:
                out.write(("" if not text or text.endswith("\n") else "\n") + f"{SAFE_INCLUDE_NOTE}\n[include]\n{line}")
    except (OSError, UnicodeDecodeError):
        pass


def write_server_datasets(folder: Path, setup: ServerDatasets, owner: tuple[int, int] | None) -> dict[str, str]:
    """Write a server's DVC config and credentials into its private `folder`; the environment pointing there.

    The folder is made anew at every start (policy or membership may have changed) and is 0700, owned by
    the server's user: it is DVC's *global* config, outside any repository, so no `git add` can take it.
    Removing it first means nothing the user left in it (a symlink to a system file) is written through.
    The user may rename and replace anything inside a folder of theirs (another of their servers runs), so
    everything is given to them while it is still root's, through its descriptor or without following a link,
    and the folder itself last: no owner change ever follows a link they planted (to `/etc/shadow`, say).
    """
    if folder.is_symlink():
        folder.unlink()
    elif folder.exists():
        shutil.rmtree(folder)  # does not follow symlinks
    folder.mkdir(mode=0o700)
    os.chmod(folder, 0o700)
    dvc = folder / "dvc"
    dvc.mkdir()
    files = {dvc / "config": setup.dvc_config, folder / "gitconfig": setup.git_config}
    env = {"DVC_GLOBAL_CONFIG_DIR": str(dvc), "GIT_CONFIG_SYSTEM": str(folder / "gitconfig")}
    credentials = folder / "aws-credentials"
    if setup.credentials:
        files[credentials] = setup.credentials
        env["AWS_SHARED_CREDENTIALS_FILE"] = str(credentials)
    for path, text in files.items():
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(text)
            os.fchmod(descriptor, 0o600)
            if owner is not None:
                os.fchown(descriptor, *owner)
    if owner is not None:
        for path in (dvc, folder):
            os.chown(path, *owner, follow_symlinks=False)
    return env


#: The system's PATH for servers that run as their users (the hub's own PATH may name folders only root reads).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def server_env_paths(server_env: str, home: str, hub_path: str, run_as: str) -> dict[str, str]:
    """PATH and the users' own packages of a server: the platform's tools first, then the user's, then the system's.

    `pip install --user` and `%pip install` go to `PYTHONUSERBASE` in the home (the environment is not
    writable by users), persist there across restarts, and come after the platform's packages on `sys.path`
    (the environment's `platform_first` hook), so nothing a user installs can break the server.
    """
    user_base = str(Path(home) / ".local") if home else ""
    system = SYSTEM_PATH if run_as == "user" else hub_path
    path = [str(Path(server_env) / "bin"), *([str(Path(user_base) / "bin")] if user_base else []), system]
    env = {
        "PATH": ":".join(p for p in path if p),
        # DVC's anonymous usage analytics (and its banner on `dvc init`) off: a private platform never phones home.
        "DVC_NO_ANALYTICS": "1",
    }
    if user_base:
        env["PYTHONUSERBASE"] = user_base
    return env


class LocalGPUSpawner(GPUPoolSpawnerMixin, LocalProcessSpawner):
    """Runs each server as a local process holding a share of one of this machine's GPUs."""

    state_dir = Unicode(
        help="""
        Where the pool keeps its allocations (`allocations.sqlite`), MPS pipes and, when not run as root,
        the users' home folders.

            c.LocalGPUSpawner.state_dir = "/var/lib/gpupool"
        """,
    ).tag(config=True)

    @default("state_dir")
    def _default_state_dir(self):
        return str(defaults.state_dir())

    server_env = Unicode(
        help="""
        The Python environment every server runs from: its `jupyterhub-singleuser` is the server, its Python
        the default kernel, and its `bin` comes first on the server's PATH (`python`, `pip`, `dvc`, `mlflow`,
        `papermill`, `gpupool` in a terminal or a notebook's `!`). For servers that run as their users it must
        be readable by every user and writable by none (`make install` builds `/opt/gpupool/env` as root).
        Default: `$GPUPOOL_SERVER_ENV`, else `/opt/gpupool/env` when the hub runs as root and it exists,
        else the hub's own environment.

            c.LocalGPUSpawner.server_env = "/opt/gpupool/env"
        """,
    ).tag(config=True)

    @default("server_env")
    def _default_server_env(self):
        return default_server_env()

    images_dir = Unicode(
        help="""
        Where the images' environments are (`gpupool images build NAME` puts them there): a server or job whose
        image choice names `environment: finetune` runs from `IMAGES_DIR/finetune` instead of `server_env`.
        Default: `$GPUPOOL_IMAGES_DIR`, else `/opt/gpupool/images` when the hub runs as root, else
        `~/.local/share/gpupool/images`.
        """,
    ).tag(config=True)

    @default("images_dir")
    def _default_images_dir(self):
        return default_images_dir()

    @default("cmd")
    def _default_cmd(self):
        return [str(Path(self.server_env) / "bin" / "jupyterhub-singleuser")]

    def choice_environment(self, choice: Choice | None = None) -> str:
        """The environment a server or job of `choice` runs from: its image's, else `server_env`; an HTTP 409
        naming the command that builds it when the image's environment is not on this machine."""
        choice = choice or self.gpupool_choice
        if choice is None or choice.image is None:
            return self.server_env
        name = choice.profile.images[choice.image].environment
        prefix = image_prefix(self.images_dir, name, self.server_env)
        if prefix is None:
            raise web.HTTPError(409, f"The image {choice.profile.images[choice.image].display_name!r} is not "
                                     f"installed on this machine yet: an administrator runs `gpupool images build "
                                     f"{name}` (or `make images IMAGES={name}`)")
        return prefix

    run_as = Unicode(
        help="""
        `user`: each server runs as its hub user's own Unix account `gp-NAME` (created when missing), in
        gpupool's group `gpteam-TEAM` of each of its teams (needs root, and a `server_env` every user can
        run). `self`: every server runs as the user running the hub (a personal workstation; as root only with `gpupool up --unsafe-single-user`).
        Default: `user` when the hub runs as root, else `self`.

            c.LocalGPUSpawner.run_as = "self"
        """,
    ).tag(config=True)

    @default("run_as")
    def _default_run_as(self):
        if os.getuid() != 0:
            return "self"
        isolated = runnable_by_others(Path(self.server_env) / "bin" / "python")
        if not isolated and os.environ.get(UNSAFE_SINGLE_USER) == "1":
            # without the flag, gpupool up refused to start; with it, it said so loudly at start
            return "self"
        return "user"

    @default("ledger_url")
    def _default_ledger_url(self):
        return os.environ.get("GPUPOOL_LEDGER_URL") or defaults.ledger_url(self.state_dir)

    team_root = Unicode(
        help="""Folder holding one group-private (2770) folder per team for shared data. Default: `teams`
        beside the state folder when servers run as their users (`run_as = "user"`: they cannot enter the
        0700 state folder), else inside it; `gpupool up` sets it (`--team-root`).

            c.LocalGPUSpawner.team_root = "/srv/gpupool/teams"
        """,
    ).tag(config=True)

    @default("team_root")
    def _default_team_root(self):
        return str(defaults.team_root(self.state_dir, servers_run_as_users=self.run_as == "user"))

    identity_record = Unicode(
        DEFAULT_RECORD,
        help="""
        Root mode: the record of the Unix accounts (`gp-USER`) and groups (`gpteam-TEAM`) gpupool created,
        with their uids and gids. It lies outside the state folder on purpose: a reinstall with a new state
        folder finds it and gives every user the uid their files already belong to. An account or group of
        such a name that the record does not hold is refused, never adopted.

            c.LocalGPUSpawner.identity_record = "/var/lib/gpupool/identities.json"
        """,
    ).tag(config=True)

    server_config_root = Unicode(
        help="""
        Where each server's private DVC config, git config and dataset credentials are written, in
        `USER/SERVER` folders (0700, owned by the server's user, made anew at every start). Default:
        `/run/gpupool/servers` when servers run as their users (the state folder is private to the hub),
        else `servers` in the state folder.

            c.LocalGPUSpawner.server_config_root = "/run/gpupool/servers"
        """,
    ).tag(config=True)

    @default("server_config_root")
    def _default_server_config_root(self):
        return "/run/gpupool/servers" if self.run_as == "user" else str(Path(self.state_dir) / "servers")

    queue_service_token = Unicode(
        "",
        help="""
        A hub API token with the `servers` scope, with which the requests that waited in the queue when the
        hub stopped (or crashed) are started again, in their order, once it is back. `gpupool up` makes one
        for every start. Empty: such requests are given up, and their users told so on their home page.
        """,
    ).tag(config=True)

    allocation_key: str | None = None
    allocation_cards: tuple[str, ...] = ()
    #: The environment this spawn's server runs from (`choice_environment`), and the command start() made of it.
    run_env: str | None = None
    _image_cmd: list[str] | None = None
    pid_started: float | None = None

    @property
    def pool_key(self) -> str:
        return f"{self.user.name}/{self.name}"

    @property
    def pool(self) -> LocalPool:
        pool = get_pool(self.state_dir, lambda: self.policy, self.ledger, self.log)
        if pool.restoring and not getattr(pool, "requeue_started", False):
            pool.requeue_started = True
            if self.queue_service_token and self.hub is not None:
                asyncio.ensure_future(requeue(pool, self.hub.api_url, self.queue_service_token, self.log))
            else:
                for key in pool.restoring:
                    pool.store.mark_lost(key, "the hub restarted and gpupool has no token to queue it again")
                pool.restored()
        return pool

    # --- traits from the choice -----------------------------------------------------------------------

    def apply_choice(self, choice: Choice) -> None:
        profile = choice.profile
        if profile.memory.limit:
            self.mem_limit = int(parse_quantity(profile.memory.limit))  # bytes: 32Gi and 32G both exact
        if profile.cpu.limit:
            self.cpu_limit = float(parse_quantity(profile.cpu.limit))
        # Waiting in the queue must not count against start_timeout: a profile that can queue (one with a GPU
        # share) gets the queue timeout on top; one that never queues keeps the configured timeout.
        base = getattr(self, "_gpupool_base_start_timeout", None) or self.start_timeout
        self._gpupool_base_start_timeout = base
        self.start_timeout = self.queued_start_timeout(base, choice, can_queue=profile.gpu is not None)

    # --- users and folders ----------------------------------------------------------------------------

    @property
    def unix_account(self) -> str:
        """The Unix account this user's servers run as in root mode (gpupool's own, never a system account)."""
        return unix_user(self.user.name)

    def user_env(self, env):
        if self.run_as == "user":
            account = pwd.getpwnam(self.unix_account)
            env["USER"] = account.pw_name
            env["HOME"] = account.pw_dir
            env["SHELL"] = account.pw_shell or "/bin/bash"
            return env
        home = Path(self.state_dir) / "home" / self.user.name
        home.mkdir(parents=True, exist_ok=True)
        env["USER"] = self.user.name
        env["HOME"] = str(home)
        env["SHELL"] = "/bin/bash"
        return env

    def make_preexec_fn(self, name):
        if self.run_as == "user":
            become_user = super().make_preexec_fn(self.unix_account)  # not the hub name: never `postgres`

            safe, home = self.safe_directories_file, Path(pwd.getpwnam(self.unix_account).pw_dir)

            def preexec():
                become_user()
                include_in_git_config(home, safe)
                # Group-writable by default, so that teammates can add to what one member pushed into the
                # setgid team folder (DVC remote, registry); a home stays private: its group is the user's own.
                os.umask(0o007)

            return preexec
        home = Path(self.state_dir) / "home" / self.user.name

        def preexec():
            os.chdir(home)

        return preexec

    def get_args(self):
        args = super().get_args()
        # A private platform does not phone home: no JupyterLab news feed, no update check (their prompts are
        # off too, by the environment's JupyterLab settings overrides).
        args += ["--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        # Terminals start the user's shell interactive but not as a login shell (Jupyter's default under a
        # spawner), whose /etc/profile would reset PATH and hide the platform's python, pip, dvc and mlflow.
        shell = pwd.getpwnam(self.unix_account).pw_shell if self.run_as == "user" else ""
        args.append("--ServerApp.terminado_settings=" + json.dumps({"shell_command": [shell or "/bin/bash"]}))
        if self.run_as == "self" and os.getuid() == 0:
            args.append("--allow-root")
        return args

    # --- lifecycle ------------------------------------------------------------------------------------

    def get_env(self):
        env = super().get_env()
        env.update(server_env_paths(self.run_env or self.server_env, env.get("HOME", ""), env.get("PATH", ""),
                                    self.run_as))
        choice = self.gpupool_choice
        if choice is None:
            return env
        env.pop("CUDA_VISIBLE_DEVICES", None)
        share = profile_share(choice.profile, self.policy)
        if choice.profile.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.allocation_cards)
            if share < 1:
                memory = self.policy.models[choice.profile.gpu.model].memory_gib
                env.update(mps_env(self.state_dir, share, memory))
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU-only: no card is visible
        env.update(self.dataset_env())
        return env

    @property
    def safe_directories_file(self) -> Path:
        """The user's list of team registries as git safe directories (root's, readable), for libgit2."""
        return Path(self.server_config_root) / self.user.name / "safe-directories.gitconfig"

    @property
    def server_folder(self) -> Path:
        """Private per-server files (DVC's global config, credentials), outside the user's repositories."""
        return Path(self.server_config_root) / self.user.name / (f"named-{self.name}" if self.name else "default")

    def dataset_env(self, folder: Path | None = None) -> dict[str, str]:
        """The team remotes as DVC's user-level config, written for this server (or into `folder`, a training
        job's); its environment variables."""
        folder = folder or self.server_folder
        owner = None
        if self.run_as == "user":
            account = pwd.getpwnam(self.unix_account)
            owner = (account.pw_uid, account.pw_gid)
        parent = folder.parent
        parent.mkdir(parents=True, exist_ok=True)
        for above in (parent.parent, parent):  # the hub's: users pass through to their own folder, list nothing
            os.chmod(above, 0o711)
        setup = self.server_datasets(self.team_root)
        env = write_server_datasets(folder, setup, owner)
        if self.run_as == "user":
            # In the hub's folder that users pass through and cannot write: replaced whole, never written through.
            temporary = self.safe_directories_file.with_suffix(".new")
            temporary.unlink(missing_ok=True)
            temporary.write_text(setup.safe_directories)
            os.chmod(temporary, 0o644)
            os.replace(temporary, self.safe_directories_file)
        # For `gpupool datasets` in the server: the same team folders and policies as the hub's.
        env["GPUPOOL_TEAM_ROOT"] = self.team_root
        env["GPUPOOL_POLICIES"] = self.policy_dir
        return env

    async def profile_availability(self) -> Availability:
        """What a spawn of each profile the user may pick would do now: the pool's own pass of the queue
        (`LocalPool.preview`), through the same quota and budget decisions, on a copy of the cards' use."""
        teams = self.user_teams()
        if not teams:
            return Availability()
        policy = self.policy
        requests: dict[str, Request] = {}
        seen, candidates = self.availability_candidates(teams)
        for slug, profile, team in candidates:
            requests[slug] = Request(
                key=f"{self.pool_key}#availability-{slug}", user=self.user.name, team=team, profile=slug,
                display_name=profile.display_name, model=profile.gpu.model, share=profile_share(profile, policy),
                priority=policy.job_priority(team), holding="availability",
            )
        pool = self.pool
        outcomes = await asyncio.to_thread(pool.preview, list(requests.values())) if requests else {}
        words = {"place": "start", "wait": "wait", "deny": "refuse"}
        for slug, request in requests.items():
            outcome = outcomes[request.key]
            seen[slug] = ProfileAvailability(words[outcome.action], outcome.reason, str(outcome.code))
        waiting = [t.request.team for t in list(pool.waiting.values()) if not t.future.done()]
        return Availability(seen, len(waiting), sum(1 for team in waiting if team in teams))

    async def start(self):
        choice = self.ensure_choice()
        self.run_env = self.choice_environment(choice)
        if self.cmd in (self._default_cmd(), self._image_cmd):  # its environment's server, unless configured
            self._image_cmd = self.cmd = [str(Path(self.run_env) / "bin" / "jupyterhub-singleuser")]
        teams = self.user_teams()
        if self.run_as == "user":
            try:
                await asyncio.to_thread(ensure_system_user, self.user.name, teams, self.log, self.identity_record)
            except IdentityConflict as error:
                raise web.HTTPError(409, str(error)) from None
        for team in teams:
            ensure_team_folder(Path(self.team_root), team, self.run_as == "user")
        if choice.profile.gpu is not None:
            # The run's holding in the ledger, `reserved` once the pool places it and `running` once the server
            # runs (`open_usage`); ended unbilled if it never does (`_free`, or a cancel just as it was placed).
            run = self.new_usage_run(holds_gpu=True)
            request = Request(
                key=self.pool_key, user=self.user.name, team=choice.team, profile=choice.slug,
                display_name=choice.profile.display_name, model=choice.profile.gpu.model,
                share=profile_share(choice.profile, self.policy),
                priority=self.policy.job_priority(choice.team), holding=run,
            )
            queued = periods.utcnow()
            try:
                allocation = await self.pool.acquire(request, timeout=self.policy.queue_timeout(choice.team),
                                                     options=dict(self.user_options or {}))
            except Refused as error:
                self.close_usage(HowEnded.FAILED)
                raise refusal(str(error), error.code) from None
            except asyncio.CancelledError:
                self.close_usage(HowEnded.FAILED)
                # Stopped while waiting (the progress page's button, DELETE on the server). JupyterHub cleans up
                # after a failed start but not after a cancelled one: the server record it made for this spawn
                # would stay, making the server look ready (a redirect loop to a server that never ran).
                self.log.info("%s left the queue: its spawn was cancelled", self._log_name)
                self.server = None
                # Committed at once: the hub rolls back what is uncommitted when any request handler finishes.
                session = object_session(self.orm_spawner) if self.orm_spawner is not None else None
                if session is not None:
                    session.commit()
                raise
            queue_wait = max(timedelta(0), periods.utcnow() - queued)
            self.allocation_key, self.allocation_cards = allocation.key, allocation.cards
            if self.policy.settings.mps == "auto" and self.pool.devices_are_real:
                ensure_mps_daemon(self.state_dir, self.log)
        try:
            ip_port = await super().start()
        except BaseException:
            self._free()
            raise
        self.pid_started = process_start_time(self.pid)
        if self.allocation_key:
            watch_exit(self.pid, exit_record(self.state_dir, self.pid, self.pid_started))  # it is billed
            self.pool.store.mark_running(self.allocation_key, self.pid)
            self.open_usage(queue_wait)
        return ip_port

    async def waits_in_queue(self) -> str:
        """The queue's message ("Waiting for …: position 1 of 1 …"), once this spawn waits in the pool's queue (a
        pass gave it a place or a reason), so that the hub's REST answer need not wait longer
        (`gpupool.hub.spawn_api`); never while it does not (placed at once, refused, or a profile without a GPU
        share: the hub waits for the spawn itself then)."""
        # Looked at, not awaited on the ticket's `changed`: that event is the progress stream's to clear.
        while not ((ticket := self.pool.ticket(self.pool_key)) is not None and ticket.news):
            await asyncio.sleep(0.05)
        return ticket.message()

    async def progress(self):
        yield {"progress": 5, "message": "Checking the profile against your teams' quotas and the pool"}
        shown = None
        while True:
            ticket = self.pool.ticket(self.pool_key)
            if ticket is None:
                break
            ticket.changed.clear()
            message = ticket.message()
            if ticket.news and message != shown:  # a position or reason that did not change is not news
                shown = message
                # `reason`: the wait's code (admission.Reason), for scripts reading the progress stream
                yield {"progress": 10, "message": message, **({"reason": str(ticket.code)} if ticket.code else {})}
            try:
                await asyncio.wait_for(ticket.changed.wait(), 5)
            except TimeoutError:
                pass
        if self.allocation_cards:
            yield {"progress": 50, "message": f"Got {self.gpupool_choice.profile.display_name} on "
                                              f"{', '.join(self.allocation_cards)}; starting JupyterLab"}

    async def poll(self):
        if not self.pid:
            # Nothing started. A spawn of this hub cancelled in the queue is stopped here (the hub polls as it
            # stops): it does not come back after a restart. One from before a restart waits to be asked again.
            self.pool.forget(self.pool_key)
            return await super().poll()
        if self.proc is None and not process_alive(self.pid, self.pid_started):
            # Adopted after a hub restart, so no Popen to ask: JupyterHub's own `kill(pid, 0)` would take a zombie
            # or a reused PID for the server. The exit status is unknown then: 0, as JupyterHub says.
            # Its exit watcher knows when it ended, though no one heard it: the hub was down.
            ended = read_exit_record(exit_record(self.state_dir, self.pid, self.pid_started))
            self.log.warning("%s (PID %s) is gone%s; freeing its share", self._log_name, self.pid,
                             f" (ended {ended:%Y-%m-%d %H:%M:%S} UTC)" if ended else "")
            self.clear_state()
            if not self._stopping:
                self._free(HowEnded.FAILED, end=ended)
            return 0
        status = await super().poll()  # our child: Popen reaps it and gives its exit status
        if status is None:
            self.see_usage()
        elif not self._stopping:
            # Ended on its own: JupyterHub does not call stop() for a server that is already gone.
            self._free(HowEnded.FAILED)
        return status

    #: True while stop() ends the server, so that the process ending then is booked as stopped, not failed.
    _stopping = False

    async def stop(self, now=False):
        # Polled first: a server that already died is booked as failed when it was last seen; a running one is
        # seen alive as the stop begins, so a slow shutdown is not mistaken for a vanished server.
        await self.poll()
        self._stopping = True
        try:
            await super().stop(now=now)
        finally:
            self._stopping = False
            self._free(HowEnded.STOPPED)

    def _free(self, how: HowEnded = HowEnded.FAILED, end: datetime | None = None) -> None:
        """Give the share back and close the server's usage interval (both idempotent).

        `end`: when it ended, if known; else now, or for one that died unseen when it was last seen alive.
        """
        self.close_usage(how, at_last_seen=how is HowEnded.FAILED and end is None, end=end)
        self.pool.release(self.pool_key)
        self.allocation_key, self.allocation_cards = None, ()

    # --- state across hub restarts ---------------------------------------------------------------------

    def get_state(self):
        state = super().get_state()
        if self.pid_started:
            state["pid_started"] = self.pid_started
        if self.allocation_key:
            state["allocation"] = {"key": self.allocation_key, "cards": list(self.allocation_cards)}
        return state

    def load_state(self, state):
        super().load_state(state)
        self.pid_started = state.get("pid_started")
        allocation = state.get("allocation")
        if allocation:
            self.allocation_key, self.allocation_cards = allocation["key"], tuple(allocation["cards"])

    def clear_state(self):
        super().clear_state()
        self.pid_started = None  # the share and the usage interval are given back by _free(), not here
