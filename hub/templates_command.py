"""`gpupool templates`: fine-tuning templates, copied into a folder of yours to run, change and submit as a job.

    gpupool templates list
    gpupool templates new lora-sft ~/my-sft       # then: cd ~/my-sft && python train.py

A template is a folder: `train.py` (the whole program; its docstring says what it does), `config.yaml` (every
setting), a notebook that runs a few steps interactively, example data, a README. They run in the `finetune`
image (its environment in the embedded mode: `gpupool images build finetune`).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys
from pathlib import Path

from gpupool.images import TEMPLATES_DIR
from gpupool.policies import DEFAULT_POLICY_DIR, PolicyError, load_policy

#: The gpupool image the templates run in.
TEMPLATES_IMAGE = "finetune"


def template_names() -> list[str]:
    return sorted(p.parent.name for p in TEMPLATES_DIR.glob("*/train.py"))


def summary(name: str) -> str:
    """The first line of the template's train.py docstring."""
    doc = ast.get_docstring(ast.parse((TEMPLATES_DIR / name / "train.py").read_text())) or ""
    return doc.splitlines()[0] if doc else ""


def new(name: str, target: Path) -> Path:
    """Copy template `name` into `target` (made; refused if it exists and is not empty)."""
    if name not in template_names():
        raise ValueError(f"no template {name!r}: the templates are {', '.join(template_names())}")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"{target} exists and is not an empty folder: give a new folder")
    shutil.copytree(TEMPLATES_DIR / name, target, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "output"))
    return target


def submit_hint(policy_dir: str | os.PathLike, team: str | None, current: str | None) -> str:
    """How to submit a template as a job: the `gpupool jobs submit` line with a profile of `team` (any team when
    None) that offers the templates' image, `current` (the server's own profile) first, and a line naming the
    others that do; the way out when none does."""
    command = "gpupool jobs submit --profile {} --image {} -- python train.py"
    try:
        policy = load_policy(policy_dir)
    except (PolicyError, OSError):
        return command.format("PROFILE", TEMPLATES_IMAGE)
    profiles = policy.profiles_for_teams({team} if team else set(policy.teams))
    offering = {slug: key for slug, profile in profiles.items()
                for key, image in profile.images.items() if image.environment == TEMPLATES_IMAGE}
    if not offering:
        return (command.format("PROFILE", TEMPLATES_IMAGE) + f"\n  (no profile of {'team ' + team if team else 'any team'}"
                f" offers the {TEMPLATES_IMAGE} image yet: an administrator adds it to a profile's `images:` in the "
                "policy, see docs/finetune.md)")
    slug = current if current in offering else next(iter(offering))
    others = [s for s in offering if s != slug]
    return command.format(slug, offering[slug]) + (
        f"\n  (the other profiles with the {TEMPLATES_IMAGE} image: {', '.join(others)})" if others else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="templates_command", required=True, metavar="SUBCOMMAND")
    commands.add_parser("list", help="the fine-tuning templates")
    created = commands.add_parser("new", help="copy a template into a folder")
    created.add_argument("name", metavar="NAME")
    created.add_argument("folder", nargs="?", type=Path, metavar="DIR", help="default: ./NAME")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.templates_command == "list":
        for name in template_names():
            print(f"{name:<22} {summary(name)}")
        return 0
    target = (args.folder or Path(args.name)).expanduser().absolute()
    try:
        new(args.name, target)
    except ValueError as error:
        print(f"gpupool templates: {error}", file=sys.stderr)
        return 2
    hint = submit_hint(os.environ.get("GPUPOOL_POLICIES") or DEFAULT_POLICY_DIR, os.environ.get("GPUPOOL_TEAM"),
                       os.environ.get("GPUPOOL_PROFILE"))
    print(f"{args.name}: copied into {target}\n"
          f"  try it here:        cd {target} && python train.py\n"
          f"  as a training job:  cd {target} && {hint}\n"
          f"  settings: {target / 'config.yaml'}; how it works: {target / 'README.md'}")
    return 0
