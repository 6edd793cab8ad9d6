"""The spawn form and the server-side checks of `LocalGPUSpawner`, on a spawner object of its own."""

from __future__ import annotations

import pytest
from tornado import web

from gpupool.policies import DEFAULT_POLICY_DIR
from gpupool.spawner.local import LocalGPUSpawner


class UserDouble:
    """A test double of JupyterHub's User wrapper: only the name and groups the mixin reads."""

    def __init__(self, name, groups):
        self.name = name
        self.groups = [type("Group", (), {"name": g})() for g in groups]
        self.url = f"/user/{name}/"


def spawner_for(name, groups) -> LocalGPUSpawner:
    spawner = LocalGPUSpawner(policy_dir=str(DEFAULT_POLICY_DIR), state_dir="/nonexistent")
    spawner.user = UserDouble(name, groups)
    return spawner


def test_form_lists_only_the_profiles_of_the_users_teams():
    form = spawner_for("nadia", ["nlp", "unrelated-group"])._render_form(spawner_for("nadia", ["nlp"]))
    assert "0.25 × H200" in form and "MIG 1g.18gb" in form and "CPU only" in form
    assert "0.5 × H200" not in form and "1 × H200" not in form  # vision only
    assert 'value="cpu" checked' in form


def test_form_for_a_user_in_no_team_says_how_to_join():
    spawner = spawner_for("zoe", [])
    form = spawner._render_form(spawner)
    assert "gpupool team add-member TEAM zoe" in form and "Ask an administrator" in form
    # An admin is not sent to ask an administrator: told what an admin does.
    spawner.user.admin = True
    form = spawner._render_form(spawner)
    assert "You are an administrator" in form and "gpupool team add-member TEAM zoe" in form, form
    assert "Ask an administrator" not in form


def test_form_data_becomes_options_and_is_checked():
    spawner = spawner_for("alice", ["vision"])
    options = spawner.options_from_form({"profile": ["h200-half"]})
    assert options == {"profile": "h200-half"}
    choice = spawner.check_user_options(options)
    assert (choice.slug, choice.team) == ("h200-half", "vision")
    assert spawner.check_user_options({}).slug == "cpu"  # the policy's default profile


@pytest.mark.parametrize("options", [{"profile": ["h200-half"]}, {"profile": 3}, {"profile": "H200-QUARTER"},
                                     {"profile": "h200-quarter "}, {"image": "x"}, "h200-quarter"])
def test_wrong_types_and_near_misses_are_refused(options):
    with pytest.raises(web.HTTPError) as refused:
        spawner_for("alice", ["vision"]).check_user_options(options)
    assert refused.value.status_code == 400


def test_apply_choice_extends_start_timeout_by_the_queue_timeout():
    spawner = spawner_for("alice", ["vision"])
    base = spawner.start_timeout
    spawner._apply_choice(spawner, {"profile": "h200-quarter"})
    spawner._apply_choice(spawner, {"profile": "h200-quarter"})  # twice: not added twice
    assert spawner.start_timeout == base + 3600
    assert spawner.mem_limit == 32 * 2**30 and spawner.cpu_limit == 8.0  # 32Gi, 8 CPUs


@pytest.mark.parametrize("name, why", [("vision", "team's name"), ("Alice", "not accepted"), ("-rf", "not accepted"),
                                       ("a.b", "not accepted")])
def test_no_server_starts_for_a_name_outside_the_identity_rule(name, why):
    """A user made before the rule (or by another authenticator) is refused by the spawner, saying why."""
    spawner = spawner_for(name, ["nlp"])
    with pytest.raises(web.HTTPError) as refused:
        spawner._apply_choice(spawner, {})
    assert refused.value.status_code == 403 and why in refused.value.log_message
