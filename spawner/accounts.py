"""Root mode: the Unix accounts and groups gpupool owns, and the team folders shared inside a team.

Hub user `alice` runs as account `gp-alice` (personal group `gp-alice`), team `vision` is group
`gpteam-vision` (see `gpupool.policies.identity`). Every id gpupool gives out comes from its own range and is
written to a record that lives outside any state folder (`/var/lib/gpupool/identities.json` by default), so
that a restart, a reinstall with a new state folder, or an account deleted by hand and made again keeps
the same uid and gid, and files keep their owners. An account or group with one of these names that the
record does not hold with that id was not made by gpupool: it is an error naming the conflict, never adopted.

The accounts and groups are the machine's, so one machine runs one platform as root: the record names the
state folder of the platform they belong to (`claim_machine`), and a second platform refuses to start while
that folder exists (its team `vision` would be the first one's `gpteam-vision`, its `alice` the first's).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpupool.policies.identity import unix_group, unix_name_problem, unix_user, username_problem

#: The machine-wide record of what gpupool created (not in a state folder: it must outlive a reinstall).
DEFAULT_RECORD = "/var/lib/gpupool/identities.json"
#: The uids and gids gpupool gives out: above Debian's dynamic range (1000-59999) and its reserved block
#: (60000-64999), so neither `adduser` nor a package ever picks one of them.
FIRST_ID, LAST_ID = 70000, 99999


class IdentityConflict(RuntimeError):
    """An account or group has a name gpupool would give, but gpupool did not create it."""


@dataclass(frozen=True)
class Account:
    """A hub user's Unix account as the spawner runs it."""

    name: str
    uid: int
    gid: int
    home: str
    groups: tuple[str, ...]


def _run(*command: str) -> None:
    result = subprocess.run(list(command), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {result.stderr.strip() or result.stdout.strip()}")


@contextlib.contextmanager
def _locked_record(path: Path):
    """The record, loaded under an exclusive lock (many hubs may run on one machine) and saved atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = json.loads(path.read_text()) if path.exists() else {}
        record.setdefault("users", {})
        record.setdefault("groups", {})
        before = json.dumps(record, sort_keys=True)
        yield record
        if json.dumps(record, sort_keys=True) != before:
            descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
            with os.fdopen(descriptor, "w") as out:
                json.dump(record, out, indent=1, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)


def claim_machine(state_dir: str | Path, record_path: str | Path = DEFAULT_RECORD,
                  take_over: bool = False) -> str | None:
    """Record that gpupool's accounts and groups on this machine are the platform's in `state_dir`; or, when another
    platform's state folder still exists, why it may not start (None: claimed). A record of a platform whose state
    folder is gone is taken over (a reinstall keeps its users' uids); so is any with `take_over`."""
    state = str(Path(state_dir).resolve())
    record_path = Path(record_path)
    with _locked_record(record_path) as record:
        owner = record.get("platform")
        if owner and owner != state and Path(owner).is_dir() and not take_over:
            return (f"this machine's gpupool accounts and team groups (gp-USER, gpteam-TEAM, recorded in "
                    f"{record_path}) belong to the platform whose state folder is {owner}. One machine runs one "
                    f"gpupool platform as root: a second would share them (a user of one could read the other's team "
                    f"folders and homes). "
                    f"Run that platform (`gpupool up --state-dir {owner}`), or, if it is gone for good, remove its "
                    f"state folder {owner}: its users' accounts, team groups and their files then pass to this one")
        record["platform"] = state
    return None


def _lookup(getter, name):
    try:
        return getter(name)
    except KeyError:
        return None


def _free_id(record: dict) -> int:
    """An id in gpupool's range that no account, group or recorded name uses (uid and gid alike)."""
    taken = {*record["users"].values(), *record["groups"].values()}
    taken |= {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    for candidate in range(FIRST_ID, LAST_ID + 1):
        if candidate not in taken:
            return candidate
    raise RuntimeError(f"gpupool's id range {FIRST_ID}-{LAST_ID} is used up")


def _not_ours(kind: str, name: str, found: int, recorded: int | None, record_path: Path) -> IdentityConflict:
    why = (f"gpupool's record {record_path} has it as {recorded}" if recorded is not None
           else f"gpupool's record {record_path} does not list it")
    return IdentityConflict(
        f"Unix {kind} {name} exists ({'uid' if kind == 'user' else 'gid'} {found}) but was not created by gpupool "
        f"({why}); gpupool never adopts an account or group it did not create. Rename or remove it, or point "
        f"c.LocalGPUSpawner.identity_record at the record that created it."
    )


def ensure_group(group: str, record: dict, record_path: Path, log) -> int:
    """The gid of gpupool's group `group`, created (with its recorded gid, if any) when missing."""
    problem = unix_name_problem(group)
    if problem:
        raise IdentityConflict(problem)
    recorded = record["groups"].get(group)
    existing = _lookup(grp.getgrnam, group)
    if existing is not None:
        if existing.gr_gid != recorded:
            raise _not_ours("group", group, existing.gr_gid, recorded, record_path)
        return existing.gr_gid
    gid = recorded if recorded is not None else _free_id(record)
    holder = _lookup(grp.getgrgid, gid)
    if holder is not None:
        raise IdentityConflict(f"gid {gid}, recorded for gpupool's group {group} in {record_path}, now belongs "
                               f"to group {holder.gr_name}; gpupool does not reuse it")
    _run("groupadd", "--gid", str(gid), "--", group)
    record["groups"][group] = gid
    log.info("created Unix group %s (gid %s)", group, gid)
    return gid


def ensure_account(name: str, teams: list[str], log, record_path: str | Path = DEFAULT_RECORD) -> Account:
    """Hub user `name`'s account, in exactly gpupool's groups of `teams` (team groups made first), home 0700.

    Groups that gpupool does not own (an admin's `video`, say) are left as they are; team groups the user
    no longer belongs to are dropped, so leaving a team closes its folders.
    """
    problem = username_problem(name)
    if problem:
        raise IdentityConflict(f"hub user refused: {problem}")
    account = unix_user(name)
    record_path = Path(record_path)
    with _locked_record(record_path) as record:
        team_groups = [unix_group(team) for team in teams]
        for group in team_groups:
            ensure_group(group, record, record_path, log)
        gid = ensure_group(account, record, record_path, log)  # the personal group
        recorded = record["users"].get(account)
        existing = _lookup(pwd.getpwnam, account)
        if existing is None:
            problem = unix_name_problem(account)
            if problem:
                raise IdentityConflict(problem)
            uid = recorded if recorded is not None else gid
            holder = _lookup(pwd.getpwuid, uid)
            if holder is not None:
                raise IdentityConflict(f"uid {uid}, for gpupool's account {account}, belongs to {holder.pw_name}; "
                                       "gpupool does not reuse it")
            # --no-log-init: lastlog and faillog are sparse files indexed by uid; ours are large.
            _run("useradd", "--uid", str(uid), "--gid", str(gid), "--create-home", "--no-log-init",
                 "--shell", "/bin/bash", "--comment", f"gpupool user {name}", "--", account)
            record["users"][account] = uid
            log.info("created Unix account %s (uid %s) for hub user %s", account, uid, name)
            existing = pwd.getpwnam(account)
        elif existing.pw_uid != recorded:
            raise _not_ours("user", account, existing.pw_uid, recorded, record_path)
        owned = set(record["groups"])
        current = [g.gr_name for g in grp.getgrall() if account in g.gr_mem]
        wanted = [g for g in current if g not in owned] + team_groups
        if sorted(current) != sorted(wanted):
            _run("usermod", "--groups", ",".join(wanted), "--", account)
    home = Path(existing.pw_dir)
    if home.is_dir() and not home.is_symlink():
        os.chmod(home, 0o700)  # teammates share the team folder, not each other's homes
    return Account(account, existing.pw_uid, existing.pw_gid, existing.pw_dir, tuple(team_groups))


def team_folder_acl(group_id: int) -> str:
    """The ACL of a team folder, for `setfacl --set`: the team's group rwx now and in everything made inside."""
    entries = ["u::rwx", f"g:{group_id}:rwx", "g::rwx", "m::rwx", "o::---"]
    return ",".join(entries + [f"d:{entry}" for entry in entries])


def share_with_group(folder: Path, gid: int) -> None:
    """Setgid, mode 2770, owned by `gid`, with default ACLs giving the group rwx on what anyone adds inside.

    The setgid bit keeps the team group on new files; the default ACL keeps them group-writable whatever
    the creator's umask, and survives tools that chmod their own folders (DVC, git).
    """
    os.chown(folder, 0, gid)
    os.chmod(folder, 0o2770)
    setfacl = shutil.which("setfacl")
    if setfacl is None:
        raise RuntimeError("setfacl is missing (Debian package `acl`, installed by `make install`); team folders "
                           "need default ACLs so that teammates can write what a member added")
    _run(setfacl, "--set", team_folder_acl(gid), "--", str(folder))


def is_shared_with_group(folder: Path, gid: int) -> bool:
    """Whether `folder` is already setgid 2770 of `gid` with its default ACL (no need to set it again)."""
    info = folder.stat()
    if info.st_gid != gid or stat.S_IMODE(info.st_mode) != 0o2770:
        return False
    getfacl = shutil.which("getfacl")
    if getfacl is None:
        return False
    shown = subprocess.run([getfacl, "--numeric", "--omit-header", "--", str(folder)], capture_output=True,
                           text=True, check=False).stdout
    return f"default:group:{gid}:rwx" in shown
