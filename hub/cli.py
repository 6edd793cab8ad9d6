"""The `gpupool` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpupool.hub import __version__


def _policy_check(args: argparse.Namespace) -> int:
    """Check a policy directory: by default the one the running platform uses, whose hot reload refuses the
    same problems (and keeps its previous policy), else the policies shipped with gpupool."""
    from pathlib import Path

    from gpupool.policies import DEFAULT_POLICY_DIR, PolicyError, load_policy

    state, used = _running_policies()
    directory = Path(args.directory or used or DEFAULT_POLICY_DIR).resolve()
    in_force = used is not None and directory == used
    try:
        policy = load_policy(directory)
    except PolicyError as error:
        print(error.report(directory, f"the platform in {state} refuses this change and keeps its previous policy "
                                      "until the files are fixed" if in_force else "nothing was changed"),
              file=sys.stderr)
        return 1
    from gpupool.policies.engines import engine_named, refusals

    if found := refusals(policy):
        # Kubernetes mode only (the embedded mode has no engine): refused when the policy names its engine or
        # --kubernetes asks, else said (gpupool.policies.engines).
        refuse = getattr(args, "kubernetes", False) or engine_named(policy)
        if not refuse:  # the embedded mode's policy: one line
            print(f"note: {len(found)} profile{'s' if len(found) > 1 else ''} ({', '.join(r.profile for r in found)}) "
                  f"cannot work in the Kubernetes mode under settings.engine {policy.settings.engine!r}: "
                  "`gpupool policy check --kubernetes` says why", file=sys.stderr)
        for refusal in found if refuse else ():
            print(f"error: in the Kubernetes mode, {refusal}", file=sys.stderr)
        if refuse:
            print(f"{directory}: refused for the Kubernetes mode ({len(found)} profile"
                  f"{'s' if len(found) > 1 else ''} above); nothing was changed", file=sys.stderr)
            return 1
    if policy.settings.engine == "yunikorn":
        from gpupool.hub.render import engine_problems
        from gpupool.policies.engines import yunikorn_problems

        if problems := yunikorn_problems(policy):
            # What YuniKorn's own validator refuses in the queues `gpupool render` would write.
            for line in engine_problems(directory, problems):
                print(f"error: under settings.engine 'yunikorn', {line}", file=sys.stderr)
            print(f"{directory}: refused for YuniKorn ({len(problems)} problem{'s' if len(problems) > 1 else ''} "
                  "above); nothing was changed", file=sys.stderr)
            return 1
    print(f"OK {directory}: {policy.summary()}" + (f" (in force on the platform in {state})" if in_force else ""))
    if in_force:
        from gpupool.hub.up import unlisted_roles

        for note in unlisted_roles(state, policy):
            print(f"note: {note}", file=sys.stderr)
    return 0


def _running_policies():
    """The state folder and the policy directory of the platform this account runs (`gpupool up`), or Nones."""
    import json
    from pathlib import Path

    from gpupool.hub.lifecycle import NoPlatform, find_state_dir

    try:
        state = find_state_dir(None)
        return state, Path(json.loads((state / "hub.json").read_text())["policies"]).resolve()
    except (NoPlatform, OSError, ValueError, KeyError):
        return None, None


def _policy_reference(args: argparse.Namespace) -> int:
    from gpupool.policies.reference import policy_reference

    print(policy_reference())
    return 0


def _up(args: argparse.Namespace) -> int:
    from gpupool.hub.up import up

    return up(args)


def _down(args: argparse.Namespace) -> int:
    from gpupool.hub.up import down

    return down(args)


def _team(args: argparse.Namespace) -> int:
    from gpupool.hub import up

    return getattr(up, "team_" + args.team_command.replace("-", "_"))(args)


def _platform(args: argparse.Namespace, command: str) -> tuple[dict, str] | None:
    """The platform's record (`hub.json`: its policies, its ledger) and its ledger's URL, for a command that reads
    the ledger: `--ledger`, else `--state-dir`'s, else the platform `gpupool up` last started. None (said on
    stderr) when there is none."""
    import json

    from gpupool.hub.lifecycle import NoPlatform, find_state_dir
    from gpupool.policies.defaults import ledger_url

    try:
        state = find_state_dir(args.state_dir, running=False) if args.state_dir or not args.ledger else None
    except NoPlatform as error:
        print(f"gpupool {command}: {error}, or --ledger", file=sys.stderr)
        return None
    hub = json.loads((state / "hub.json").read_text()) if state and (state / "hub.json").exists() else {}
    return hub, args.ledger or hub.get("ledger_url") or ledger_url(state)


def _bill(args: argparse.Namespace) -> int:
    from gpupool.hub.accounting.bills import bill_command
    from gpupool.policies import DEFAULT_POLICY_DIR, PolicyError, load_policy

    found = _platform(args, "bill")
    if found is None:
        return 1
    hub, ledger = found
    try:
        policy = load_policy(args.policies or hub.get("policies") or DEFAULT_POLICY_DIR)
        print(bill_command(ledger, policy, args.team, args.period, args.format), end="")
    except (PolicyError, ValueError) as error:
        print(f"gpupool bill: {error}", file=sys.stderr)
        return 1
    return 0


def _usage_export(args: argparse.Namespace) -> int:
    from gpupool.hub.accounting.export import usage_csv
    from gpupool.hub.accounting.ledger import Ledger

    found = _platform(args, "usage export")
    if found is None:
        return 1
    ledger = Ledger(found[1], migrate=False)
    try:
        text = usage_csv(ledger, args.period)
    except ValueError as error:
        print(f"gpupool usage export: {error}", file=sys.stderr)
        return 1
    finally:
        ledger.dispose()
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
        print(f"gpupool usage export: {text.count(chr(10)) - 1} runs of {args.period} in {args.output}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


STATE_HELP = ("state folder of the platform (default: the platform `gpupool up` started, recorded in "
              "~/.local/state/gpupool)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpupool", description="A shared, metered GPU pool behind JupyterHub.")
    parser.add_argument("--version", action="version", version=f"gpupool {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    policy = commands.add_parser("policy", help="check policy files")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")
    check = policy_commands.add_parser("check", help="validate a policy directory")
    check.add_argument("directory", nargs="?", help="policy directory (default: the running platform's, which refuses "
                                                    "an invalid change the same way; else the policies shipped with "
                                                    "gpupool)")
    check.add_argument("--kubernetes", action="store_true",
                       help="check for the Kubernetes mode: refuse a profile whose share backend the policy's "
                       "settings.engine cannot place (refused anyway when the policy names its engine)")
    check.set_defaults(func=_policy_check)
    reference = policy_commands.add_parser("reference", help="print the policy file reference (Markdown)")
    reference.set_defaults(func=_policy_reference)

    up = commands.add_parser("up", help="run the platform on this machine (embedded mode)")
    up.add_argument("--policies", help="policy directory (default: the policies shipped with gpupool)")
    # (the default, ./state, is gpupool.policies.defaults.STATE_DIR, filled in by `gpupool up`: this command
    # imports the policies only when a subcommand needs them)
    up.add_argument("--state-dir", help="where gpupool keeps its state (default: ./state)")
    up.add_argument("--ip", default="127.0.0.1", help="address of the public proxy (default: 127.0.0.1)")
    up.add_argument("--port", type=int, default=8000,
                    help="port of the public proxy; the hub uses PORT+1, the proxy API PORT+2 (default: 8000)")
    up.add_argument("--admin", default="admin", help="name of the first admin (default: admin)")
    up.add_argument("--admin-password-file",
                    help="file holding the first admin's password (default: generate one and print it once)")
    up.add_argument("--authenticator", default="native",
                    help="JupyterHub authenticator class (default: native, gpupool's NativeAuthenticator)")
    up.add_argument("--ledger-url",
                    help="usage ledger database (default: sqlite in the state folder; "
                         "production: postgresql+psycopg://USER@HOST/DB)")
    up.add_argument("--team-root",
                    help="folder of the teams' shared folders and dataset registries (default: teams/ in the state "
                         "folder; when servers run as their users, e.g. as root: a folder outside the state "
                         "folder, which only the hub may enter, such as /srv/gpupool/teams)")
    up.add_argument("--no-mlflow", action="store_true",
                    help="run without the MLflow service (servers then get no MLFLOW_* variables)")
    up.add_argument("--mlflow-backend-url",
                    help="MLflow's runs and model registry database (default: sqlite in the state folder; "
                         "production: postgresql+psycopg://USER@HOST/DB)")
    up.add_argument("--unsafe-single-user", action="store_true",
                    help="as root without a servers' environment every user can run: run users' servers as root "
                         "anyway (no isolation: any user can read the hub's state and become admin); without "
                         "this flag gpupool refuses to start then")
    up.add_argument("--unsafe-shared-as-user", action="store_true",
                    help="run by an ordinary Unix user, gpupool is a personal workstation: the admin alone logs in. "
                         "With this flag it serves several people anyway, with sign-ups (no isolation: every server "
                         "runs as that one Unix user, beside the hub's state; any user can read its secrets and "
                         "become admin). A hub shared by several people runs as root")
    up.add_argument("--verbose", action="store_true",
                    help="show the hub's log (its requests, the proxy's and the services' output) here; by default it "
                         "goes to hub.log in the state folder and the terminal shows only gpupool's own lines")
    up.set_defaults(func=_up)

    down = commands.add_parser(
        "down", help="stop the platform `gpupool up` runs (its hub, services and proxy); users' servers keep running")
    down.add_argument("--servers", action="store_true",
                      help="stop every user's server first (through the hub, as their Stop button does)")
    down.add_argument("--state-dir", help=STATE_HELP)
    down.set_defaults(func=_down)

    bill = commands.add_parser("bill", help="a team's bill for one month, from the usage ledger")
    bill.add_argument("--team", required=True)
    bill.add_argument("--period", required=True, help="the month, YYYY-MM (UTC)")
    bill.add_argument("--format", default="csv", choices=["csv", "html", "json"])
    bill.add_argument("--policies", help="policy directory with the prices (default: the platform's own)")
    bill.add_argument("--state-dir", help=STATE_HELP)
    bill.add_argument("--ledger", help="ledger database URL instead (e.g. postgresql+psycopg://…)")
    bill.set_defaults(func=_bill)

    usage = commands.add_parser("usage", help="the usage ledger's records")
    usage_commands = usage.add_subparsers(dest="usage_command", required=True, metavar="SUBCOMMAND")
    export = usage_commands.add_parser(
        "export", help="a month's runs (servers and jobs: arrival, start, end, who, on what) as CSV, a workload "
                       "`gpupool replay` reads back")
    export.add_argument("--period", required=True, help="the month, YYYY-MM (UTC)")
    export.add_argument("--output", "-o", metavar="FILE", help="write to FILE (default: standard output)")
    export.add_argument("--state-dir", help=STATE_HELP)
    export.add_argument("--ledger", help="ledger database URL instead (e.g. postgresql+psycopg://…)")
    export.set_defaults(func=_usage_export)

    team = commands.add_parser("team", help="manage team membership")
    team_commands = team.add_subparsers(dest="team_command", required=True, metavar="SUBCOMMAND")
    add_member = team_commands.add_parser("add-member", help="add a hub user to a team (a JupyterHub group)")
    add_member.add_argument("team")
    add_member.add_argument("user")
    add_member.add_argument("--create", action="store_true",
                            help="create the hub user when there is none of that name (default: refuse)")
    remove_member = team_commands.add_parser("remove-member", help="remove a hub user from a team")
    remove_member.add_argument("team")
    remove_member.add_argument("user")
    team_list = team_commands.add_parser("list", help="every team and its members")
    for command in (add_member, remove_member, team_list):
        command.add_argument("--state-dir", help=STATE_HELP)
        command.set_defaults(func=_team)

    from gpupool.hub import datasets as datasets_command  # argparse only at import, like render

    datasets = commands.add_parser("datasets", help="the team's dataset registry: init, add, list (DVC)")
    datasets_command.add_arguments(datasets)

    from gpupool.hub import jobs as jobs_command  # argparse and requests only at import

    jobs = commands.add_parser("jobs", help="training jobs: submit, list, show, logs, cancel")
    jobs_command.add_arguments(jobs)

    from gpupool.hub import images as images_command

    images = commands.add_parser("images", help="the images' environments on this machine: list, build")
    images_command.add_arguments(images)

    from gpupool.hub import templates_command

    templates = commands.add_parser("templates", help="fine-tuning templates: list, new")
    templates_command.add_arguments(templates)

    from gpupool.hub import render as render_command  # argparse only at import; the work is imported in main

    render = commands.add_parser("render", help="print the Kubernetes objects gpupool owns, made from policies")
    render_command.add_arguments(render)
    render.set_defaults(func=render_command.main)

    from gpupool.hub import replay as replay_command  # argparse only at import, like render

    replay = commands.add_parser("replay", help="replay a workload through the policies on a virtual clock")
    replay_command.add_arguments(replay)
    replay.set_defaults(func=replay_command.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
