"""Team datasets' checks that need no server: the policy's roots and remotes, what a server is given (embedded
and Kubernetes), the registry's checks of `.dvc` files, tags and repository configs, and the `gpupool datasets`
command's refusals. The real `dvc` against servers, team folders and SeaweedFS: tests/e2e/test_datasets.py.
"""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
import yaml
from configobj import ConfigObj

from gpupool.hub.cli import main as gpupool_main
from gpupool.hub.datasets import (
    DatasetError, check_source, collect_datasets, dataset_output, repository_config_problems,
)
from gpupool.policies import EXAMPLES_DIR, PolicyError, load_policy
from gpupool.spawner.datasets import check_inside_root, server_datasets

POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}\n"
                 "inventory:\n  - {model: H200, count: 1}\n",
    "teams.yaml": "teams:\n  vision: {priority: 100}\n  nlp: {priority: 50}\n",
    "profiles.yaml": "profiles:\n  cpu: {display_name: CPU only, teams: [vision, nlp], default: true}\n",
}


def policy_dir(tmp_path: Path, extra: dict[str, str]) -> Path:
    directory = tmp_path / "policies"
    directory.mkdir()
    for name, text in {**POLICY, **extra}.items():
        (directory / name).write_text(text)
    return directory


# --- policy -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("teams", "expected"), [
    ("vision: {datasets: {remote: ../nlp/dvc}}", "outside the team's root"),
    ("vision: {datasets: {remote: /srv/other}}", "outside the team's root"),
    ("vision: {datasets: {remote: 's3://gpupool-nlp/dvc'}}", "outside the team's root"),
    ("vision: {datasets: {root: 'https://example.org/x'}}", "not an S3 URL"),
    ("vision: {datasets: {root: 's3://Bad_Bucket'}}", "not an S3 bucket name"),
    ("vision: {datasets: {root: 's3://data/../nlp'}}", "outside the team's root"),
])
def test_policy_refuses_remotes_outside_the_team_root(tmp_path, teams, expected):
    directory = policy_dir(tmp_path, {"teams.yaml": f"teams:\n  {teams}\n  nlp: {{priority: 50}}\n"})
    with pytest.raises(PolicyError) as refused:
        load_policy(directory)
    (problem,) = refused.value.problems
    assert expected in problem.message and problem.file.endswith("teams.yaml") and problem.line == 2
    assert problem.path[:3] == ("teams", "vision", "datasets")


def test_policy_refuses_a_team_root_inside_another_teams_root(tmp_path):
    directory = policy_dir(tmp_path, {
        "datasets.yaml": "datasets: {storage: s3}\n",
        "teams.yaml": "teams:\n  vision: {datasets: {root: 's3://data/vision'}}\n"
                      "  nlp: {datasets: {root: 's3://data'}}\n",
    })
    with pytest.raises(PolicyError) as refused:
        load_policy(directory)
    (problem,) = refused.value.problems
    assert "lies inside the root of team 'nlp'" in problem.message and problem.line == 2


def test_check_inside_root():
    check_inside_root("s3://data/vision/dvc", "s3://data/vision")
    check_inside_root("/srv/teams/vision/dvc", "/srv/teams/vision")
    for url, root in [("s3://data/visionx", "s3://data/vision"), ("s3://other/vision", "s3://data/vision"),
                      ("/srv/teams/vision/../nlp", "/srv/teams/vision"), ("/srv/teams/visionx", "/srv/teams/vision"),
                      ("relative/dvc", "/srv/teams/vision"), ("/srv/teams/vision/dvc", "s3://data/vision"),
                      ("ssh://host/srv/teams/vision", "/srv/teams/vision")]:
        with pytest.raises(ValueError, match="outside the team's root"):
            check_inside_root(url, root)


# --- what a server gets (pure) ---------------------------------------------------------------------------------


def test_embedded_server_gets_every_team_remote_with_profiles_and_no_keys_in_the_dvc_config(tmp_path):
    policy = load_policy(policy_dir(tmp_path, {"datasets.yaml": "datasets: {storage: s3, s3: "
                                               "{endpoint_url: 'http://127.0.0.1:1'}}\n"}))
    keys = {"vision": {"aws_access_key_id": "VK", "aws_secret_access_key": "vs"},
            "nlp": {"aws_access_key_id": "NK", "aws_secret_access_key": "ns"}}
    setup = server_datasets(policy, ["vision", "nlp"], "nlp", "/unused", credentials=keys)
    config = ConfigObj(setup.dvc_config.splitlines())
    assert config["core"] == {"remote": "nlp"}
    assert config['remote "vision"'] == {"url": "s3://gpupool-vision/dvc", "endpointurl": "http://127.0.0.1:1",
                                         "profile": "gpupool-vision"}
    assert config['remote "nlp"']["url"] == "s3://gpupool-nlp/dvc"
    assert "VK" not in setup.dvc_config and "vs" not in setup.dvc_config
    credentials = configparser.ConfigParser()
    credentials.read_string(setup.credentials)
    assert dict(credentials["gpupool-vision"]) == keys["vision"] and set(credentials.sections()) == {
        "gpupool-vision", "gpupool-nlp"}
    alone = server_datasets(policy, ["nlp"], "nlp", "/unused", credentials=keys)
    assert "VK" not in alone.credentials and 'remote "vision"' not in alone.dvc_config


def test_kubernetes_server_gets_its_teams_secret_as_env_and_no_keys():
    policy = load_policy(EXAMPLES_DIR)
    setup = server_datasets(policy, ["vision", "nlp"], "vision", "/unused", secret_name="rel-datasets-{team}")
    assert setup.credentials == ""
    assert setup.env == {
        "AWS_ACCESS_KEY_ID": {"valueFrom": {"secretKeyRef": {"name": "rel-datasets-vision", "key": "AWS_ACCESS_KEY_ID"}}},
        "AWS_SECRET_ACCESS_KEY": {"valueFrom": {"secretKeyRef": {"name": "rel-datasets-vision",
                                                                  "key": "AWS_SECRET_ACCESS_KEY"}}},
    }
    config = ConfigObj(setup.dvc_config.splitlines())
    assert config["core"] == {"remote": "vision"}
    assert config['remote "vision"'] == {"url": "s3://gpupool-vision/dvc", "endpointurl": "https://s3.example.org"}
    assert 'remote "nlp"' not in config  # the pod holds the vision Secret only


# --- the registry's checks (pure) -------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "expected"), [
    ("../../etc", "escapes the repository"), ("/etc/passwd", "escapes the repository"),
    ("cats/../../x", "escapes the repository"), ("C:/x", "escapes the repository"), ("dogs", "own folder"),
])
def test_dvc_file_whose_output_escapes_is_refused(path, expected):
    with pytest.raises(DatasetError, match=expected):
        dataset_output(yaml.safe_dump({"outs": [{"md5": "x.dir", "path": path}]}), "cats")


def test_listing_refuses_bad_versions_and_keeps_good_ones():
    files = {("cats@v1", "cats.dvc"): "outs:\n- {md5: a.dir, size: 10, nfiles: 2, path: cats}\n",
             ("cats@v2", "cats.dvc"): "outs:\n- {md5: b.dir, path: ../../../home}\n"}
    listing = collect_datasets([("cats@v1", "c1", "2026-01-01"), ("cats@v2", "c2", "2026-01-02"),
                                ("release-1", "c3", "2026-01-03")], lambda rev, path: files.get((rev, path)))
    ((dataset,),) = [listing.datasets]
    assert [(v.version, v.size, v.files) for v in dataset.versions] == [("v1", 10, 2)]
    (problem,) = listing.problems
    assert problem.startswith("tag cats@v2: ") and "escapes the repository" in problem


def test_repository_config_with_credentials_or_foreign_remote_is_refused():
    problems = repository_config_problems(
        {"core": {"remote": "vision"}, 'remote "vision"': {"url": "s3://gpupool-nlp/dvc", "secret_access_key": "x"}},
        "s3://gpupool-vision")
    assert len(problems) == 2
    assert any("secret_access_key" in p and "never in a repository" in p for p in problems)
    assert any("outside the team's root" in p for p in problems)


def test_symlinked_source_directories_are_refused(tmp_path):
    real = tmp_path / "real"
    (real / "inner").mkdir(parents=True)
    (real / "inner" / "a.txt").write_text("a")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(DatasetError, match="is a symbolic link"):
        check_source(tmp_path / "link")
    (real / "escape").symlink_to("/etc")
    with pytest.raises(DatasetError, match="symlinked directory inside the dataset"):
        check_source(real)
    with pytest.raises(DatasetError, match="does not exist"):
        check_source(tmp_path / "missing")


@pytest.mark.parametrize(("argv", "expected"), [
    (["datasets", "list", "--team", "robotics"], "unknown team 'robotics' (teams: vision, nlp)"),
    (["datasets", "init", "--team", "vision", "--remote", "{root}/nlp/dvc"], "outside the team's root"),
    (["datasets", "init", "--team", "vision", "--remote", "s3://gpupool-vision/dvc"], "outside the team's root"),
    (["datasets", "list", "--team", "vision"], "no dataset registry at"),
    (["datasets", "add", "--team", "vision", "Cats!", "{root}", "--version", "v1"], "dataset name 'Cats!' refused"),
    (["datasets", "add", "--team", "vision", "cats", "{root}", "--version", "v 1"], "version 'v 1' refused"),
])
def test_bad_input_is_refused_and_changes_nothing(tmp_path, capsys, argv, expected):
    root = tmp_path / "teams"
    argv = [a.replace("{root}", str(root)) for a in argv]
    code = gpupool_main([*argv, "--team-root", str(root), "--policies", str(policy_dir(tmp_path, {}))])
    assert code == 1
    assert expected in capsys.readouterr().err
    assert not (root / "vision" / "datasets.git").exists()
