"""Team dataset remotes and registries with the real `dvc` command line, on a team folder and on SeaweedFS S3.

The environment of each `dvc` call is the one a real user server has: a `gpupool up` hub spawns the server
and a kernel in it prints its `os.environ`. Credentials must never reach a repository's `.dvc/config`. The checks
that need no server (policy, what a server is given, the registry's checks, the command's refusals):
tests/unit/hub/test_datasets_checks.py.
"""

from __future__ import annotations

import configparser
import grp
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import requests
import yaml
from configobj import ConfigObj

from gpupool.hub.datasets import repository_config_problems, team_datasets
from harness import Hub
from gpupool.policies import EXAMPLES_DIR, load_policy
from gpupool.spawner.datasets import git_config_text, server_datasets

GPUPOOL = Path(sys.executable).parent / "gpupool"

POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}\n"
                 "inventory:\n  - {model: H200, count: 1}\n",
    "teams.yaml": "teams:\n  vision: {priority: 100}\n  nlp: {priority: 50}\n",
    "profiles.yaml": "profiles:\n  cpu: {display_name: CPU only, teams: [vision, nlp], default: true}\n",
}


# --- the real thing: servers, dvc, SeaweedFS ---------------------------------------------------------------------


def server_env(hub: Hub, user: str, teams: list[str], team: str) -> dict[str, str]:
    """The environment of `user`'s real server charged to `team` (printed by a kernel in it); stops it."""
    for t in teams:
        hub.add_user(user, t)
    reply = hub.api("POST", f"/users/{user}/server", json={"profile": "cpu", "team": team})
    assert reply.status_code in (201, 202), reply.text
    hub.wait_ready(user)
    env = json.loads(hub.run_in_kernel(user, "import os, json; print(json.dumps(dict(os.environ)))"))
    hub.stop_server(user)
    for key in ("JPY_PARENT_PID", "JPY_SESSION_NAME"):
        env.pop(key, None)
    env["DVC_NO_ANALYTICS"] = "1"  # no phoning home from the tests
    return env


def run(env: dict[str, str], *command: str | Path, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if ok:
        assert done.returncode == 0, f"{command}: {done.stdout}\n{done.stderr}"
    return done


def dvc(env, *args, cwd, ok=True):
    return run(env, sys.executable, "-m", "dvc", *args, cwd=cwd, ok=ok)


def checksums(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def make_data(folder: Path, seed: str) -> Path:
    (folder / "images").mkdir(parents=True)
    for i in range(3):
        (folder / "images" / f"{i}.bin").write_bytes(hashlib.sha256(f"{seed}{i}".encode()).digest() * 500)
    (folder / "labels.csv").write_text(f"file,label\n0.bin,{seed}\n")
    return folder


def push_wipe_pull(env: dict[str, str], repo: Path, remote: str | None = None) -> None:
    """A dataset into a fresh repository, pushed to the (default) remote, cache and data wiped, pulled back."""
    repo.mkdir()
    run(env, "git", "init", "--quiet", cwd=repo)
    dvc(env, "init", "--quiet", cwd=repo)
    make_data(repo / "data", repo.name)
    before = checksums(repo / "data")
    dvc(env, "add", "--quiet", "data", cwd=repo)
    dvc(env, "push", *(["-r", remote] if remote else []), cwd=repo)
    shutil.rmtree(repo / ".dvc" / "cache")
    shutil.rmtree(repo / "data")
    dvc(env, "pull", *(["-r", remote] if remote else []), cwd=repo)
    assert checksums(repo / "data") == before
    assert no_credentials(repo)


def no_credentials(repo: Path, secrets: tuple[str, ...] = ()) -> bool:
    """A repository's `.dvc/config` names no credential option and contains none of `secrets`."""
    config = repo / ".dvc" / "config"
    text = config.read_text() if config.exists() else ""
    assert not repository_config_problems(dict(ConfigObj(text.splitlines())), "/"), text
    assert not [s for s in secrets if s in text], text
    return True


def registry_round_trip(env: dict[str, str], tmp: Path, registry_remote_marker: str) -> Path:
    """init, two versions, list shows both, `dvc import --rev` of the first gets the first's content."""
    v1 = make_data(tmp / "cats-v1", "one")
    v2 = make_data(tmp / "cats-v2", "two")
    run(env, GPUPOOL, "datasets", "init", cwd=tmp)
    run(env, GPUPOOL, "datasets", "add", "cats", v1, "--version", "v1", cwd=tmp)
    added = run(env, GPUPOOL, "datasets", "add", "cats", v2, "--version", "v2", "-m", "relabelled", cwd=tmp)
    assert "[4/4] dvc push to" in added.stderr and registry_remote_marker in added.stderr
    listed = json.loads(run(env, GPUPOOL, "datasets", "list", "cats", "--json", cwd=tmp).stdout)
    (cats,) = listed["datasets"]
    assert [v["version"] for v in cats["versions"]] == ["v1", "v2"]
    assert all(v["size"] == sum(f.stat().st_size for f in v1.rglob("*") if f.is_file()) for v in cats["versions"])
    assert [v["files"] for v in cats["versions"]] == [4, 4] and listed["problems"] == []
    table = run(env, GPUPOOL, "datasets", "list", cwd=tmp).stdout
    assert "cats     v1" in table and "cats     v2" in table

    registry = Path(env["GPUPOOL_TEAM_ROOT"]) / env["GPUPOOL_TEAM"] / "datasets.git"
    project = tmp / "project"
    project.mkdir()
    run(env, "git", "init", "--quiet", cwd=project)
    dvc(env, "init", "--quiet", cwd=project)
    dvc(env, "import", registry, "cats", "--rev", "cats@v1", "-o", "cats", cwd=project)
    assert checksums(project / "cats") == checksums(v1) != checksums(v2)
    dvc(env, "get", registry, "cats", "--rev", "cats@v2", "-o", "latest", cwd=project)
    assert checksums(project / "latest") == checksums(v2)
    assert no_credentials(project)
    return registry


def registry_has_no_credentials(registry: Path, secrets: tuple[str, ...], root: str) -> None:
    """At every revision the registry's `.dvc/config` holds no credentials and no remote outside `root`; no
    object holds a secret."""
    revs = subprocess.run(["git", "-C", registry, "rev-list", "--all"], capture_output=True, text=True,
                          check=True).stdout.split()
    assert len(revs) == 3  # init and two versions
    for rev in revs:
        shown = subprocess.run(["git", "-C", registry, "show", f"{rev}:.dvc/config"], capture_output=True,
                               text=True, check=True).stdout
        assert 'remote "' in shown and not repository_config_problems(dict(ConfigObj(shown.splitlines())), root), shown
    for secret in secrets:
        found = subprocess.run(["git", "-C", registry, "grep", "-F", "-e", secret, *revs], capture_output=True, text=True,
                               check=False)
        assert found.returncode == 1, found.stdout


def stop(hub: Hub) -> None:
    hub.stop()
    for process in psutil.process_iter(["cmdline"]):  # no server outlives the test
        if str(hub.state) in " ".join(process.info["cmdline"] or []):
            process.kill()


@pytest.fixture(scope="module")
def folder_env(tmp_path_factory):
    """A real `vision` server's environment on a hub with folder storage; alice is in vision and nlp."""
    hub = Hub(tmp_path_factory.mktemp("datasets-folder"), POLICY, 'c.LocalGPUSpawner.run_as = "self"\n', mlflow=False)
    hub.start()
    try:
        yield server_env(hub, "alice", ["vision", "nlp"], "vision"), hub
    finally:
        stop(hub)


def test_folder_remote_push_wipe_pull(folder_env, tmp_path):
    env, hub = folder_env
    teams = hub.team_root
    assert env["GPUPOOL_TEAM"] == "vision" and env["GPUPOOL_TEAM_ROOT"] == str(teams)
    config_dir = Path(env["DVC_GLOBAL_CONFIG_DIR"])
    assert config_dir.is_relative_to(hub.state / "servers" / "alice") and oct(config_dir.parent.stat().st_mode)[-3:] == "700"
    push_wipe_pull(env, tmp_path / "default")
    assert list((teams / "vision" / "dvc" / "files" / "md5").rglob("*.dir"))
    push_wipe_pull(env, tmp_path / "other", remote="nlp")  # alice is in two teams: `-r nlp`
    assert list((teams / "nlp" / "dvc" / "files" / "md5").rglob("*.dir"))


def test_folder_registry(folder_env, tmp_path):
    env, hub = folder_env
    registry = registry_round_trip(env, tmp_path, str(hub.team_root / "vision" / "dvc"))
    registry_has_no_credentials(registry, (), str(hub.team_root / "vision"))

    # A symlinked folder in the data is refused, and nothing is tagged.
    linked = make_data(tmp_path / "linked", "three")
    (linked / "outside").symlink_to(tmp_path / "cats-v1")
    refused = run(env, GPUPOOL, "datasets", "add", "cats", linked, "--version", "v3", cwd=tmp_path, ok=False)
    assert refused.returncode == 1 and "is a symlinked directory inside the dataset" in refused.stderr
    assert "Traceback" not in refused.stderr
    # A version whose .dvc file points outside the repository (pushed by hand) is refused by `list`.
    clone = tmp_path / "clone"
    run(env, "git", "clone", "--quiet", registry, clone, cwd=tmp_path)
    (clone / "cats.dvc").write_text("outs:\n- md5: 0123.dir\n  path: ../../../etc\n")
    run(env, "git", "-c", "user.email=x@y", "-c", "user.name=x", "commit", "--quiet", "-am", "evil", cwd=clone)
    run(env, "git", "tag", "cats@v9", cwd=clone)
    run(env, "git", "push", "--quiet", "origin", "HEAD", "cats@v9", cwd=clone)
    listed = run(env, GPUPOOL, "datasets", "list", "cats", cwd=tmp_path, ok=False)
    assert listed.returncode == 1
    assert "refused tag cats@v9: cats.dvc has output '../../../etc', which escapes the repository" in listed.stderr
    assert "cats     v1" in listed.stdout and "v9" not in listed.stdout
    assert [d.name for d in team_datasets(load_policy(hub.policies), "vision", hub.team_root).datasets] == ["cats"]
    assert team_datasets(load_policy(hub.policies), "nlp", hub.team_root).datasets == ()

    # The hub's Datasets tab (the accounting service) shows the same to members, and nothing to others.
    hub.add_user("nora", "nlp")

    def get(user: str, path: str) -> requests.Response:
        token = hub.api("POST", f"/users/{user}/tokens", json={"note": "datasets"}).json()["token"]
        return requests.get(f"{hub.url}/services/accounting/{path}", headers={"Authorization": f"token {token}"},
                            timeout=60)

    shown = get("alice", "api/teams/vision/datasets")
    assert shown.status_code == 200, shown.text
    assert [(d["name"], [v["version"] for v in d["versions"]]) for d in shown.json()["datasets"]] == [
        ("cats", ["v1", "v2"])]
    assert shown.json()["registry"] == str(registry)
    assert any("cats@v9" in problem for problem in shown.json()["problems"])
    assert get("nora", "api/teams/vision/datasets").status_code == 404
    page = get("alice", "datasets")
    assert page.status_code == 200 and "Team vision" in page.text and "Team nlp" in page.text
    assert "<td>cats</td><td>v2</td>" in page.text and f"dvc import {registry} cats --rev cats@v2" in page.text
    assert "Team vision" not in get("nora", "datasets").text

    # The registry belongs to whoever made it; root (the tab's service, an admin's CLI) reads it all the same,
    # where plain git says "detected dubious ownership".
    if os.geteuid() == 0:
        made = registry.stat()
        subprocess.run(["chown", "-R", "nobody", registry], check=True)
        try:
            plain = subprocess.run(["git", "-C", registry, "for-each-ref"], capture_output=True, text=True)
            assert "dubious ownership" in plain.stderr  # the positive control: what the listing must get past
            assert [d.name for d in team_datasets(load_policy(hub.policies), "vision", hub.team_root).datasets] == [
                "cats"]
            assert [d["name"] for d in get("alice", "api/teams/vision/datasets").json()["datasets"]] == ["cats"]
        finally:
            subprocess.run(["chown", "-R", f"{made.st_uid}:{made.st_gid}", registry], check=True)


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory, s3_server):
    """A real `vision` server's environment on a hub whose teams keep datasets in their SeaweedFS buckets."""
    tmp = tmp_path_factory.mktemp("datasets-s3")
    credentials = tmp / "credentials"
    parser = configparser.ConfigParser()
    for team, keys in s3_server.credentials.items():
        parser[f"gpupool-{team}"] = keys
    with credentials.open("w") as out:
        parser.write(out)
    os.chmod(credentials, 0o600)
    policy = {**POLICY, "datasets.yaml": f"datasets:\n  storage: s3\n  s3: {{endpoint_url: '{s3_server.endpoint}', "
                                         "region: us-east-1}\n"}
    hub = Hub(tmp, policy, f'c.LocalGPUSpawner.run_as = "self"\n'
                           f'c.LocalGPUSpawner.dataset_credentials_file = {str(credentials)!r}', mlflow=False)
    hub.start()
    try:
        yield server_env(hub, "bob", ["vision"], "vision"), s3_server, tmp
    finally:
        stop(hub)


def test_s3_remote_push_wipe_pull_and_isolation(s3_env, tmp_path):
    env, s3, _ = s3_env
    secrets = tuple(v for keys in s3.credentials.values() for v in keys.values())
    global_config = (Path(env["DVC_GLOBAL_CONFIG_DIR"]) / "config").read_text()
    assert "s3://gpupool-vision/dvc" in global_config and not [s for s in secrets if s in global_config]
    assert "gpupool-nlp" not in global_config  # bob is in vision only
    given = configparser.ConfigParser()
    given.read(env["AWS_SHARED_CREDENTIALS_FILE"])
    assert given.sections() == ["gpupool-vision"]  # nlp's keys never reach a vision-only server
    push_wipe_pull(env, tmp_path / "repo")
    assert no_credentials(tmp_path / "repo", secrets)

    # nlp's keys, however they are presented, are refused on the vision bucket by the S3 server.
    stolen = tmp_path / "stolen-credentials"
    stolen.write_text(f"[gpupool-vision]\naws_access_key_id = {s3.credentials['nlp']['aws_access_key_id']}\n"
                      f"aws_secret_access_key = {s3.credentials['nlp']['aws_secret_access_key']}\n")
    intruder = {**env, "AWS_SHARED_CREDENTIALS_FILE": str(stolen)}
    shutil.rmtree(tmp_path / "repo" / ".dvc" / "cache")
    shutil.rmtree(tmp_path / "repo" / "data")
    refused = dvc(intruder, "pull", cwd=tmp_path / "repo", ok=False)
    said = refused.stderr + refused.stdout
    assert refused.returncode != 0 and ("403" in said or "Access Denied" in said), said
    assert not (tmp_path / "repo" / "data" / "labels.csv").exists()
    (tmp_path / "repo" / "new.txt").write_text("intruder")
    dvc(intruder, "add", "--quiet", "new.txt", cwd=tmp_path / "repo")
    assert dvc(intruder, "push", cwd=tmp_path / "repo", ok=False).returncode != 0


def test_s3_registry(s3_env, tmp_path):
    env, s3, _ = s3_env
    secrets = tuple(v for keys in s3.credentials.values() for v in keys.values())
    registry = registry_round_trip(env, tmp_path, "s3://gpupool-vision/dvc")
    registry_has_no_credentials(registry, secrets, "s3://gpupool-vision")


# --- real Unix users (root) ---------------------------------------------------------------------------------------

root_only = pytest.mark.skipif(os.getuid() != 0 or shutil.which("useradd") is None,
                               reason="needs root and useradd: creates real system users and groups")


@root_only
def test_nlp_user_can_neither_read_nor_write_the_vision_folder(tmp_path_factory, monkeypatch):
    import uuid

    from gpupool.policies.identity import unix_group, unix_user
    from gpupool.spawner.local import ensure_system_user

    tag = uuid.uuid4().hex[:6]
    vision, nlp, alice, nadia = f"gpv{tag}", f"gpn{tag}", f"gpa{tag}", f"gpd{tag}"
    root = Path(f"/tmp/gpupool-datasets-{tag}")  # not under pytest's root-private tmp folders
    record = root / "identities.json"
    try:
        root.mkdir(mode=0o755)
        ensure_system_user(alice, [vision], __import__("logging").getLogger("test"), record)
        ensure_system_user(nadia, [nlp], __import__("logging").getLogger("test"), record)
        policies = root / "policies"
        policies.mkdir()
        for name, text in {**POLICY, "teams.yaml": f"teams:\n  {vision}: {{}}\n  {nlp}: {{}}\n",
                           "profiles.yaml": f"profiles:\n  cpu: {{display_name: CPU, teams: [{vision}]}}\n"}.items():
            (policies / name).write_text(text)
        teams = root / "teams"
        for team in (vision, nlp):
            done = subprocess.run([GPUPOOL, "datasets", "init", "--team", team, "--team-root", teams, "--policies",
                                   policies], capture_output=True, text=True, check=False)
            assert done.returncode == 0, done.stderr
        folder = teams / vision
        assert oct(folder.stat().st_mode)[-4:] == "2770" and oct((folder / "dvc").stat().st_mode)[-4:] == "2770"

        # What a server of alice's gets: her teams' registries as git safe directories (root created them).
        gitconfig = root / f"{alice}.gitconfig"
        gitconfig.write_text(git_config_text([str(folder / "datasets.git")]))

        def as_user(user, *command):
            env = {**os.environ, **({"GIT_CONFIG_SYSTEM": str(gitconfig)} if user == alice else {})}
            return subprocess.run(["runuser", "-u", unix_user(user), "--", *map(str, command)], capture_output=True,
                                  text=True, check=False, cwd="/tmp", env=env)

        assert as_user(alice, "touch", folder / "dvc" / "pushed-by-alice").returncode == 0
        assert as_user(alice, "git", "clone", "--quiet", folder / "datasets.git", f"/tmp/{alice}-clone").returncode == 0
        for command in (["ls", folder], ["ls", folder / "dvc"], ["cat", folder / "datasets.git" / "HEAD"],
                        ["touch", folder / "dvc" / "intruder"], ["git", "clone", folder / "datasets.git", f"/tmp/{nadia}"]):
            denied = as_user(nadia, *command)
            assert denied.returncode != 0, command
            assert "Permission denied" in denied.stderr or "does not exist" in denied.stderr, denied.stderr
        assert as_user(nadia, "touch", teams / nlp / "dvc" / "ok").returncode == 0

        # A server of alice's pushes with the spawner's umask: what it creates, teammates may extend.
        from gpupool.spawner.local import LocalGPUSpawner

        spawner = LocalGPUSpawner(policy_dir=str(policies), state_dir=str(root / "state"), run_as="user",
                                  identity_record=str(record))
        spawner.user = type("UserDouble", (), {"name": alice, "groups": []})()  # a double of JupyterHub's User
        made = subprocess.run(["sh", "-c", f"umask; mkdir -p {folder}/dvc/files/md5/ab"], cwd="/tmp",
                              preexec_fn=spawner.make_preexec_fn(alice), capture_output=True, text=True, check=True)
        assert made.stdout.strip() == "0007"
        made_dir = folder / "dvc" / "files" / "md5" / "ab"
        assert oct(made_dir.stat().st_mode)[-4:] == "2770" and made_dir.stat().st_gid == grp.getgrnam(unix_group(vision)).gr_gid

        # The server's own DVC config: alice reads it, nadia cannot; what alice plants in it is not written through.
        spawner.user = type("UserDouble", (), {"name": alice, "groups": [type("G", (), {"name": vision})()]})()
        spawner.team_root = str(teams)
        spawner.server_config_root = str(root / "servers")
        spawner._apply_choice(spawner, {"profile": "cpu"})
        env = spawner.dataset_env()
        config = Path(env["DVC_GLOBAL_CONFIG_DIR"]) / "config"
        assert as_user(alice, "cat", config).stdout == config.read_text() and f'remote "{vision}"' in config.read_text()
        assert as_user(nadia, "cat", config).returncode != 0
        victim = root / "victim"
        victim.write_text("untouched")
        config.unlink()
        assert as_user(alice, "ln", "-s", victim, config).returncode == 0
        spawner.dataset_env()
        assert victim.read_text() == "untouched" and not config.is_symlink()

        # A racer who swaps in links the instant the folder is hers (another of her servers runs meanwhile) gets
        # no file of root's, at a server's start nor at a job's run (its private folder, the same writer).
        from gpupool.spawner.jobs.local import private_folder

        job = type("JobDouble", (), {"user": alice, "id": "0123456789ab"})()  # what private_folder reads of a Job
        for folder in (spawner.server_folder, private_folder(spawner, job)):
            shadow, passwd = root / f"shadow-{folder.name}", root / f"passwd-{folder.name}"
            for target in (shadow, passwd):
                target.write_text("root's")
            planted = []
            real_chown, real_fchown = os.chown, os.fchown

            def race(*args, real, folder=folder, shadow=shadow, passwd=passwd, planted=planted, **kwargs):
                real(*args, **kwargs)
                if not planted and folder.is_dir() and folder.stat().st_uid != 0:
                    swap = (f"rm -f {folder}/gitconfig && ln -s {shadow} {folder}/gitconfig && mv {folder}/dvc "
                            f"{folder}/old && mkdir {folder}/dvc && ln -s {passwd} {folder}/dvc/config")
                    done = as_user(alice, "sh", "-c", swap)
                    planted.append(done.returncode == 0 or done.stderr)

            monkeypatch.setattr(os, "chown", lambda *a, **k: race(*a, real=real_chown, **k))
            monkeypatch.setattr(os, "fchown", lambda *a, **k: race(*a, real=real_fchown, **k))
            spawner.dataset_env(folder)
            monkeypatch.undo()
            assert planted == [True], (folder, planted)
            for target in (shadow, passwd):
                assert target.stat().st_uid == 0 and target.stat().st_gid == 0, (folder, target)
    finally:
        for user in (alice, nadia):
            subprocess.run(["userdel", "--remove", unix_user(user)], capture_output=True, check=False)
        for group in (unix_group(vision), unix_group(nlp), unix_user(alice), unix_user(nadia)):
            subprocess.run(["groupdel", group], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(f"/tmp/{alice}-clone", ignore_errors=True)


# --- Kubernetes mode ----------------------------------------------------------------------------------------------


def test_the_pods_post_start_hook_writes_a_config_dvc_reads(tmp_path):
    """What the pod's postStart hook runs, run here with the pod's env: DVC then knows the team remote."""
    from gpupool.spawner.datasets import KUBE_POST_START, kube_env

    setup = server_datasets(load_policy(EXAMPLES_DIR), ["nlp"], "nlp", "/unused", secret_name="x-{team}")
    env = {**os.environ, **{k: v for k, v in kube_env(setup).items() if isinstance(v, str)}}
    env["DVC_GLOBAL_CONFIG_DIR"] = str(tmp_path / "dvc")  # the pod's /tmp/gpupool-dvc
    subprocess.run(KUBE_POST_START, env=env, check=True)
    assert (tmp_path / "dvc" / "config").read_text() == setup.dvc_config
    repo = tmp_path / "repo"
    repo.mkdir()
    run(env, "git", "init", "--quiet", cwd=repo)
    dvc(env, "init", "--quiet", cwd=repo)
    listed = dvc(env, "remote", "list", cwd=repo).stdout.split()
    assert listed == ["nlp", "s3://gpupool-nlp/dvc", "(default)"]
    assert dvc(env, "config", "core.remote", cwd=repo).stdout.strip() == "nlp"


def test_chart_makes_one_secret_per_team_and_wires_the_spawner_to_it(tmp_path):
    import base64

    import helm_python as helm

    out = subprocess.run([GPUPOOL, "render", "--policies", EXAMPLES_DIR, "--release", "pool", "--helm-values"],
                         capture_output=True, text=True, check=True).stdout
    values = yaml.safe_load(out)
    values["jupyterhub"]["enabled"] = False
    assert values["jupyterhub"]["hub"]["config"]["GPUKubeSpawner"]["dataset_secret_name"] == "pool-datasets-{team}"
    values["postgresql"] = {"host": "db", "existingSecret": "pg"}
    values["jupyterhub"]["hub"]["extraEnv"]["PGPASSWORD"] = {"valueFrom": {"secretKeyRef": {"name": "pg", "key": "password"}}}
    values["datasets"] = {"credentials": {"vision": {"accessKeyId": "VK", "secretAccessKey": "vs/+="}}}
    chart_dir = Path(__file__).resolve().parents[2] / "helm" / "gpupool"
    with helm.Chart.load(chart_dir) as chart:
        rendered = chart.render(values, name="pool", namespace="jhub", is_install=True)
    secrets = [d for path, text in rendered.items() if not path.endswith("NOTES.txt")
               for d in yaml.safe_load_all(text) if d and d["kind"] == "Secret"]
    (secret,) = [s for s in secrets if s["metadata"]["name"].startswith("pool-datasets-")]
    assert secret["metadata"]["name"] == "pool-datasets-vision" and secret["metadata"]["namespace"] == "jhub"
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {
        "AWS_ACCESS_KEY_ID": "VK", "AWS_SECRET_ACCESS_KEY": "vs/+="}
    values["datasets"] = {"credentials": {"Vision!": {"accessKeyId": "VK"}}}
    with helm.Chart.load(chart_dir) as chart, pytest.raises(helm.HelmValuesError) as refused:
        chart.render(values, name="pool", namespace="jhub", is_install=True)
    assert "'Vision!' does not match pattern" in str(refused.value) and "missing property 'secretAccessKey'" in str(
        refused.value)
