"""A training run's data: a file beside the code, or a version of the team's dataset registry (DVC).

    source = dataset_source({"name": "arithmetic", "version": "v1", "file": "train.jsonl"}, workdir)
    mlflow.log_params(source.params)         # how to get exactly this data again
    rows = read_jsonl(source.path)

A version of the team's registry (`gpupool datasets add`; DVC's data-registry pattern: a git tag
`NAME@VERSION`) is fetched with `dvc get REGISTRY NAME --rev NAME@VERSION` into `workdir`, once; the run records
the registry, name, version, the resolved git commit and the `dvc import` line that brings the same files into
any DVC project. The registry is `$GPUPOOL_TEAM_ROOT/$GPUPOOL_TEAM/datasets.git` in gpupool's servers and jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


class DatasetUnavailable(RuntimeError):
    """The data could not be had; the message says which and why."""


@dataclass(frozen=True)
class DataSource:
    path: Path
    params: dict[str, str] = field(default_factory=dict)


def team_registry(environ: Mapping[str, str] = os.environ) -> str:
    root, team = environ.get("GPUPOOL_TEAM_ROOT"), environ.get("GPUPOOL_TEAM")
    if not root or not team:
        raise DatasetUnavailable("no team registry: GPUPOOL_TEAM_ROOT and GPUPOOL_TEAM are set in gpupool's "
                                 "servers and jobs; elsewhere give the dataset's registry")
    return str(Path(root) / team / "datasets.git")


def _git_commit(registry: str, tag: str) -> str:
    done = subprocess.run(["git", "ls-remote", registry, f"refs/tags/{tag}", f"refs/tags/{tag}^{{}}"],
                          capture_output=True, text=True, check=False)
    lines = [line.split() for line in done.stdout.splitlines() if line.strip()]
    peeled = [sha for sha, ref in lines if ref.endswith("^{}")]
    return (peeled or [sha for sha, _ in lines] or [""])[0]


def dataset_source(spec: Mapping[str, object], base: str | os.PathLike, workdir: str | os.PathLike) -> DataSource:
    """Where the data of a config's `dataset:` section is: `file` (relative to `base`, the config's folder)
    alone, or `file` inside version `version` of dataset `name` of `registry` (default: the team's)."""
    file = spec.get("file")
    name, version = spec.get("name"), spec.get("version")
    if not name:
        if not file:
            raise DatasetUnavailable("dataset: give file (a JSON-lines file), or name and version of a dataset "
                                     "of your team's registry (gpupool datasets list)")
        path = (Path(base) / str(file)).resolve()
        if not path.is_file():
            raise DatasetUnavailable(f"dataset file {path} is not there")
        return DataSource(path, {"dataset.file": str(file)})
    if not version:
        raise DatasetUnavailable(f"dataset {name!r}: give its version too (gpupool datasets list shows them)")
    registry = str(spec.get("registry") or team_registry())
    tag = f"{name}@{version}"
    target = Path(workdir) / "data" / tag
    if not target.exists():
        beside = Path(sys.executable).parent / "dvc"  # this environment's, when its bin is not on PATH
        dvc = shutil.which("dvc") or (str(beside) if beside.exists() else None)
        if dvc is None:
            raise DatasetUnavailable("the dvc command is not on PATH (gpupool's images and servers have it)")
        partial = target.with_name(f".{tag}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        print(f"gpupool: fetching dataset {tag} from {registry} (dvc get)", flush=True)
        done = subprocess.run([dvc, "get", registry, str(name), "--rev", tag, "-o", str(partial)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise DatasetUnavailable(f"dvc get {registry} {name} --rev {tag} failed: "
                                     f"{(done.stderr or done.stdout).strip()[-1500:]}")
        os.replace(partial, target)  # whole or not there: a fetch killed half-way is fetched again
    path = target / str(file) if file else target
    if not path.is_file():
        inside = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
        raise DatasetUnavailable(f"dataset {tag} has no file {file!r}" + (f"; it has {inside}" if inside else ""))
    return DataSource(path, {
        "dataset.registry": registry, "dataset.name": str(name), "dataset.version": str(version),
        "dataset.rev": tag, "dataset.commit": _git_commit(registry, tag), "dataset.file": str(file or ""),
        "dataset.import": f"dvc import {registry} {name} --rev {tag}",
    })


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON-lines file; a bad line is an error naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DatasetUnavailable(f"{path}:{number}: not JSON ({error.msg})") from None
    if not rows:
        raise DatasetUnavailable(f"{path} has no rows")
    return rows
