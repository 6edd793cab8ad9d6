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
import shutil
import sys
from pathlib import Path

from gpupool.images import TEMPLATES_DIR


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
    print(f"{args.name}: copied into {target}\n"
          f"  try it here:        cd {target} && python train.py\n"
          f"  as a training job:  cd {target} && gpupool jobs submit --profile PROFILE --image finetune -- "
          f"python train.py\n"
          f"  settings: {target / 'config.yaml'}; how it works: {target / 'README.md'}")
    return 0
