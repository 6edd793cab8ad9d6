"""`gpupool jobs`: submit, list, show, follow, suspend, resume and cancel training jobs through the jobs service's REST API.

Run in a server's terminal or a notebook (`!gpupool jobs …`), it needs nothing: the server's own hub token
(`$JUPYTERHUB_API_TOKEN`) and the hub's address (`$GPUPOOL_HUB_URL`) are in its environment. On the hub's machine,
as the account that runs it, it needs nothing either: like `gpupool team`, it finds the platform `gpupool up`
recorded and acts as its admin, with a token of the admin's that the `gpupool-cli` service makes for the one
command. Elsewhere, give `--url` (the hub, or the service itself) and `--token` (one from the hub's token page),
or set `$GPUPOOL_HUB_URL` and `$JUPYTERHUB_API_TOKEN`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import requests

#: Seconds between two reads of a followed log.
FOLLOW_S = 1.0
#: The life of the admin's token `gpupool jobs` makes on the hub's machine; it is deleted when the command ends,
#: and expires by itself should the command be killed (a followed log may outlive it: then the hub refuses it).
TOKEN_SECONDS = 24 * 3600
ENDED = ("succeeded", "failed", "cancelled")


class JobsError(RuntimeError):
    pass


class Client:
    def __init__(self, url: str, token: str, timeout: float = 30):
        self.url = url.rstrip("/") + "/"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {token}"
        self.timeout = timeout

    def call(self, method: str, path: str, **kwargs) -> requests.Response:
        try:
            reply = self.session.request(method, self.url + path, timeout=self.timeout, **kwargs)
        except requests.RequestException as error:
            raise JobsError(f"the jobs service at {self.url} did not answer: {error}") from None
        if reply.status_code >= 400:
            try:
                message = reply.json().get("message")
            except ValueError:
                message = None
            if reply.status_code in (401, 403) and not message:
                message = "the hub refused the token (make one on the hub's token page, or run this in a server)"
            raise JobsError(f"{reply.status_code}: {message or reply.reason}")
        return reply


def service_url(args: argparse.Namespace) -> str:
    if args.url:
        url = args.url.rstrip("/")
        return url + "/" if "/services/" in url else url + "/services/jobs/"
    if os.environ.get("GPUPOOL_JOBS_URL"):
        return os.environ["GPUPOOL_JOBS_URL"]
    hub = os.environ.get("GPUPOOL_HUB_URL") or os.environ.get("JUPYTERHUB_PUBLIC_HUB_URL", "").removesuffix("hub/")
    if not hub:
        raise JobsError("where is the hub? give --url https://HUB (or set GPUPOOL_HUB_URL); in a server it is set")
    return hub.rstrip("/") + "/services/jobs/"


def client(args: argparse.Namespace) -> Client:
    # A token of one's own (a server's, one given) always comes first: the platform's is only its admin's.
    token = args.token or os.environ.get("JUPYTERHUB_API_TOKEN") or os.environ.get("GPUPOOL_TOKEN")
    if token:
        return Client(service_url(args), token)
    found = None if args.url else _admin_on_the_hubs_machine(args)
    if found is None:
        raise JobsError("no hub token: give --token (make one on the hub's token page) or set JUPYTERHUB_API_TOKEN; "
                        "in a server it is set; on the hub's machine the account that runs `gpupool up` needs "
                        "none (it acts as the platform's admin)")
    return found


def _admin_on_the_hubs_machine(args: argparse.Namespace) -> Client | None:
    """The platform `gpupool up` recorded for this Unix account (or `--state-dir`'s), as its admin: a token of the
    admin's made for this command with the `gpupool-cli` service's token, readable only by the account that runs
    the hub (the state folder is 0700, the token 0600), so anyone else is told to use their own. None where this
    account started no platform."""
    import json
    import urllib.error

    from gpupool.hub import lifecycle
    from gpupool.hub.up import hub_api

    try:
        state = lifecycle.find_state_dir(args.state_dir)
    except lifecycle.NoPlatform as error:
        if args.state_dir or lifecycle.platforms():  # this account runs platforms: say which, or that none runs
            raise JobsError(f"{error}; or give --url and --token") from None
        return None
    try:
        hub = json.loads((state / "hub.json").read_text())
        (state / "cli-token").read_bytes()
    except PermissionError:
        raise JobsError(f"the platform in {state} is another account's: only the account that runs the hub acts as "
                        "its admin; use your own token: --token (make one on the hub's token page) and --url") from None
    except (OSError, ValueError):
        raise JobsError(f"no running gpupool platform in {state} (start it with `gpupool up --state-dir {state}`), "
                        "or give --url and --token") from None
    admin = hub.get("admin") or "admin"
    try:
        status, made = hub_api(state, "POST", f"/users/{admin}/tokens",
                               {"note": "gpupool jobs on the hub's machine", "expires_in": TOKEN_SECONDS,
                                # the jobs service as the admin, nothing else of the admin's (users, servers, tokens)
                                "scopes": ["access:services!service=jobs", "read:users!user"]})
    except urllib.error.URLError as error:
        raise JobsError(f"the hub at {hub.get('url')} does not answer ({error.reason}); is `gpupool up` "
                        "running?") from None
    if status != 201:
        raise JobsError(f"the hub would not make a token for its admin {admin!r}: "
                        f"{(made or {}).get('message') or status}")
    args.forget_token = lambda: hub_api(state, "DELETE", f"/users/{admin}/tokens/{made['id']}")
    return Client(hub["url"].rstrip("/") + "/services/jobs/", made["token"])


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise JobsError(f"--env {pair!r}: give NAME=VALUE")
        env[name] = value
    return env


def submit(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise JobsError("no command: gpupool jobs submit --profile P -- python train.py")
    body = {"profile": args.profile, "command": command, "env": _env_pairs(args.env or []),
            "workdir": os.path.abspath(args.workdir or os.getcwd())}
    for name in ("team", "max_restarts", "priority", "checkpoint_dir", "image"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.checkpoint_dir:
        body["checkpoint_dir"] = os.path.abspath(args.checkpoint_dir)
    if args.preemptible:
        body["preemptible"] = True
    headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
    job = client(args).call("POST", "api/jobs", json=body, headers=headers).json()
    if args.json:
        print(json.dumps(job, indent=2))
    else:
        where = f"checkpoints in {job['checkpoint_dir']}" if job["checkpoint_dir"] else "no checkpoint folder"
        print(f"job {job['id']} submitted: {job['state']}, team {job['team']}, {job['priority']} priority, {where}")
        print(f"follow it: gpupool jobs logs {job['id']} --follow")
    return 0


def _table(jobs: list[dict]) -> str:
    rows = [("JOB", "USER", "TEAM", "PROFILE", "STATE", "RESTARTS", "SUBMITTED (UTC)", "WHY")]
    for job in jobs:
        rows.append((job["id"], job["user"], job["team"], job["profile"], job["state"],
                     f"{job['restarts']}/{job['max_restarts']}", job["submitted_at"][:16].replace("T", " "),
                     job["reason"][:60]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def list_jobs(args: argparse.Namespace) -> int:
    jobs = client(args).call("GET", "api/jobs").json()["jobs"]
    print(json.dumps(jobs, indent=2) if args.json else (_table(jobs) if jobs else "no jobs"))
    return 0


def show(args: argparse.Namespace) -> int:
    job = client(args).call("GET", f"api/jobs/{args.job}").json()
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    print(f"job {job['id']} of {job['user']} (team {job['team']}): {job['state']}: {job['reason']}")
    print(f"  profile {job['profile']}, {job['priority']} priority{', preemptible' if job['preemptible'] else ''}")
    print(f"  command: {' '.join(job['command'])}")
    print(f"  checkpoints: {job['checkpoint_dir']}")
    print(f"  restarts: {job['restarts']} of {job['max_restarts']} counted; exit code: {job['exit_code']}")
    print(f"  GPU-hours so far: {job['gpu_hours']}, cost {job['cost']} {job['currency']}")
    for run in job["runs"]:
        print(f"  run {run['attempt']}: {run['started_at']} → {run['ended_at'] or 'running'}"
              f"{' ' + run['event'] if run['event'] else ''}"
              f"{'' if run['exit_code'] is None else ' (exit ' + str(run['exit_code']) + ')'}"
              f"{', counted' if run['counted'] else ''}{': ' + run['reason'] if run['reason'] else ''}")
    if job.get("log_tail"):
        print("  log (last lines):")
        print("\n".join("    " + line for line in job["log_tail"].splitlines()))
    return 0


def logs(args: argparse.Namespace) -> int:
    jobs, offset = client(args), 0
    # The service sends each progress bar at its last state; one still drawing at the log's end comes again,
    # redrawn ("\r" and its new state), as it moves on. A terminal redraws it in place; into a file or a pipe
    # only its last state goes, once its line has ended (or the log has).
    live, open_line = sys.stdout.isatty(), ""
    while True:
        reply = jobs.call("GET", f"api/jobs/{args.job}/log", params={"offset": offset})
        text = reply.content.decode("utf-8", "replace")
        if live:
            sys.stdout.write(text)
        else:
            if text.startswith("\r"):
                open_line, text = "", text[1:]
            open_line += text
            done, newline, open_line = open_line.rpartition("\n")
            sys.stdout.write(done + newline)
        sys.stdout.flush()
        read, offset = offset, int(reply.headers.get("X-Log-Offset", offset))
        if offset != read:
            continue  # more may be there already
        if not args.follow or reply.headers.get("X-Job-State") in ENDED:
            if open_line:
                print(open_line, flush=True)
            return 0
        time.sleep(FOLLOW_S)


def act(args: argparse.Namespace) -> int:
    """cancel, suspend or resume (`args.action`): the service answers with the job as it now stands."""
    job = client(args).call("POST", f"api/jobs/{args.job}/{args.action}").json()
    print(f"job {job['id']}: {job['state']}: {job['reason']}")
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        return args.jobs_func(args)
    except JobsError as error:
        print(f"gpupool jobs: {error}", file=sys.stderr)
        return 1
    finally:
        if getattr(args, "forget_token", None):
            try:
                args.forget_token()
            except OSError:
                pass  # it expires by itself


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="jobs_command", required=True, metavar="SUBCOMMAND")

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--url", help="the hub (or the jobs service) URL (default: $GPUPOOL_HUB_URL, set in servers)")
        sub.add_argument("--token", help="a hub API token (default: $JUPYTERHUB_API_TOKEN, set in servers; on the "
                                         "hub's machine, as the account that runs it: none, it acts as the admin)")
        sub.add_argument("--state-dir", help="on the hub's machine: the platform's state folder (default: the platform "
                                             "`gpupool up` started, recorded in ~/.local/state/gpupool)")

    sub = commands.add_parser("submit", help="submit a training job: gpupool jobs submit --profile P -- CMD ...")
    common(sub)
    sub.add_argument("--profile", required=True, help="a profile your team may use (as on the spawn page)")
    sub.add_argument("--team", help="the team it runs for (default: your team the profile is offered to)")
    sub.add_argument("--image", help="one of the profile's images, as on the spawn page (default: its default)")
    sub.add_argument("--max-restarts", type=int, help="failed runs restarted (default: the policy's)")
    sub.add_argument("--priority", choices=["low", "normal", "high"], help="within what your team may use")
    sub.add_argument("--preemptible", action="store_true", help="higher-priority work may preempt it")
    sub.add_argument("--checkpoint-dir", help="where gpupool.train keeps its checkpoints (default: a private "
                                              "folder of the job's in the team's storage)")
    sub.add_argument("--env", action="append", metavar="NAME=VALUE", help="an extra environment variable")
    sub.add_argument("--workdir", help="working directory (default: this one)")
    sub.add_argument("--idempotency-key", help="a retried submit with the same key makes no second job")
    sub.add_argument("--json", action="store_true", help="print the job as JSON")
    sub.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    sub.set_defaults(jobs_func=submit)

    sub = commands.add_parser("list", help="my jobs (and my teams' for their leads)")
    common(sub)
    sub.add_argument("--json", action="store_true")
    sub.set_defaults(jobs_func=list_jobs)

    sub = commands.add_parser("show", help="a job: state, why, runs and their causes, GPU-hours, cost, log tail")
    common(sub)
    sub.add_argument("job")
    sub.add_argument("--json", action="store_true")
    sub.set_defaults(jobs_func=show)

    sub = commands.add_parser("logs", help="a job's log (every run's output)")
    common(sub)
    sub.add_argument("job")
    sub.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    sub.set_defaults(jobs_func=logs)

    for action, words in (
            ("cancel", "cancel a job (a running one gets SIGTERM, then SIGKILL)"),
            ("suspend", "hold a job: a running one is stopped (SIGTERM, then SIGKILL) and waits; never a restart"),
            ("resume", "put a suspended job back in the queue at its place; it resumes from its last checkpoint")):
        sub = commands.add_parser(action, help=words)
        common(sub)
        sub.add_argument("job")
        sub.set_defaults(jobs_func=act, action=action)
    parser.set_defaults(func=main)
