"""`gpupool up` (run the embedded platform), `gpupool down` (stop it) and `gpupool team …` (through the hub's
REST API)."""

from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import select
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import psutil

from gpupool.hub import lifecycle
from gpupool.hub.config import UNSAFE_SHARED_AS_USER, personal_workstation
from gpupool.policies import DEFAULT_POLICY_DIR, PolicyError, defaults, load_policy
from gpupool.spawner.local import UNSAFE_SINGLE_USER

CONFIG_FILE = Path(__file__).with_name("jupyterhub_config.py")


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def prepare_state(state: Path, password_file: str | None) -> str | None:
    """Create the state folder, the CLI service token and the first admin; the new password, if one was made."""
    state.mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    if not (state / "cli-token").exists():
        _write_private(state / "cli-token", secrets.token_hex(32).encode())
    hash_file = state / "admin.bcrypt"
    if hash_file.exists() and not password_file:
        return None
    password = Path(password_file).read_text().strip() if password_file else secrets.token_urlsafe(15)
    if len(password) < 10:
        raise SystemExit(f"the admin password in {password_file} is shorter than 10 characters")
    _write_private(hash_file, bcrypt.hashpw(password.encode(), bcrypt.gensalt()))
    return None if password_file else password


def up(args: argparse.Namespace) -> int:
    policy_dir = Path(args.policies) if args.policies else DEFAULT_POLICY_DIR
    try:
        policy = load_policy(policy_dir)
    except PolicyError as error:
        print(error, file=sys.stderr)
        print(f"gpupool up: the policies in {policy_dir} are invalid; fix them (gpupool policy check)", file=sys.stderr)
        return 1
    # Whether users' servers can run as their users is checked by jupyterhub_config.py at start, once the extra
    # config files are read too: it refuses to start without this flag when they would run as root.
    unsafe = getattr(args, "unsafe_single_user", False)
    shared_as_user = getattr(args, "unsafe_shared_as_user", False)
    if shared_as_user and os.geteuid() == 0:
        print("gpupool up: --unsafe-shared-as-user is for a hub run by an ordinary Unix user; run as root, the hub is "
              "shared safely already (each server runs as its own user): leave the flag out", file=sys.stderr)
        return 2
    state = Path(args.state_dir or defaults.STATE_DIR).resolve()
    state.mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    try:
        lock = lifecycle.lock_state(state)
    except lifecycle.StateLocked as error:
        print(f"gpupool up: {error}", file=sys.stderr)
        return 1
    stale = lifecycle.stop_stale_services(state)
    if stale:
        print(f"gpupool: stopped {len(stale)} service process(es) an earlier run on {state} left running: "
              + "; ".join(stale), flush=True)
    # The proxy's own ports are left out: JupyterHub replaces a proxy an earlier run left (state/proxy.pid).
    offsets = defaults.PORT_OFFSETS
    wanted = {args.port + offsets["hub"]: "the hub", args.port + offsets["accounting"]: "the accounting service",
              args.port + offsets["jobs"]: "the jobs service", args.port + offsets["culler"]: "the idle culler"}
    if not getattr(args, "no_mlflow", False):
        wanted[args.port + offsets["mlflow"]] = "MLflow"
    taken = lifecycle.ports_in_use(wanted)
    if taken:
        which = f"port {taken[0]} is" if len(taken) == 1 else f"ports {', '.join(taken)} are"
        print(f"gpupool up: {which} in use by another program; stop it, or choose another "
              f"--port (gpupool uses PORT to PORT+{max(defaults.PORT_OFFSETS.values())})", file=sys.stderr)
        return 1
    password = prepare_state(state, args.admin_password_file)
    url = f"http://{args.ip}:{args.port}/"
    ledger_url = args.ledger_url or defaults.ledger_url(state)
    me = psutil.Process()  # `gpupool-hub` (JupyterHub) replaces this process: same PID, same start time
    running = {"url": url, "pid": me.pid, "started": me.create_time()}
    lifecycle.write_json(state / "hub.json", {**running, "admin": args.admin, "policies": str(policy_dir.resolve()),
                                               "ledger_url": ledger_url})
    try:
        lifecycle.write_platform_record(state, running)
    except OSError as error:  # a read-only home: the CLI then needs --state-dir
        print(f"gpupool: cannot record the running platform for the gpupool command ({error})", file=sys.stderr)
    print(f"gpupool: {policy.summary()} from {policy_dir}; state in {state}")
    print("gpupool: starting the hub, its proxy and services; the login line follows when the hub answers",
          flush=True)
    login = f"gpupool: open {url} and log in as {args.admin!r}"
    if password:
        login += (f" with the password {password}\n         (shown only this once; only its hash is kept in "
                  f"{state / 'admin.bcrypt'})")
    else:
        login += " with the admin password set on first start"
    login += who_logs_in(args.admin, shared_as_user)
    env = {
        **os.environ,
        "GPUPOOL_STATE_DIR": str(state),
        "GPUPOOL_POLICIES": str(policy_dir.resolve()),
        "GPUPOOL_IP": args.ip,
        "GPUPOOL_PORT": str(args.port),
        "GPUPOOL_ADMIN": args.admin,
        "GPUPOOL_AUTHENTICATOR": args.authenticator,
        "GPUPOOL_LEDGER_URL": ledger_url,
        "GPUPOOL_MLFLOW_BACKEND_URL": getattr(args, "mlflow_backend_url", None) or "",
        "GPUPOOL_MLFLOW": "0" if getattr(args, "no_mlflow", False) else "1",
        "GPUPOOL_TEAM_ROOT": str(Path(args.team_root).resolve()) if getattr(args, "team_root", None) else "",
        UNSAFE_SINGLE_USER: "1" if unsafe else "",
        UNSAFE_SHARED_AS_USER: "1" if shared_as_user else "",
    }
    # JupyterHub with gpupool's share rule in front of its share routes (gpupool.hub.app).
    jupyterhub = Path(sys.executable).parent / "gpupool-hub"
    # The hub's own log (its requests, the proxy's routes, the services' output: hundreds of lines at each
    # start) goes to a file unless asked for: the terminal keeps what the admin acts on.
    log = None if getattr(args, "verbose", False) else state / "hub.log"
    login += (f"\ngpupool: the hub's log is in {log} (`gpupool up --verbose` shows it here)" if log else "")
    login += ("\ngpupool: to stop: Ctrl-C here, or `gpupool down` from any folder; users' servers keep running "
              "(the next `gpupool up` takes them back), `gpupool down --servers` stops them too")
    announce_when_ready(url, login, lock, log)
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.chdir(state)
    # JupyterHub takes over this process (its PID is the one `gpupool up` was started as, and it keeps the
    # state lock); the services it starts are supervised (gpupool.hub.lifecycle) and die with it.
    os.execve(str(jupyterhub), [str(jupyterhub), "-f", str(CONFIG_FILE)], env)


def who_logs_in(admin: str, shared_as_user: bool) -> str:
    """The start-up banner's line on who logs in: on a personal workstation (an ordinary Unix user without
    `--unsafe-shared-as-user`) the admin alone, else people who sign up (the hub itself warns at every start
    when an ordinary user shares it anyway)."""
    if personal_workstation({UNSAFE_SHARED_AS_USER: "1" if shared_as_user else ""}):
        return (f"\ngpupool: a personal workstation: the hub and every server run as the Unix user "
                f"{pwd.getpwuid(os.geteuid()).pw_name}, so {admin!r} alone logs in (no sign-up, no other user); put "
                f"yourself in a team with `gpupool team add-member TEAM {admin}`. A hub shared by several people runs "
                f"as root (README: Running as root or not)")
    return ("\ngpupool: users sign up on the login page; the admin approves them at /hub/authorize and adds them "
            "to a team with `gpupool team add-member TEAM USER` or on the admin page (groups)")


def announce_when_ready(url: str, text: str, lock: int, log: Path | None = None) -> None:
    """Print `text` once the hub answers at `url` through its proxy, from a helper process that ends with the hub.

    Until the hub has started its services and registered its routes, the proxy answers 404: a login line
    printed before that sends people to an error page. The helper is forked twice and its first fork reaped
    here, so the hub (which this process becomes) is left no child to reap; it watches the hub through a
    pidfd, which is readable once the hub has exited.

    With the hub's output going to `log`, the helper shows on the terminal what gpupool itself says there while
    the hub starts (its warnings and refusals, lines beginning with `gpupool`), and, should the hub end before
    it answers, the end of its log.
    """
    start = log.stat().st_size if log is not None and log.exists() else 0
    hub = os.pidfd_open(os.getpid())
    middle = os.fork()
    if middle:
        os.close(hub)
        os.waitpid(middle, 0)
        return
    try:
        if os.fork():
            return  # the middle process: its exit re-parents the helper away from the hub
        os.close(lock)  # the lock belongs to the hub alone
        relayed = start
        while not select.select([hub], [], [], 0)[0]:
            relayed = _relay_gpupool_lines(log, relayed)
            try:
                with urllib.request.urlopen(url.rstrip("/") + "/hub/api/", timeout=5) as response:
                    if response.status == 200:
                        print(text, flush=True)
                        return
            except (OSError, ValueError):
                pass
            select.select([hub], [], [], 0.5)
        if log is not None:
            _relay_gpupool_lines(log, relayed)
            lines = log.read_bytes()[start:].decode(errors="replace").splitlines()[-25:]
            print(f"gpupool: the hub ended before it answered; the end of its log ({log}):", *lines, sep="\n",
                  file=sys.stderr, flush=True)
    finally:
        os._exit(0)


def _relay_gpupool_lines(log: Path | None, offset: int) -> int:
    """Print the whole lines of `log` from `offset` that gpupool itself wrote; the offset after them."""
    if log is None:
        return offset
    try:
        with log.open("rb") as f:
            f.seek(offset)
            new = f.read()
    except OSError:
        return offset
    done = new.rfind(b"\n") + 1
    for line in new[:done].decode(errors="replace").splitlines():
        if line.startswith("gpupool"):
            print(line, flush=True)
    return offset + done


def hub_api(state: Path, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
    info = json.loads((state / "hub.json").read_text())
    token = (state / "cli-token").read_text().strip()
    request = urllib.request.Request(
        info["url"].rstrip("/") + "/hub/api" + path, method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read()
            return response.status, json.loads(text) if text else None
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, {"message": text.decode(errors="replace")}


def stop_every_server(state: Path, timeout: float = 300) -> list[str]:
    """Ask the hub to stop every user's server, named ones and waiting requests included, and wait until none is
    left; the servers stopped, as USER or USER/SERVER. Through the REST API, so that each stop is the hub's own
    (the ledger closes its interval, the pool gives its share back) as when its user presses Stop."""
    asked: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        # Asked again until none is left: the hub answers a page of users at a time (api_page_default_limit).
        status, users = hub_api(state, "GET", "/users?state=active")
        if status >= 400:
            raise RuntimeError(f"the hub refused to list the servers: {(users or {}).get('message') or status}")
        left = [(user["name"], name) for user in users or [] for name in user.get("servers") or {}]
        if not left:
            return asked
        for user, name in left:
            label = f"{user}/{name}" if name else user
            if label in asked:
                continue
            status, reply = hub_api(state, "DELETE", f"/users/{user}/servers/{name}" if name else f"/users/{user}/server")
            if status >= 400 and status != 404:  # 404: it ended meanwhile
                raise RuntimeError(f"the hub refused to stop {label}: {(reply or {}).get('message') or status}")
            asked.append(label)
        if time.monotonic() > deadline:
            raise RuntimeError(f"these servers did not stop within {timeout:.0f} s: "
                               + ", ".join(f"{u}/{n}" if n else u for u, n in left))
        time.sleep(0.5)


def down(args: argparse.Namespace) -> int:
    """`gpupool down`: stop the platform `gpupool up` runs (its hub, services and proxy); with --servers, first
    every user's server, which a stopped hub otherwise leaves running for the next `gpupool up` to re-adopt."""
    try:
        state = lifecycle.find_state_dir(args.state_dir, running=False)
    except lifecycle.NoPlatform as error:
        print(f"gpupool down: {error}", file=sys.stderr)
        return 1
    if not os.access(state, os.R_OK | os.X_OK):
        print(f"gpupool down: {state} is not this user's to read: run `gpupool down` as the user who started the "
              f"platform, or as root", file=sys.stderr)
        return 1
    hub = lifecycle.running_hub(state)
    if hub is None and args.servers:
        print(f"gpupool down: no hub runs on {state}, so no server can be stopped through it: start it "
              f"(`gpupool up --state-dir {state}`), then `gpupool down --servers`", file=sys.stderr)
    if hub is not None and args.servers:
        try:
            servers = stop_every_server(state)
        except (urllib.error.URLError, RuntimeError) as error:
            print(f"gpupool down: {getattr(error, 'reason', error)}; the platform still runs (retry, or stop the "
                  f"servers on the admin page)", file=sys.stderr)
            return 1
        print(f"gpupool down: stopped {len(servers)} server(s)" + (f": {', '.join(servers)}" if servers else ""))
    try:
        stopped = lifecycle.stop_platform(state)
    except psutil.AccessDenied:
        print(f"gpupool down: the platform on {state} runs as another user (pid {hub.pid if hub else '?'}): run "
              f"`gpupool down` as that user or as root", file=sys.stderr)
        return 1
    if not stopped:
        print(f"gpupool down: nothing of gpupool runs on {state}")
        return 0
    print(f"gpupool down: stopped {'; '.join(stopped)} of the platform on {state}")
    if hub is not None and not args.servers:
        print("gpupool down: users' servers and jobs keep running (the next `gpupool up` re-adopts them); "
              "`gpupool down --servers` stops them too")
    return 0


def platform_state(args: argparse.Namespace) -> Path | None:
    """The running platform's state folder (--state-dir, else the one `gpupool up` recorded); None after saying why."""
    try:
        state = lifecycle.find_state_dir(args.state_dir)
    except lifecycle.NoPlatform as error:
        print(f"gpupool: {error}", file=sys.stderr)
        return None
    if not (state / "hub.json").exists():
        print(f"no gpupool platform in {state} (start it with `gpupool up --state-dir {state}`)", file=sys.stderr)
        return None
    return state


def _team_call(args: argparse.Namespace, steps) -> int:
    """Run `steps(state)` (REST calls to the hub) and turn an unreachable hub into one clear line; say when the hub
    refuses its policy files as they are now (teams and their leads come from them too)."""
    state = platform_state(args)
    if state is None:
        return 1
    try:
        return steps(state)
    except urllib.error.URLError as error:
        print(f"the hub does not answer ({error.reason}); is `gpupool up` running?", file=sys.stderr)
        return 1
    finally:
        refused = policy_refusal(state)
        if refused:
            print(f"note: {refused}", file=sys.stderr)


def policy_refusal(state: Path) -> str | None:
    """Why the running platform refuses its policy files as they are now (it keeps its previous policy), or None."""
    policies = json.loads((state / "hub.json").read_text()).get("policies")
    try:
        if policies:
            load_policy(policies)
    except PolicyError as error:
        return error.report(policies, "the hub refused this change of its policies and keeps the previous one until "
                                      "the files are fixed (gpupool policy check)")
    return None


def unlisted_roles(state: Path, policy) -> list[str]:
    """The leads and reviewers `policy` names who are in neither their team's `members` nor its hub group: they
    have none of the role's rights until they join (a typo, or `gpupool team add-member` still to run)."""
    try:
        status, groups = hub_api(state, "GET", "/groups")
    except urllib.error.URLError:
        return []
    if status >= 400:
        return []
    in_group = {g["name"]: set(g.get("users") or []) for g in groups or []}
    return [f"teams.{name}.{role}: {user!r} is in neither the team's members nor its hub group, so has no "
            f"{role[:-1]}'s rights until added (gpupool team add-member {name} {user})"
            for name, team in policy.teams.items() for role in ("leads", "reviewers") for user in getattr(team, role)
            if user not in team.members and user not in in_group.get(name, set())]


def _team_or_error(state: Path, team: str) -> dict | None:
    status, group = hub_api(state, "GET", f"/groups/{team}")
    if status == 404 or (group or {}).get("properties", {}).get("gpupool.team") != "true":
        status, groups = hub_api(state, "GET", "/groups")
        known = sorted(g["name"] for g in groups or [] if g.get("properties", {}).get("gpupool.team") == "true")
        print(f"no team {team!r} on the hub (teams come from policies; known: {', '.join(known) or 'none'})",
              file=sys.stderr)
        return None
    return group


def _refused(status: int, reply: dict | None) -> bool:
    if status >= 400:
        print(f"the hub refused: {(reply or {}).get('message') or status}", file=sys.stderr)
        return True
    return False


def team_add_member(args: argparse.Namespace) -> int:
    def steps(state: Path) -> int:
        if _team_or_error(state, args.team) is None:
            return 1
        status, user = hub_api(state, "GET", f"/users/{args.user}")
        if status == 404:
            if not args.create:
                print(f"no user {args.user!r} on the hub: people sign up on the login page and are users once an "
                      f"admin approves them at /hub/authorize (a sign-up waiting there is not one yet); check the "
                      f"spelling (gpupool team list), or pass --create to create {args.user!r} now", file=sys.stderr)
                return 1
            status, user = hub_api(state, "POST", f"/users/{args.user}")
            if _refused(status, user):
                return 1
            print(f"created the hub user {user['name']}")
        elif _refused(status, user):
            return 1
        status, reply = hub_api(state, "POST", f"/groups/{args.team}/users", {"users": [user["name"]]})
        if _refused(status, reply):
            return 1
        print(f"{user['name']} is now a member of team {args.team}")
        return 0

    return _team_call(args, steps)


def team_remove_member(args: argparse.Namespace) -> int:
    def steps(state: Path) -> int:
        group = _team_or_error(state, args.team)
        if group is None:
            return 1
        if args.user not in group.get("users", []):
            print(f"{args.user!r} is not a member of team {args.team} (members: "
                  f"{', '.join(sorted(group.get('users', []))) or 'none'})", file=sys.stderr)
            return 1
        status, reply = hub_api(state, "DELETE", f"/groups/{args.team}/users", {"users": [args.user]})
        if _refused(status, reply):
            return 1
        print(f"{args.user} is no longer a member of team {args.team}")
        policies = json.loads((state / "hub.json").read_text()).get("policies")
        try:
            listed = args.user in load_policy(policies).teams[args.team].members if policies else False
        except (PolicyError, KeyError):
            listed = False
        if listed:
            print(f"note: the policies in {policies} list {args.user} as a member of {args.team}: remove them "
                  f"there too, or they are a member again when the hub restarts", file=sys.stderr)
        return 0

    return _team_call(args, steps)


def team_list(args: argparse.Namespace) -> int:
    def steps(state: Path) -> int:
        status, groups = hub_api(state, "GET", "/groups")
        if _refused(status, groups):
            return 1
        teams = sorted((g for g in groups or [] if g.get("properties", {}).get("gpupool.team") == "true"),
                       key=lambda g: g["name"])
        for team in teams:
            print(f"{team['name']}: {', '.join(sorted(team.get('users', []))) or '(no members)'}")
        return 0

    return _team_call(args, steps)
