"""`gpupool up` (run the embedded platform) and `gpupool team add-member` (through the hub's REST API)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt

from gpupool.policies import DEFAULT_POLICY_DIR, PolicyError, load_policy
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
    state = Path(args.state_dir).resolve()
    password = prepare_state(state, args.admin_password_file)
    url = f"http://{args.ip}:{args.port}/"
    (state / "hub.json").write_text(json.dumps({"url": url, "admin": args.admin}))
    print(f"gpupool: {policy.summary()} from {policy_dir}; state in {state}")
    print(f"gpupool: open {url} and log in as {args.admin!r}", end="")
    if password:
        print(f" with the password {password}\n         (shown only this once; only its hash is kept in {state / 'admin.bcrypt'})")
    else:
        print(" with the admin password set on first start")
    print("gpupool: users sign up on the login page; the admin approves them at /hub/authorize and adds them to a "
          "team with `gpupool team add-member TEAM USER` or on the admin page (groups)", flush=True)
    env = {
        **os.environ,
        "GPUPOOL_STATE_DIR": str(state),
        "GPUPOOL_POLICIES": str(policy_dir.resolve()),
        "GPUPOOL_IP": args.ip,
        "GPUPOOL_PORT": str(args.port),
        "GPUPOOL_ADMIN": args.admin,
        "GPUPOOL_AUTHENTICATOR": args.authenticator,
        "GPUPOOL_LEDGER_URL": args.ledger_url or f"sqlite:///{state / 'ledger.sqlite'}",
        "GPUPOOL_MLFLOW_BACKEND_URL": getattr(args, "mlflow_backend_url", None) or "",
        "GPUPOOL_MLFLOW": "0" if getattr(args, "no_mlflow", False) else "1",
        "GPUPOOL_TEAM_ROOT": str(Path(args.team_root).resolve()) if getattr(args, "team_root", None) else "",
        UNSAFE_SINGLE_USER: "1" if unsafe else "",
    }
    jupyterhub = Path(sys.executable).parent / "jupyterhub"
    os.chdir(state)
    os.execve(str(jupyterhub), [str(jupyterhub), "-f", str(CONFIG_FILE)], env)


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


def team_add_member(args: argparse.Namespace) -> int:
    state = Path(args.state_dir).resolve()
    if not (state / "hub.json").exists():
        print(f"no running gpupool in {state} (start it with `make up`, or pass --state-dir)", file=sys.stderr)
        return 1
    try:
        status, _ = hub_api(state, "GET", f"/users/{args.user}")
        if status == 404:
            status, reply = hub_api(state, "POST", f"/users/{args.user}")
            if status >= 400:
                print(f"cannot create user {args.user}: {reply}", file=sys.stderr)
                return 1
        status, reply = hub_api(state, "POST", f"/groups/{args.team}/users", {"users": [args.user]})
    except urllib.error.URLError as error:
        print(f"the hub does not answer ({error.reason}); is `gpupool up` running?", file=sys.stderr)
        return 1
    if status == 404:
        print(f"no team {args.team!r} on the hub (teams come from policies)", file=sys.stderr)
        return 1
    if status >= 400:
        print(f"the hub refused: {reply.get('message') if reply else status}", file=sys.stderr)
        return 1
    print(f"{args.user} is now a member of team {args.team}")
    return 0
