"""Who is who: the one rule for hub user names, and the Unix names gpupool gives users and teams (pure).

A name is normalised once (Unicode NFKC, then case folding) and must then match one pattern that is at the
same time a Unix account name (with gpupool's prefix), a Kubernetes label value and object name that
KubeSpawner keeps as it is, and a path segment. The authenticator (sign-up, REST API) and both spawners use
these functions, so a name cannot be one thing at the door and another on the machine or in the cluster.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

#: At most this many characters: `gp-` + name is then a 32-character Unix name, the longest useradd takes.
MAX_USERNAME = 29
#: Lower-case ASCII letters and digits, single hyphens between them, starting with a letter: a DNS label
#: (never `--`, which KubeSpawner reserves for its escaped names), a Unix name, a path segment.
USERNAME = re.compile(r"[a-z](?:-?[a-z0-9])*")
#: What the messages say is accepted.
USERNAME_RULE = (f"lower-case letters a-z, digits and single hyphens, starting with a letter and ending with a "
                 f"letter or digit, at most {MAX_USERNAME} characters, e.g. alice or ana-maria")

#: Prefixes of the Unix accounts and groups gpupool creates: no existing account (root, postgres, www-data)
#: and no team's group can ever be a hub user's, whatever the user is called.
USER_PREFIX = "gp-"
TEAM_PREFIX = "gpteam-"
#: The longest Unix user or group name useradd and groupadd accept.
MAX_UNIX_NAME = 32

#: Names nobody may sign up as, beside the teams and the machine's system accounts: they read as the
#: platform, an administrator or a system account in the hub's pages, logs and bills.
RESERVED_USERNAMES = frozenset({
    "root", "admin", "administrator", "admins", "adm", "sudo", "wheel", "staff", "operator", "daemon", "bin",
    "sys", "sync", "games", "man", "lp", "mail", "news", "uucp", "proxy", "www-data", "backup", "list", "irc",
    "nobody", "nogroup", "postgres", "postgresql", "mysql", "systemd", "messagebus", "sshd", "hub",
    "jupyterhub", "jupyter", "gpupool", "mlflow", "accounting", "service", "services", "system", "user", "users",
    "api", "login", "logout", "signup", "health", "metrics", "all", "none", "default", "deprioritized", "kube",
    "kubernetes", "volcano",
})
#: Parts that make a name read as an administrator's anywhere in it (`sysadmin`, `root-shell`).
RESERVED_PARTS = ("admin", "root", "sudo", "gpupool", "jupyterhub")

#: Look-alikes folded together when comparing names (after separators are dropped): digits that read as
#: letters, letter pairs that read as one letter.
_LOOKALIKES = (("rn", "m"), ("vv", "w"), ("0", "o"), ("1", "l"), ("i", "l"), ("5", "s"))


def normalize_username(name: str) -> str:
    """The one form of a name: Unicode NFKC (full-width and ligature forms become plain letters), case folded."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())


def username_problem(name: str) -> str | None:
    """Why `name` (normalised) cannot be a user name, or None: the pattern and length only."""
    shown = name if len(name) <= 40 else name[:40] + "…"
    if not name:
        return f"a user name is required ({USERNAME_RULE})"
    if len(name) > MAX_USERNAME:
        return f"user name {shown!r} is longer than {MAX_USERNAME} characters ({USERNAME_RULE})"
    if not USERNAME.fullmatch(name):
        return f"user name {shown!r} is not accepted ({USERNAME_RULE})"
    return None


def server_username_problem(name: str, teams: Iterable[str]) -> str | None:
    """Why a server cannot start for user `name`, or None: the pattern, and no user named like a team.

    The spawners' check (both modes), for users made before the rule or by another authenticator: a
    server's name becomes a Unix account, a pod and label, and folder names, so it must pass the same rule.
    """
    problem = username_problem(name)
    if problem is None and name in set(teams):
        problem = f"user name {name!r} is a team's name"
    return problem


def skeleton(name: str) -> str:
    """What a name looks like to a reader: separators dropped and look-alike characters folded together."""
    folded = re.sub(r"[-_.]", "", normalize_username(name))
    for seen, same in _LOOKALIKES:
        folded = folded.replace(seen, same)
    return folded


def new_username_problem(name: str, existing: Iterable[str] = (), teams: Iterable[str] = (),
                         system_accounts: Iterable[str] = ()) -> str | None:
    """Why `name` (normalised) cannot be given to a new user, or None.

    Beside the pattern: an `existing` name itself (hub users and sign-ups, normalised: a new user never gets an
    account that exists), reserved names (`RESERVED_USERNAMES`, anything containing a `RESERVED_PARTS` word),
    the teams' names, the machine's system accounts, and any name that looks like an `existing` user's or a
    team's (same skeleton: `a-lice` beside `alice`, `v1sion` beside team `vision`).
    """
    problem = username_problem(name)
    if problem:
        return problem
    existing = set(existing)
    if name in existing:
        return (f"user name {name!r} is already in use (names are compared once normalised: case folded, Unicode "
                f"NFKC); choose another")
    teams, system_accounts = set(teams), set(system_accounts)
    if name in teams:
        return f"user name {name!r} is reserved: it is a team's name (teams: {', '.join(sorted(teams))})"
    if name in RESERVED_USERNAMES or name in system_accounts:
        return f"user name {name!r} is reserved for the platform or a system account; choose another"
    shape = skeleton(name)
    part = next((p for p in RESERVED_PARTS if p in shape or skeleton(p) in shape), None)
    if part:
        return f"user name {name!r} is reserved: names containing {part!r} read as an administrator's"
    for other in sorted(existing):
        if skeleton(other) == shape:
            return f"user name {name!r} is too close to the existing user {other!r}; choose a distinct name"
    for team in sorted(teams):
        if skeleton(team) == shape:
            return f"user name {name!r} is too close to team {team!r}; choose a distinct name"
    for account in sorted(RESERVED_USERNAMES | system_accounts):
        if skeleton(account) == shape:
            return f"user name {name!r} is too close to the reserved name {account!r}; choose another"
    return None


def unix_user(name: str) -> str:
    """The Unix account of hub user `name` (a valid name): in gpupool's own namespace."""
    return USER_PREFIX + name


def unix_group(team: str) -> str:
    """The Unix group of `team`: in gpupool's own namespace, never a user's personal group."""
    return TEAM_PREFIX + team


def unix_name_problem(unix_name: str) -> str | None:
    """Why useradd/groupadd would refuse `unix_name`, or None (only the length can be wrong for our names)."""
    if len(unix_name) > MAX_UNIX_NAME:
        return f"Unix name {unix_name!r} is longer than {MAX_UNIX_NAME} characters"
    return None
