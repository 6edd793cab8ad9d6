"""The one identity rule (gpupool.policies.identity): normal form, pattern, reserved and confusable names."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kubespawner.slugs import is_valid_label, safe_slug

from gpupool.policies.identity import (
    MAX_UNIX_NAME, MAX_USERNAME, new_username_problem, normalize_username, server_username_problem, skeleton,
    unix_group, unix_user, username_problem,
)

valid_names = st.from_regex(r"[a-z](?:-?[a-z0-9]){0,14}", fullmatch=True)


@pytest.mark.parametrize("raw, normal", [
    ("Alice", "alice"), ("ALICE", "alice"), ("ａｌｉｃｅ", "alice"), ("ﬁona", "fiona"), ("Straße", "strasse"),
    ("alice", "alice"),
])
def test_names_are_case_folded_and_nfkc(raw, normal):
    assert normalize_username(raw) == normal


@pytest.mark.parametrize("name", [
    "аlice",  # Cyrillic а
    "-rf", "--help", "a.b", "alice.", "a b", "a/b", "a--b", "alice-", "1alice", "_x", "a_b", "", "x" * 30,
    "alice\n", "ali\u200bce", "..", "a;b",
])
def test_names_outside_the_pattern_are_refused_with_the_rule(name):
    problem = username_problem(normalize_username(name))
    assert problem is not None and ("lower-case letters" in problem or "required" in problem), problem


@pytest.mark.parametrize("name, why", [
    ("vision", "team's name"), ("postgres", "reserved"), ("root", "reserved"), ("admin", "reserved"),
    ("www-data", "reserved"), ("sysadmin", "administrator"), ("adm1n", "administrator"),
    ("a-lice", "existing user 'alice'"), ("al1ce", "existing user 'alice'"), ("v1sion", "team 'vision'"),
    ("daemon", "reserved"), ("ntp", "system account"),
])
def test_reserved_and_confusable_names_are_refused(name, why):
    problem = new_username_problem(name, existing={"alice", "bob"}, teams={"vision", "nlp"},
                                   system_accounts={"ntp"})
    assert problem is not None and why in problem


@pytest.mark.parametrize("typed", ["ava", "AVA", "ａｖａ"])
def test_an_existing_name_is_never_a_new_one_however_written(typed):
    problem = new_username_problem(normalize_username(typed), existing={"ava"})
    assert problem is not None and "'ava' is already in use" in problem


def test_ordinary_names_pass():
    for name in ("carol", "ana-maria", "bob2", "x", "q0"):
        assert new_username_problem(name, existing={"alice", "bob"}, teams={"vision", "nlp"}) is None


@given(valid_names)
def test_every_accepted_name_is_its_own_slug_label_path_segment_and_unix_name(name):
    assert username_problem(name) is None
    assert normalize_username(name) == name
    assert safe_slug(name) == name and is_valid_label(name)  # KubeSpawner keeps it as it is: one name in both modes
    assert "/" not in name and name not in (".", "..")
    assert re.fullmatch(r"[a-z_][a-z0-9_-]*", unix_user(name)) and len(unix_user(name)) <= MAX_UNIX_NAME


@given(st.text(max_size=40))
def test_any_text_is_refused_or_a_valid_name(text):
    name = normalize_username(text)
    if username_problem(name) is None:
        assert re.fullmatch(r"[a-z](?:-?[a-z0-9])*", name) and len(name) <= MAX_USERNAME
        assert name.isascii()


@given(valid_names, valid_names)
def test_user_accounts_never_meet_team_groups(user, team):
    assert unix_user(user) != unix_group(team)
    assert unix_user(user) != team and unix_group(team) != user  # and neither is a bare hub name


@given(valid_names)
def test_confusable_names_have_one_skeleton(name):
    assert skeleton(name) == skeleton(name.upper()) == skeleton(name.replace("l", "1"))


def test_spawners_refuse_a_user_named_like_a_team_or_outside_the_pattern():
    assert "team's name" in server_username_problem("vision", ["vision", "nlp"])
    assert server_username_problem("Alice", ["vision"]) is not None
    assert server_username_problem("alice", ["vision"]) is None


# --- a personal workstation: the hub of an ordinary Unix user has the admin alone (issue 33 item 2) -----------

POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}\ninventory:\n"
                 "  - {model: H200, count: 1}\n",
    "profiles.yaml": "profiles:\n  cpu: {display_name: CPU only, teams: [vision], default: true}\n",
}


def _settings(tmp_path, members: str = "[]"):
    from gpupool.hub.config import PlatformSettings

    policy = tmp_path / "policies"
    policy.mkdir(exist_ok=True)
    for name, text in {**POLICY, "teams.yaml": f"teams:\n  vision: {{members: {members}}}\n"}.items():
        (policy / name).write_text(text)
    return PlatformSettings(state_dir=tmp_path / "state", policy_dir=policy, personal=True)


def test_a_personal_workstation_lets_the_admin_alone_in(tmp_path):
    from traitlets.config import Config

    from gpupool.hub.config import apply_config

    c = Config()
    apply_config(c, _settings(tmp_path))
    assert c.GPUPoolNativeAuthenticator.personal_workstation is True
    assert c.Authenticator.allowed_users == {"admin"} and c.Authenticator.allow_all is False
    assert c.Authenticator.allow_existing_users is False


def test_the_mode_follows_the_unix_user_and_the_opt_in(monkeypatch):
    from gpupool.hub import config

    monkeypatch.setattr(config.os, "geteuid", lambda: 1000)
    assert config.personal_workstation({}) is True
    assert config.personal_workstation({config.UNSAFE_SHARED_AS_USER: "1"}) is False
    monkeypatch.setattr(config.os, "geteuid", lambda: 0)
    assert config.personal_workstation({}) is False


def test_a_personal_workstation_refuses_a_hub_that_knows_other_people(tmp_path):
    import sqlalchemy

    from gpupool.hub.config import workstation_problem

    settings = _settings(tmp_path)
    db = tmp_path / "jupyterhub.sqlite"
    url = f"sqlite:///{db}"
    assert workstation_problem(url, settings) is None and not db.exists()  # a first start: no database yet
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("CREATE TABLE users (name TEXT)"))
        conn.execute(sqlalchemy.text("CREATE TABLE users_info (username TEXT)"))
        conn.execute(sqlalchemy.text("INSERT INTO users VALUES ('admin'), ('ada')"))
        conn.execute(sqlalchemy.text("INSERT INTO users_info VALUES ('admin'), ('ben')"))
    engine.dispose()
    problem = workstation_problem(url, settings)
    assert problem is not None and "ada, ben" in problem and "--unsafe-shared-as-user" in problem
    assert "as root" in problem
    problem = workstation_problem(f"sqlite:///{tmp_path / 'none.sqlite'}", _settings(tmp_path, "[cleo]"))
    assert problem is not None and "cleo" in problem  # the policies' members would become hub users at start


def test_up_refuses_the_shared_as_user_opt_in_as_root(tmp_path):
    """As root the hub is shared safely already (each server as its own user): the flag would only mislead."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if os.geteuid() != 0:
        pytest.skip("needs root")
    done = subprocess.run([Path(sys.executable).parent / "gpupool", "up", "--unsafe-shared-as-user", "--state-dir",
                           str(tmp_path / "state")], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "leave the flag out" in done.stderr, done.stderr
    assert not (tmp_path / "state").exists()
