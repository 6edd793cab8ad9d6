"""Each team's DVC remote and the user-level DVC config a server of the team gets (pure): no credential is
ever part of a DVC config; they come as an AWS profile per team (embedded) or from the team's Secret (Kubernetes).
"""

from __future__ import annotations

import configparser
import io
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from gpupool.policies.model import Policy, s3_root_parts

#: A team's dataset registry (a bare git repository) inside its team folder.
REGISTRY_FOLDER = "datasets.git"
#: Keys of a team's credentials, as they appear in an AWS shared credentials file and in the team's Secret.
CREDENTIAL_KEYS = ("aws_access_key_id", "aws_secret_access_key")


def profile_name(team: str) -> str:
    """The AWS profile holding a team's credentials."""
    return f"gpupool-{team}"


@dataclass(frozen=True)
class Remote:
    """A team's DVC remote: its root (folder or S3 prefix), the remote's URL below it, and how to reach it."""

    team: str
    root: str
    url: str
    endpoint_url: str | None = None
    region: str | None = None

    @property
    def is_s3(self) -> bool:
        return self.url.startswith("s3://")


def team_remote(policy: Policy, team: str, team_root: str) -> Remote:
    """The remote of `team`: below its folder in `team_root` (folder storage) or its S3 root."""
    settings = policy.teams[team].datasets
    if policy.datasets.storage == "s3":
        root = policy.dataset_s3_root(team)
        s3 = policy.datasets.s3
        return Remote(team, root, f"{root}/{settings.remote}", s3.endpoint_url, s3.region)
    root = posixpath.join(team_root, team)
    return Remote(team, root, posixpath.join(root, settings.remote))


def check_inside_root(url: str, root: str) -> None:
    """ValueError unless `url` is `root` or below it (an S3 prefix or a folder); names both."""
    if root.startswith("s3://"):
        if url.startswith("s3://"):
            bucket, prefix = s3_root_parts(url)
            root_bucket, root_prefix = s3_root_parts(root)
            if bucket == root_bucket and (not root_prefix or prefix == root_prefix
                                          or prefix.startswith(root_prefix + "/")):
                return
    elif "://" not in url and PurePosixPath(url).is_absolute():
        normal = posixpath.normpath(url)
        if normal == root or normal.startswith(root.rstrip("/") + "/"):
            return
    raise ValueError(f"remote {url!r} is outside the team's root {root} (accepted: {root} or a path below it)")


@dataclass(frozen=True)
class ServerDatasets:
    """What a server needs for its teams' remotes: a DVC config, an AWS credentials file, environment."""

    remotes: tuple[Remote, ...]
    default: str
    dvc_config: str
    credentials: str = ""
    env: dict[str, object] = field(default_factory=dict)
    git_config: str = ""
    safe_directories: str = ""


def git_config_text(registries: Sequence[str], user: str = "", email: str = "") -> str:
    """A git system config: the machine's own, the hub user as commit author, the team registries as safe.

    A registry belongs to whoever created it; git refuses any other owner's repository ("dubious ownership")
    unless it is listed in a protected config, and a repository's own config cannot list itself. The author
    comes before nothing else can set one, so `git commit` works in a new server ("Author identity
    unknown" otherwise); the user's own `~/.gitconfig` still wins, being read after the system config.
    """
    lines = ["[include]", "\tpath = /etc/gitconfig"]
    if user:
        lines += ["[user]", f"\tname = {user}", f"\temail = {email or user}"]
    lines += ["[safe]"] + [f"\tdirectory = {path}" for path in registries]
    return "\n".join(lines) + "\n"


def safe_directories_text(registries: Sequence[str]) -> str:
    """A git config listing only the team registries as safe directories, for the user's global config.

    libgit2 (what DVC opens a registry with in `dvc get` and `dvc import`) reads `safe.directory` from the
    user's global config only, never from `GIT_CONFIG_SYSTEM`; this file is what that config includes.
    """
    return "\n".join(["[safe]"] + [f"\tdirectory = {path}" for path in registries]) + "\n"


def dvc_config_text(remotes: Sequence[Remote], default: str, with_profiles: bool) -> str:
    """DVC's config file (INI as DVC writes it) naming each team's remote, `default` as `core.remote`."""
    from configobj import ConfigObj

    config = ConfigObj()
    config["core"] = {"remote": default}
    # Teammates share objects: DVC then makes cache and folder-remote files 0664 and folders 2775 (not
    # 0444 and umask-dependent), so what one member pushed, another can pull and add to.
    config["cache"] = {"shared": "group"}
    for remote in remotes:
        section: dict[str, str] = {"url": remote.url}
        if not remote.is_s3:
            section["shared"] = "group"
        if remote.is_s3:
            if remote.endpoint_url:
                section["endpointurl"] = remote.endpoint_url
            if remote.region:
                section["region"] = remote.region
            if with_profiles:
                section["profile"] = profile_name(remote.team)
        config[f'remote "{remote.team}"'] = section
    out = io.BytesIO()
    config.write(out)
    return out.getvalue().decode()


def credentials_text(remotes: Sequence[Remote], credentials: Mapping[str, Mapping[str, str]]) -> str:
    """An AWS shared credentials file with one profile per S3 remote whose team has credentials."""
    parser = configparser.ConfigParser(interpolation=None)
    for remote in remotes:
        given = credentials.get(remote.team)
        if remote.is_s3 and given:
            parser[profile_name(remote.team)] = {key: given[key] for key in CREDENTIAL_KEYS if key in given}
    out = io.StringIO()
    parser.write(out)
    return out.getvalue()


def server_datasets(policy: Policy, teams: Sequence[str], default: str, team_root: str, *,
                    credentials: Mapping[str, Mapping[str, str]] | None = None,
                    secret_name: str | None = None, git_user: str = "", git_email: str = "") -> ServerDatasets:
    """The remotes of a server charged to `default` whose user is in `teams`.

    Embedded (`credentials` given, from the admin's credentials file): every team of the user is a remote,
    each S3 remote with its team's AWS profile. Kubernetes (`secret_name`, a pattern with `{team}`): the
    default team's credentials come from its Secret as environment variables, the pod holds no other
    team's keys, so only the default team's remote is configured. `git_user` and `git_email` are the commit
    author of the embedded server's git config.
    """
    names = [default] if secret_name is not None else [default, *[t for t in teams if t != default]]
    remotes = tuple(team_remote(policy, team, team_root) for team in names)
    env: dict[str, object] = {}
    if secret_name is not None:
        if remotes[0].is_s3:
            secret = secret_name.format(team=default)
            env = {key.upper(): {"valueFrom": {"secretKeyRef": {"name": secret, "key": key.upper()}}}
                   for key in CREDENTIAL_KEYS}
        return ServerDatasets(remotes, default, dvc_config_text(remotes, default, with_profiles=False), "", env)
    registries = [posixpath.join(team_root, remote.team, REGISTRY_FOLDER) for remote in remotes]
    return ServerDatasets(remotes, default, dvc_config_text(remotes, default, with_profiles=True),
                          credentials_text(remotes, credentials or {}), env,
                          git_config_text(registries, git_user, git_email), safe_directories_text(registries))


def read_credentials_file(text: str) -> dict[str, dict[str, str]]:
    """Teams' credentials from an AWS shared credentials file with `[gpupool-<team>]` profiles."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(text)
    prefix = profile_name("")
    return {section[len(prefix):]: dict(parser[section]) for section in parser.sections()
            if section.startswith(prefix)}


#: Kubernetes mode, folder storage: where the pods mount the teams' shared folders (an admin-provided volume).
KUBE_TEAM_ROOT = "/srv/gpupool/teams"
#: Kubernetes mode: DVC's global config dir inside the pod, written at start from `GPUPOOL_DVC_CONFIG`.
KUBE_DVC_CONFIG_DIR = "/tmp/gpupool-dvc"
#: The pod's postStart hook: DVC reads its config from a file, the pod gets the text as an env variable.
KUBE_POST_START = ["sh", "-c", 'mkdir -p "$DVC_GLOBAL_CONFIG_DIR" && printf "%s" "$GPUPOOL_DVC_CONFIG" '
                               '> "$DVC_GLOBAL_CONFIG_DIR/config"']


def kube_env(setup: ServerDatasets) -> dict[str, object]:
    """A pod's environment for its team remote: the DVC config text, where to write it, the Secret's keys."""
    return {"DVC_GLOBAL_CONFIG_DIR": KUBE_DVC_CONFIG_DIR, "GPUPOOL_DVC_CONFIG": setup.dvc_config, **setup.env}
