"""The `gpupool` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpupool.hub import __version__


def _policy_check(args: argparse.Namespace) -> int:
    from gpupool.policies import DEFAULT_POLICY_DIR, PolicyError, load_policy

    directory = args.directory or DEFAULT_POLICY_DIR
    try:
        policy = load_policy(directory)
    except PolicyError as error:
        for problem in error.problems:
            print(problem, file=sys.stderr)
        print(f"{len(error.problems)} problem(s) in {directory}; nothing was changed", file=sys.stderr)
        return 1
    print(f"OK {directory}: {policy.summary()}")
    return 0


def _policy_reference(args: argparse.Namespace) -> int:
    from gpupool.policies.reference import policy_reference

    print(policy_reference())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpupool", description="A shared, metered GPU pool behind JupyterHub.")
    parser.add_argument("--version", action="version", version=f"gpupool {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    policy = commands.add_parser("policy", help="check policy files")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")
    check = policy_commands.add_parser("check", help="validate a policy directory")
    check.add_argument("directory", nargs="?", help="policy directory (default: the policies shipped with gpupool)")
    check.set_defaults(func=_policy_check)
    reference = policy_commands.add_parser("reference", help="print the policy file reference (Markdown)")
    reference.set_defaults(func=_policy_reference)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
