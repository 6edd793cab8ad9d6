"""`gpupool datasets`: a team's dataset registry (DVC's data-registry pattern): a git repository tied to the
team remote, where each dataset version is a tag `NAME@VERSION`; `team_datasets` lists them for the hub pages.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

import yaml

from gpupool.policies import DEFAULT_POLICY_DIR, Policy, PolicyError, defaults, load_policy
from gpupool.spawner.datasets import REGISTRY_FOLDER, Remote, check_inside_root, team_remote

DATASET_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
VERSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
#: What a DVC config must never hold inside a repository: keys that carry or point to credentials.
CREDENTIAL_OPTIONS = frozenset({
    "access_key_id", "secret_access_key", "session_token", "profile", "credentialpath", "configpath",
    "password", "ask_password", "key_file", "gdrive_client_secret", "sas_token", "account_key",
    "connection_string",
})


class DatasetError(ValueError):
    """A refused dataset operation; the message says what was wrong and what is accepted."""


# --- the pure core: .dvc files, tags, versions -------------------------------------------------------------


@dataclass(frozen=True)
class Version:
    """One version of a dataset: a tag of the registry, with what its `.dvc` file records."""

    version: str
    rev: str
    commit: str
    date: str
    size: int | None
    files: int | None
    md5: str


@dataclass(frozen=True)
class Dataset:
    name: str
    versions: tuple[Version, ...]


@dataclass(frozen=True)
class Listing:
    """A registry's datasets, and the versions refused (with why) instead of listed."""

    datasets: tuple[Dataset, ...]
    problems: tuple[str, ...] = ()

    def as_json(self) -> dict:
        return {"datasets": [asdict(d) for d in self.datasets], "problems": list(self.problems)}


def dataset_output(text: str, name: str) -> dict:
    """The single output of `NAME.dvc`, checked: it must be the dataset's own folder inside the repository."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise DatasetError(f"{name}.dvc is not valid YAML: {error}") from None
    outs = data.get("outs") if isinstance(data, dict) else None
    if not isinstance(outs, list) or len(outs) != 1 or not isinstance(outs[0], dict):
        raise DatasetError(f"{name}.dvc must have exactly one output (`outs:` with one entry)")
    out = outs[0]
    path = out.get("path")
    if not isinstance(path, str) or not path:
        raise DatasetError(f"{name}.dvc has an output without a path")
    pure = PurePosixPath(path.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or ":" in path:
        raise DatasetError(
            f"{name}.dvc has output {path!r}, which escapes the repository (accepted: {name!r}, the dataset's "
            "folder inside the repository)"
        )
    if str(pure) != name:
        raise DatasetError(f"{name}.dvc has output {path!r} (accepted: {name!r}, the dataset's own folder)")
    if not isinstance(out.get("md5"), str):
        raise DatasetError(f"{name}.dvc has no md5 for {path!r}: was it written by `dvc add`?")
    return out


def split_tag(tag: str) -> tuple[str, str] | None:
    """`cats@v1` → ("cats", "v1"); None for tags that are not dataset versions."""
    name, at, version = tag.partition("@")
    if at and DATASET_NAME.fullmatch(name) and VERSION_NAME.fullmatch(version):
        return name, version
    return None


def collect_datasets(tags: Iterable[tuple[str, str, str]], read: Callable[[str, str], str | None],
                     only: str | None = None) -> Listing:
    """Datasets from `(tag, commit, date)` triples; `read(rev, path)` gives a file's text at a revision."""
    found: dict[str, list[Version]] = {}
    problems: list[str] = []
    for tag, commit, date in tags:
        parts = split_tag(tag)
        if parts is None or (only is not None and parts[0] != only):
            continue
        name, version = parts
        text = read(tag, f"{name}.dvc")
        if text is None:
            problems.append(f"tag {tag}: no {name}.dvc at that revision")
            continue
        try:
            out = dataset_output(text, name)
        except DatasetError as error:
            problems.append(f"tag {tag}: {error}")
            continue
        size, files = out.get("size"), out.get("nfiles")
        found.setdefault(name, []).append(Version(
            version, tag, commit, date, size if isinstance(size, int) else None,
            files if isinstance(files, int) else (1 if not str(out["md5"]).endswith(".dir") else None),
            str(out["md5"]),
        ))
    datasets = tuple(Dataset(name, tuple(sorted(versions, key=lambda v: (v.date, v.version))))
                     for name, versions in sorted(found.items()))
    return Listing(datasets, tuple(problems))


def repository_config_problems(config: dict, root: str) -> list[str]:
    """What is wrong with a repository's `.dvc/config` (parsed): credentials in it, remotes outside `root`."""
    problems = []
    for section, options in config.items():
        if not isinstance(options, dict):
            continue
        for key in options:
            if key in CREDENTIAL_OPTIONS:
                problems.append(f"[{section}] {key}: credentials belong in the server's environment, never in "
                                "a repository's .dvc/config")
        if section.startswith("remote ") and "url" in options:
            try:
                check_inside_root(str(options["url"]), root)
            except ValueError as error:
                problems.append(f"[{section}] {error}")
    return problems


def human_size(size: int | None) -> str:
    if size is None:
        return "?"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(size)


def listing_table(listing: Listing) -> str:
    rows = [("DATASET", "VERSION", "SIZE", "FILES", "DATE", "REV")]
    for dataset in listing.datasets:
        for v in dataset.versions:
            rows.append((dataset.name, v.version, human_size(v.size), "?" if v.files is None else str(v.files),
                         v.date, v.commit[:10]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows) + "\n"


# --- the edges: git, dvc, the team folder ------------------------------------------------------------------


@dataclass
class Registry:
    """A team's registry: where it is, the team, the team remote it is tied to."""

    path: Path
    remote: Remote
    progress: Callable[[str], None] = field(default=lambda message: print(message, file=sys.stderr, flush=True))

    def run(self, *command: str, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, check=False)
        if check and result.returncode != 0:
            raise DatasetError(f"`{' '.join(command)}` failed:\n{result.stderr.strip() or result.stdout.strip()}")
        return result

    def git(self, *args: str, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
        # The registry is shared by the team and owned by whoever made it: git refuses a repository another
        # account owns ("dubious ownership"), root included (the Datasets tab, an admin's CLI). The registry
        # is the team's by construction, so it is safe for this one command (command-line configuration is
        # protected configuration, which git reads safe.directory from).
        return self.run("git", "-c", f"safe.directory={self.path}", *_identity(), *args, cwd=cwd, check=check)

    def dvc(self, *args: str, cwd: Path) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-m", "dvc", *args, cwd=cwd)

    # ---- reading ----

    def exists(self) -> bool:
        return (self.path / "HEAD").is_file()

    def require(self) -> None:
        if not self.exists():
            raise DatasetError(f"no dataset registry at {self.path}: create it with "
                               f"`gpupool datasets init --team {self.remote.team}`")

    def listing(self, only: str | None = None) -> Listing:
        self.require()
        refs = self.git("-C", str(self.path), "for-each-ref", "refs/tags",
                        "--format=%(refname:short)%09%(*objectname)%(objectname)%09%(creatordate:iso-strict)")
        tags = []
        for line in refs.stdout.splitlines():
            tag, objects, date = line.split("\t")
            tags.append((tag, objects[:40], date))

        def read(rev: str, path: str) -> str | None:
            shown = self.git("-C", str(self.path), "show", f"{rev}:{path}", check=False)
            return shown.stdout if shown.returncode == 0 else None

        listing = collect_datasets(tags, read, only)
        if only is not None and not listing.datasets and not listing.problems:
            names = sorted({p[0] for t, _, _ in tags if (p := split_tag(t))})
            raise DatasetError(f"no dataset {only!r} in {self.path} (datasets: {', '.join(names) or 'none yet'})")
        return listing

    # ---- writing ----

    def init(self) -> None:
        """The bare registry repository, its first commit tied to the team remote (URL only, no credentials)."""
        check_inside_root(self.remote.url, self.remote.root)
        if self.exists():
            raise DatasetError(f"{self.path} is already a dataset registry; list it with `gpupool datasets list`")
        if self.path.exists() and any(self.path.iterdir()):
            raise DatasetError(f"{self.path} exists and is not empty; choose another --registry")
        self.progress(f"creating the registry {self.path}")
        self.git("init", "--quiet", "--bare", "--shared=group", "--initial-branch=main", str(self.path))
        with tempfile.TemporaryDirectory(prefix="gpupool-registry-") as work:
            clone = Path(work) / "registry"
            self.git("clone", "--quiet", str(self.path), str(clone))
            self.progress("dvc init")
            self.dvc("init", "--quiet", cwd=clone)
            self.dvc("remote", "add", "--default", self.remote.team, self.remote.url, cwd=clone)
            (clone / "README.md").write_text(
                f"# Datasets of team {self.remote.team}\n\nEach version is a tag `NAME@VERSION`. Get one with\n\n"
                f"    dvc import {self.path} NAME --rev NAME@VERSION\n\nList them with `gpupool datasets list`.\n"
            )
            self.check_clone(clone)
            self.git("-C", str(clone), "add", "--all")
            self.git("-C", str(clone), "commit", "--quiet", "-m", f"Dataset registry of team {self.remote.team}")
            self.git("-C", str(clone), "push", "--quiet", "origin", "HEAD:main")

    def check_clone(self, clone: Path) -> None:
        """Refuse to commit a `.dvc/config` with credentials or a remote outside the team root."""
        from configobj import ConfigObj

        config_file = clone / ".dvc" / "config"
        config = ConfigObj(str(config_file)) if config_file.exists() else {}
        problems = repository_config_problems(dict(config), self.remote.root)
        if problems:
            raise DatasetError(f"{self.path}: .dvc/config refused:\n  " + "\n  ".join(problems))

    def add(self, name: str, source: Path, version: str, message: str | None = None) -> Version:
        """Copy `source` into the registry as dataset `name`, push its data to the team remote, tag it."""
        if not DATASET_NAME.fullmatch(name):
            raise DatasetError(f"dataset name {name!r} refused (accepted: lower-case letters, digits, '.', '_', '-', "
                               "starting with a letter or digit, at most 63 characters)")
        if not VERSION_NAME.fullmatch(version):
            raise DatasetError(f"version {version!r} refused (accepted: letters, digits, '.', '_', '-', e.g. v1)")
        check_source(source)
        self.require()
        tag = f"{name}@{version}"
        if self.git("-C", str(self.path), "rev-parse", "--verify", "--quiet", f"refs/tags/{tag}",
                    check=False).returncode == 0:
            raise DatasetError(f"{tag} exists already; versions are immutable, choose a new version")
        with tempfile.TemporaryDirectory(prefix="gpupool-registry-") as work:
            clone = Path(work) / "registry"
            self.progress(f"[1/4] cloning {self.path}")
            self.git("clone", "--quiet", str(self.path), str(clone))
            self.check_clone(clone)
            target = clone / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            self.progress(f"[2/4] copying {source} into {name}/")
            if source.is_dir():
                shutil.copytree(source, target, symlinks=True)
            else:
                target.mkdir()
                shutil.copy2(source, target / source.name)
            self.progress(f"[3/4] dvc add {name} (hashing)")
            self.dvc("add", "--quiet", name, cwd=clone)
            output = dataset_output((clone / f"{name}.dvc").read_text(), name)
            self.progress(f"[4/4] dvc push to {self.remote.url} ({human_size(output.get('size'))})")
            self.dvc("push", "--quiet", cwd=clone)
            self.check_clone(clone)
            self.git("-C", str(clone), "add", f"{name}.dvc", ".gitignore")
            self.git("-C", str(clone), "commit", "--quiet", "--allow-empty", "-m", message or f"{name} {version}")
            self.git("-C", str(clone), "tag", "-a", "-m", message or f"{name} {version}", tag)
            self.git("-C", str(clone), "push", "--quiet", "origin", "HEAD", f"refs/tags/{tag}")
        listing = self.listing(name)
        return next(v for d in listing.datasets for v in d.versions if v.rev == tag)


def check_source(source: Path) -> None:
    """A dataset's source must be a real file or folder: a symlinked directory would leave the repository."""
    if not source.exists() and not source.is_symlink():
        raise DatasetError(f"{source} does not exist")
    if source.is_symlink():
        raise DatasetError(f"{source} is a symbolic link; give the folder it points to "
                           f"({os.path.realpath(source)}) or a copy of it")
    for top, dirs, files in os.walk(source):
        for entry in [*dirs, *files]:
            path = Path(top) / entry
            if path.is_symlink():
                kind = "directory" if path.is_dir() else "file"
                raise DatasetError(f"{path} is a symlinked {kind} inside the dataset; DVC would follow it out of "
                                   "the dataset (accepted: regular files and folders only)")


def _identity() -> list[str]:
    """A commit author when git has none configured (servers run as their hub user)."""
    configured = subprocess.run(["git", "config", "user.email"], capture_output=True, text=True, check=False)
    if configured.returncode == 0 and configured.stdout.strip():
        return []
    user = os.environ.get("USER") or os.environ.get("JUPYTERHUB_USER") or "gpupool"
    return ["-c", f"user.name={user}", "-c", f"user.email={user}@gpupool.invalid"]


def team_registry(policy: Policy, team: str, team_root: str | Path, registry: str | Path | None = None,
                  remote_url: str | None = None) -> Registry:
    """The registry of `team` (default: `datasets.git` in the team folder) tied to its remote."""
    if team not in policy.teams:
        raise DatasetError(f"unknown team {team!r} (teams: {', '.join(policy.teams) or 'none'})")
    team_root = os.path.abspath(team_root)
    remote = team_remote(policy, team, team_root)
    if remote_url is not None:
        if "://" not in remote_url:
            remote_url = os.path.abspath(remote_url)
        try:
            check_inside_root(remote_url, remote.root)
        except ValueError as error:
            raise DatasetError(str(error)) from None
        remote = Remote(remote.team, remote.root, remote_url, remote.endpoint_url, remote.region)
    path = Path(registry) if registry else Path(team_root) / team / REGISTRY_FOLDER
    return Registry(path.absolute(), remote)


def team_datasets(policy: Policy, team: str, team_root: str | Path) -> Listing:
    """A team's datasets and their versions (for the hub's "Datasets" tab); empty when it has no registry."""
    registry = team_registry(policy, team, team_root)
    return registry.listing() if registry.exists() else Listing(())


def ensure_team_storage(policy: Policy, registry: Registry, team_root: str | Path) -> None:
    """Folder storage: the team folder (group-private, 2770) and the remote folder inside it."""
    from gpupool.policies.identity import unix_group
    from gpupool.spawner.local import ensure_team_folder

    team = registry.remote.team
    if not (Path(team_root) / team).is_dir():  # a member's server finds it made (and owned) by the hub
        ensure_team_folder(Path(team_root), team, os.geteuid() == 0 and _group_exists(unix_group(team)))
    remote = Path(registry.remote.url)
    if policy.datasets.storage == "folder" and not remote.is_dir():
        remote.mkdir(parents=True)
        os.chmod(remote, 0o2770)  # every member pushes here; setgid keeps the team group on what they add


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


# --- the command ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="datasets_command", required=True, metavar="SUBCOMMAND")

    default_team_root = defaults.team_root(defaults.state_dir())

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--team", default=os.environ.get("GPUPOOL_TEAM"),
                         help="the team (default: $GPUPOOL_TEAM, the team of this server)")
        sub.add_argument("--team-root", default=os.environ.get("GPUPOOL_TEAM_ROOT") or str(default_team_root),
                         help="folder of the team folders (default: $GPUPOOL_TEAM_ROOT, else the platform's: "
                              f"{default_team_root})")
        sub.add_argument("--policies", default=os.environ.get("GPUPOOL_POLICIES"),
                         help="policy directory (default: $GPUPOOL_POLICIES, else the shipped policies)")
        sub.add_argument("--registry", help="the registry repository (default: TEAM_ROOT/TEAM/datasets.git)")

    init = commands.add_parser("init", help="create the team's dataset registry, tied to the team remote")
    common(init)
    init.add_argument("--remote", help="the DVC remote URL, inside the team's root (default: from policy)")
    add = commands.add_parser("add", help="add a version of a dataset: copy, dvc add, dvc push, tag NAME@VERSION")
    common(add)
    add.add_argument("name", help="dataset name, e.g. cats")
    add.add_argument("path", type=Path, help="the file or folder holding this version's data")
    add.add_argument("--version", required=True, help="the version, e.g. v1 (the tag is NAME@VERSION)")
    add.add_argument("-m", "--message", help="what changed in this version")
    listing = commands.add_parser("list", help="the team's datasets and their versions")
    common(listing)
    listing.add_argument("name", nargs="?", help="only this dataset")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        if not args.team:
            raise DatasetError("which team? give --team TEAM (in a user server $GPUPOOL_TEAM says it)")
        policy = load_policy(args.policies or DEFAULT_POLICY_DIR)
        registry = team_registry(policy, args.team, args.team_root, args.registry, getattr(args, "remote", None))
        if args.datasets_command == "init":
            ensure_team_storage(policy, registry, args.team_root)
            registry.init()
            print(f"Registry of team {args.team}: {registry.path} (remote {registry.remote.url})\n"
                  f"Add a version: gpupool datasets add NAME PATH --version v1\n"
                  f"Use one:       dvc import {registry.path} NAME --rev NAME@v1")
        elif args.datasets_command == "add":
            version = registry.add(args.name, args.path, args.version, args.message)
            print(f"{args.name}@{version.version}: {human_size(version.size)}, commit {version.commit[:10]}\n"
                  f"Use it: dvc import {registry.path} {args.name} --rev {version.rev}")
        else:
            result = registry.listing(args.name)
            print(json.dumps(result.as_json(), indent=2) if args.json else listing_table(result), end="")
            if args.json:
                print()
            for problem in result.problems:
                print(f"gpupool datasets: refused {problem}", file=sys.stderr)
            return 1 if result.problems else 0
    except PolicyError as error:
        print(error.report(args.policies or DEFAULT_POLICY_DIR, "nothing was changed"), file=sys.stderr)
        return 1
    except (DatasetError, OSError) as error:
        print(f"gpupool datasets: {error}", file=sys.stderr)
        return 1
    return 0
