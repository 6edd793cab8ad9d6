"""Run as root: hub users become gpupool's own accounts (gp-USER), teams its groups (gpteam-TEAM), each team a
group-private 2770 folder with default ACLs, shared inside the team and closed outside it.

These tests create real (uniquely named) users and groups with useradd/groupadd and remove them again. DVC and
git run as those users (`runuser`): the system's Python 3.11 with this checkout's site-packages, since the
test interpreter itself may lie under /root where other users cannot reach it.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path

import pytest

from harness import Hub
from gpupool.policies.identity import unix_group, unix_user
from gpupool.spawner.accounts import IdentityConflict, claim_machine
from gpupool.spawner.datasets import Remote, dvc_config_text, git_config_text, safe_directories_text
from gpupool.spawner.local import ensure_system_user, ensure_team_folder

pytestmark = pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd: creates real system users and groups",
)
log = logging.getLogger("test")
SYSTEM_PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture
def names():
    """Unique hub names, a root folder other users can enter, a private identity record; all removed after."""
    tag = uuid.uuid4().hex[:6]
    made = {"vision": f"v{tag}", "nlp": f"n{tag}", "alice": f"a{tag}", "bob": f"b{tag}", "carol": f"c{tag}"}
    root = Path(f"/tmp/gpupool-identity-{tag}")  # not under pytest's root-private tmp folders
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    made["root"] = root
    made["record"] = root / "record" / "identities.json"
    yield made
    for key in ("alice", "bob", "carol", "vision", "nlp"):
        subprocess.run(["userdel", "--remove", unix_user(made[key])], capture_output=True, check=False)
    for key in ("alice", "bob", "carol", "vision", "nlp"):
        for group in (unix_user(made[key]), unix_group(made[key])):
            subprocess.run(["groupdel", group], capture_output=True, check=False)
    subprocess.run(["userdel", "--remove", f"gp-x{made['alice']}"], capture_output=True, check=False)
    shutil.rmtree(root, ignore_errors=True)


def as_user(name: str, *command, cwd: str | Path = "/tmp", env: dict | None = None, umask: str = "022"):
    """`command` as hub user `name`'s account, from a login-less shell with `umask` (022: the strictest case)."""
    shell = f"umask {umask}; exec \"$@\""
    return subprocess.run(["runuser", "-u", unix_user(name), "--", "env", *[f"{k}={v}" for k, v in (env or {}).items()],
                           "sh", "-c", shell, "sh", *map(str, command)],
                          capture_output=True, text=True, check=False, cwd=cwd)


def groups_of(account: str) -> set[str]:
    return {g.gr_name for g in grp.getgrall() if account in g.gr_mem}


def test_a_user_named_like_a_team_never_gets_the_teams_group(names):
    """Issue 19.1: hub user `vision` (team nlp only), spawned before any vision member, got team vision's group."""
    vision, nlp, carol = names["vision"], names["nlp"], names["carol"]
    ensure_system_user(vision, [nlp], log, names["record"])  # the user called like the team comes first
    ensure_system_user(carol, [vision], log, names["record"])
    folder = ensure_team_folder(names["root"], vision, as_root=True)
    assert folder.stat().st_gid == grp.getgrnam(unix_group(vision)).gr_gid
    assert groups_of(unix_user(vision)) == {unix_group(nlp)}
    assert pwd.getpwnam(unix_user(vision)).pw_gid != grp.getgrnam(unix_group(vision)).gr_gid
    denied = as_user(vision, "ls", folder)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    assert as_user(carol, "touch", folder / "ok").returncode == 0


def test_an_account_gpupool_did_not_create_is_never_adopted(names):
    """Issue 19.2: hub user `postgres` ran as the machine's postgres; now every hub user runs as gp-NAME and an
    existing gp-NAME that gpupool did not make is a named error, left untouched."""
    alice = names["alice"]
    foreign = f"x{alice}"
    subprocess.run(["useradd", "--no-create-home", "--", unix_user(foreign)], check=True)
    before = subprocess.run(["id", unix_user(foreign)], capture_output=True, text=True, check=True).stdout
    with pytest.raises(IdentityConflict, match=f"Unix (user|group) {unix_user(foreign)} exists .* not created by gpupool"):
        ensure_system_user(foreign, [names["vision"]], log, names["record"])
    assert subprocess.run(["id", unix_user(foreign)], capture_output=True, text=True, check=True).stdout == before
    # A team group made by someone else is refused the same way, before any user is touched.
    subprocess.run(["groupadd", "--", unix_group(names["nlp"])], check=True)
    with pytest.raises(IdentityConflict, match=f"Unix group {unix_group(names['nlp'])} exists"):
        ensure_system_user(alice, [names["nlp"]], log, names["record"])
    with pytest.raises(KeyError):
        pwd.getpwnam(unix_user(alice))


def test_postgres_the_hub_user_is_not_postgres_the_account(names):
    """Issue 19.2 with the real name: even if a `postgres` hub user existed, its account is gpupool's own."""
    assert unix_user("postgres") == "gp-postgres"
    real = pwd.getpwnam("postgres") if "postgres" in {p.pw_name for p in pwd.getpwall()} else None
    if real is not None:
        assert unix_user("postgres") != real.pw_name


@pytest.mark.parametrize("name", ["-rf", "Alice", "a.b", "аlice", "alice.", "--help"])
def test_names_outside_the_rule_never_reach_useradd(names, name):
    """Issue 19.3: `-rf` reached useradd as an option; no refused name creates anything."""
    with pytest.raises(IdentityConflict, match="hub user refused"):
        ensure_system_user(name, [names["vision"]], log, names["record"])
    assert not names["record"].exists() or unix_user(name) not in json.loads(names["record"].read_text())["users"]


def test_ids_are_recorded_and_kept_across_restarts_reinstalls_and_deleted_accounts(names):
    """The record outlives a state folder: the same uid comes back, files keep their owner."""
    alice, vision = names["alice"], names["vision"]
    first = ensure_system_user(alice, [vision], log, names["record"])
    again = ensure_system_user(alice, [vision], log, names["record"])  # a restart, a second hub, a new state folder
    assert again == first
    (Path(first.home) / "notes.txt").write_text("mine")
    os.chown(Path(first.home) / "notes.txt", first.uid, first.gid)
    subprocess.run(["userdel", "--", first.name], check=True)  # the account is lost, the home is kept
    subprocess.run(["groupdel", "--", first.name], capture_output=True, check=False)
    back = ensure_system_user(alice, [vision], log, names["record"])
    assert (back.uid, back.gid) == (first.uid, first.gid)
    assert (Path(back.home) / "notes.txt").stat().st_uid == back.uid
    assert as_user(alice, "cat", Path(back.home) / "notes.txt").stdout == "mine"


def test_one_machine_runs_one_platform_as_root(names):
    """Issue 33: two platforms on one machine shared `gpteam-vision` through the machine's record, so a user of one
    read the other's team folder. A second platform refuses to start as root, naming the first one's state folder
    and the way out; once that folder is gone (a reinstall), the accounts pass to the new one, uids kept."""
    record, root = names["record"], names["root"]
    first = root / "first" / "state"
    first.mkdir(parents=True)
    assert claim_machine(first, record) is None and claim_machine(first, record) is None  # its own restarts
    alice = ensure_system_user(names["alice"], [names["vision"]], log, record)
    # The admin's path: `gpupool up` of a second platform, as root.
    hub = Hub(root / "second", {
        "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [whole]}\n"
                     "inventory:\n  - {model: H200, count: 1}\n",
        "teams.yaml": f"teams:\n  {names['vision']}: {{}}\n",
        "profiles.yaml": f"profiles:\n  cpu: {{display_name: CPU, teams: [{names['vision']}]}}\n",
    }, f"c.LocalGPUSpawner.identity_record = {str(record)!r}", mlflow=False)
    try:
        with pytest.raises(AssertionError):  # its process ended instead of serving
            hub.start()
        said = " ".join(hub.log.read_text().split())
        assert (f"gpupool up: refusing to start: this machine's gpupool accounts and team groups (gp-USER, gpteam-TEAM, "
                f"recorded in {record}) belong to the platform whose state folder is {first}.") in said, said[-3000:]
        assert f"`gpupool up --state-dir {first}`), or, if it is gone for good, remove its state folder {first}" in said
    finally:
        hub.kill()
        hub.kill_leftovers()
    assert json.loads(record.read_text())["platform"] == str(first)
    shutil.rmtree(first)
    assert claim_machine(hub.state, record) is None
    assert json.loads(record.read_text())["platform"] == str(hub.state.resolve())
    assert ensure_system_user(names["alice"], [names["vision"]], log, record) == alice


def test_leaving_a_team_drops_its_group_and_keeps_groups_gpupool_does_not_own(names):
    alice, vision, nlp = names["alice"], names["vision"], names["nlp"]
    account = ensure_system_user(alice, [vision, nlp], log, names["record"]).name
    subprocess.run(["usermod", "--append", "--groups", "video", "--", account], check=True)
    ensure_system_user(alice, [nlp], log, names["record"])
    assert groups_of(account) == {unix_group(nlp), "video"}


def test_homes_are_private(names):
    """Issue 19.5: homes were 0755, so bob could list the names of alice's files."""
    alice, bob = names["alice"], names["bob"]
    home = Path(ensure_system_user(alice, [names["vision"]], log, names["record"]).home)
    ensure_system_user(bob, [names["nlp"]], log, names["record"])
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    os.chmod(home, 0o755)  # a home opened by hand is closed again at the next start
    ensure_system_user(alice, [names["vision"]], log, names["record"])
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    denied = as_user(bob, "ls", home)
    assert denied.returncode != 0 and "Permission denied" in denied.stderr


def _dvc_env(name: str, root: Path, config_text: str) -> dict[str, str]:
    """What a server gives its user for DVC: a private global config naming the team remote."""
    folder = root / f"dvc-config-{name}"
    folder.mkdir()
    (folder / "config").write_text(config_text)
    account = pwd.getpwnam(unix_user(name))
    for path in (folder, folder / "config"):
        os.chown(path, account.pw_uid, account.pw_gid)
    os.chmod(folder, 0o700)
    site = sysconfig.get_paths()["purelib"]
    return {"DVC_GLOBAL_CONFIG_DIR": str(folder), "HOME": account.pw_dir, "PYTHONPATH": site,
            "DVC_NO_ANALYTICS": "1"}


@pytest.mark.skipif(not Path(SYSTEM_PYTHON).exists(), reason=f"runs DVC as real users with {SYSTEM_PYTHON}")
def test_team_remote_and_registry_are_shared_inside_the_team_and_closed_outside(names):
    """Issue 19.4: after alice's `dvc push`, `dvc/files` lost its setgid bit, `files/md5` belonged to group
    `alice` and carol (same team) got Permission denied. Here alice pushes, carol pulls and adds a version,
    alice pulls carol's, bob (other team) is refused; then the same for the team's git registry."""
    alice, bob, carol, vision, nlp = (names[k] for k in ("alice", "bob", "carol", "vision", "nlp"))
    root = names["root"]
    for user, team in ((alice, vision), (carol, vision), (bob, nlp)):
        ensure_system_user(user, [team], log, names["record"])
    folder = ensure_team_folder(root, vision, as_root=True)
    ensure_team_folder(root, nlp, as_root=True)
    remote = Remote(vision, str(folder), str(folder / "dvc"))
    config = dvc_config_text([remote], vision, with_profiles=False)
    assert "[cache]\nshared = group" in config and "shared = group" in config.split("remote", 2)[2]
    dvc = [SYSTEM_PYTHON, "-m", "dvc"]

    env_of = {user: _dvc_env(user, root, config) for user in (alice, carol, bob)}

    def run(user, *command, cwd):
        return as_user(user, *command, cwd=cwd, env=env_of[user])

    alice_project = Path(pwd.getpwnam(unix_user(alice)).pw_dir) / "project"
    for user in (alice, carol, bob):
        home = Path(pwd.getpwnam(unix_user(user)).pw_dir)
        assert run(user, "mkdir", "-p", home / "project", cwd="/tmp").returncode == 0
        done = run(user, *dvc, "init", "--no-scm", "-q", cwd=home / "project")
        assert done.returncode == 0, done.stderr

    (alice_project / "data.txt").write_text("version one\n")
    os.chown(alice_project / "data.txt", *[getattr(pwd.getpwnam(unix_user(alice)), k) for k in ("pw_uid", "pw_gid")])
    for command in (["add", "-q", "data.txt"], ["push", "-q"]):
        done = run(alice, *dvc, *command, cwd=alice_project)
        assert done.returncode == 0, done.stderr
    team_gid = grp.getgrnam(unix_group(vision)).gr_gid
    md5 = folder / "dvc" / "files" / "md5"
    for path in (folder / "dvc", folder / "dvc" / "files", md5, *md5.iterdir()):
        assert path.stat().st_gid == team_gid and path.stat().st_mode & stat.S_ISGID, path
    for path in md5.rglob("*"):
        assert path.stat().st_gid == team_gid and path.stat().st_mode & 0o060 >= 0o040, path

    def pull_into(user: str, dvc_file: str) -> subprocess.CompletedProcess:
        project_dir = Path(pwd.getpwnam(unix_user(user)).pw_dir) / "project"
        account = pwd.getpwnam(unix_user(user))
        shutil.copy(alice_project / dvc_file if user != alice else carol_project / dvc_file, project_dir / "data.txt.dvc")
        os.chown(project_dir / "data.txt.dvc", account.pw_uid, account.pw_gid)
        return run(user, *dvc, "pull", "-q", "--force", cwd=project_dir)

    carol_project = Path(pwd.getpwnam(unix_user(carol)).pw_dir) / "project"
    done = pull_into(carol, "data.txt.dvc")
    assert done.returncode == 0, done.stderr
    assert (carol_project / "data.txt").read_text() == "version one\n"
    # carol adds a version: new objects beside alice's, in folders alice's push made
    done = run(carol, "sh", "-c", "rm -f data.txt && echo 'version two' > data.txt", cwd=carol_project)
    assert done.returncode == 0, done.stderr
    for command in (["add", "-q", "data.txt"], ["push", "-q"]):
        done = run(carol, *dvc, *command, cwd=carol_project)
        assert done.returncode == 0, done.stderr
    done = pull_into(alice, "data.txt.dvc")
    assert done.returncode == 0, done.stderr
    assert (alice_project / "data.txt").read_text() == "version two\n"
    # bob, of another team, reaches nothing
    bob_project = Path(pwd.getpwnam(unix_user(bob)).pw_dir) / "project"
    shutil.copy(carol_project / "data.txt.dvc", bob_project / "data.txt.dvc")
    denied = run(bob, *dvc, "pull", "-q", cwd=bob_project)
    assert denied.returncode != 0 and not (bob_project / "data.txt").exists()
    denied = run(bob, "ls", md5, cwd="/tmp")
    assert denied.returncode != 0 and "Permission denied" in denied.stderr

    # The team registry: alice creates and pushes, carol clones (safe directory), commits with the server's
    # author and pushes, bob cannot clone.
    registry = folder / "datasets.git"
    assert run(alice, "git", "init", "--quiet", "--bare", "--shared=group", "--initial-branch=main", registry, cwd="/tmp").returncode == 0
    for user in (alice, carol):
        account = pwd.getpwnam(unix_user(user))
        gitconfig = root / f"gitconfig-{user}"
        gitconfig.write_text(git_config_text([str(registry)], user, f"{user}@example.org"))
        os.chown(gitconfig, account.pw_uid, account.pw_gid)
        env_of[user]["GIT_CONFIG_SYSTEM"] = str(gitconfig)
        clone = Path(account.pw_dir) / "registry"
        dvc_init = f"{SYSTEM_PYTHON} -m dvc init -q && " if user == alice else ""  # a registry is a DVC repository
        script = (f"git clone --quiet {registry} {clone} && cd {clone} && {dvc_init}echo {user} > {user}.txt && "
                  f"git add -A && git commit --quiet -m 'from {user}' && git push --quiet origin HEAD:main")
        done = run(user, "sh", "-c", script, cwd="/tmp")
        assert done.returncode == 0, done.stderr
    log_lines = run(carol, "git", "-C", registry, "log", "--format=%an <%ae>", "main", cwd="/tmp").stdout.split("\n")
    assert log_lines[:2] == [f"{carol} <{carol}@example.org>", f"{alice} <{alice}@example.org>"]
    denied = run(bob, "git", "clone", "--quiet", registry, "/tmp/" + bob, cwd="/tmp")
    assert denied.returncode != 0

    # `dvc get` of the team registry opens it with libgit2, which reads safe.directory only from the user's
    # global config: the server's preexec makes ~/.gitconfig include the hub's list of registries.
    safe = root / "safe-directories.gitconfig"
    safe.write_text(safe_directories_text([str(registry)]))
    os.chmod(safe, 0o644)
    carol_home = Path(pwd.getpwnam(unix_user(carol)).pw_dir)
    include = (f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r}); "  # the editable install's finder
               f"from pathlib import Path; from gpupool.spawner.local import include_in_git_config as i; "
               f"i(Path({str(carol_home)!r}), Path({str(safe)!r})); i(Path({str(carol_home)!r}), Path({str(safe)!r}))")
    done = run(carol, SYSTEM_PYTHON, "-c", include, cwd="/tmp")
    assert done.returncode == 0, done.stderr
    assert (carol_home / ".gitconfig").read_text().count(str(safe)) == 1
    done = run(carol, "sh", "-c", f"mkdir got && cd got && {SYSTEM_PYTHON} -m dvc ls {registry}",
               cwd=carol_home)
    assert done.returncode == 0 and f"{carol}.txt" in done.stdout.split(), (done.stdout, done.stderr)
