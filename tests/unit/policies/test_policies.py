"""The policy loader: the shipped policy sets load, and broken files are refused with file:line and a reason."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool.hub.cli import main
from gpupool.policies import DEFAULT_POLICY_DIR, EXAMPLES_DIR, PolicyError, load_policy
from gpupool.policies.loader import load_policy_files

LOCATION = re.compile(r"^(?P<file>[^:\n]+\.yaml):(?P<line>\d+):(?P<column>\d+): ", re.M)


def test_default_policy_set():
    policy = load_policy(DEFAULT_POLICY_DIR)
    assert set(policy.teams) == {"vision", "nlp"}
    assert {p.display_name for p in policy.profiles.values()} == {
        "CPU only", "0.25 × H200", "0.5 × H200", "MIG 1g.18gb", "1 × H200",
    }
    assert [(d.model, d.count) for d in policy.inventory] == [("H200", 2)]
    assert policy.billing.prices == {"H200": Decimal("3.20")}
    assert policy.profiles["h200-quarter"].gpu.share == Fraction(1, 4)
    assert set(policy.profiles_for_teams({"nlp"})) == {"cpu", "h200-quarter", "h200-mig-1g"}


def test_example_policy_set_is_heterogeneous():
    policy = load_policy(EXAMPLES_DIR)
    assert {m.vendor for m in policy.models.values()} == {"nvidia", "hygon"}
    backends = {b for m in policy.models.values() for b in m.backends}
    assert backends == {"hami", "volcano-vgpu", "mig", "timeslice", "whole"}
    assert policy.teams["vision"].queue.parent == "research"


@pytest.mark.parametrize("directory", [DEFAULT_POLICY_DIR, EXAMPLES_DIR])
def test_cli_check_ok(directory, capsys):
    assert main(["policy", "check", str(directory)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "GPU models" in out and "profiles" in out and "teams" in out


def test_console_script_is_installed():
    result = subprocess.run(
        [Path(sys.executable).parent / "gpupool", "policy", "check", str(DEFAULT_POLICY_DIR)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OK ")


# Each case: (file to write or patch, content or (old, new) replacement, expected words in the message).
TEAMS = "teams.yaml"
PROFILES = "profiles.yaml"
GPUS = "gpus.yaml"
BILLING = "billing.yaml"
JOBS = "jobs.yaml"

BROKEN = {
    "duplicate key": (TEAMS, ("    priority: 100\n", "    priority: 100\n    priority: 5\n"), "duplicate key 'priority'"),
    "anchor bomb": ("bomb.yaml", "\n".join(
        ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
        + ["teams: *a8"]
    ), "alias bomb"),
    "python tag": ("evil.yaml", "settings: !!python/object/apply:os.system ['echo pwned']\n", "tag !!python/object"),
    "infinity": (TEAMS, ("gpu_hours: 500", "gpu_hours: .inf"), "not a finite number"),
    "nan": (TEAMS, ("gpu_hours: 500", "gpu_hours: .nan"), "not a finite number"),
    "negative budget": (TEAMS, ("gpu_hours: 500", "gpu_hours: -500"), "negative number"),
    "string for a number": (TEAMS, ("priority: 100", 'priority: "10h"'), "valid integer (got '10h')"),
    "budget as text": (TEAMS, ("gpu_hours: 500", "gpu_hours: 10h"), "not a decimal number"),
    "unknown key": (TEAMS, ("    priority: 100\n", "    priority: 100\n    colour: blue\n"),
                    "unknown key 'colour' (accepted: display_name"),
    "unknown model": (PROFILES, ("gpu: {model: H200, share: 0.5}", "gpu: {model: H300, share: 0.5}"),
                      "unknown GPU model 'H300' (known: H200)"),
    "MIG profile the model lacks": (PROFILES, ("mig: 1g.18gb", "mig: 1g.10gb"),
                                    "MIG profile 1g.10gb is not configured for H200"),
    "MIG profile that does not exist for the model": (GPUS, ("[1g.18gb, 2g.35gb", "[1g.18gb, 2g.20gb"),
                                                      "H200 has no MIG profile '2g.20gb'"),
    "queue cycle": (TEAMS, [("      weight: 2\n", "      weight: 2\n      parent: nlp\n"),
                            ("      weight: 1\n", "      weight: 1\n      parent: vision\n")],
                    "queue parents form a cycle: vision → nlp → vision"),
    "child deserved above its parent's": (
        TEAMS, [("      weight: 2\n", "      weight: 2\n      deserved: {nvidia.com/gpu: 1}\n"),
                ("      weight: 1\n", "      weight: 1\n      parent: vision\n      deserved: {nvidia.com/gpu: 2}\n")],
        "add up to more than parent queue 'vision' has in its deserved (nvidia.com/gpu: nlp 2 > vision 1)"),
    "child guarantee above its parent's": (
        TEAMS, ("      weight: 1\n", "      weight: 1\n      parent: vision\n      guarantee: {cpu: 4}\n"),
        "guarantees add up to more than parent queue 'vision' has in its guarantee (cpu: nlp 4 > vision none)"),
    "child capability above its parent's": (
        TEAMS, [("      weight: 2\n", "      weight: 2\n      capability: {cpu: 8}\n"),
                ("      weight: 1\n", "      weight: 1\n      parent: vision\n      capability: {cpu: 16}\n")],
        "capability above its parent queue 'vision''s (cpu: 16 > 8)"),
    "reserved team name": (TEAMS, ("  nlp:\n", "  kube-system:\n"), "reserved"),
    "non-DNS team name": (TEAMS, ("  nlp:\n", "  NLP_team:\n"), "not DNS-safe"),
    "negative price": (BILLING, ('H200: "3.20"', 'H200: "-3.20"'), "must not be negative"),
    "empty file": ("empty.yaml", "# nothing here\n", "file is empty"),
    "binary garbage": ("garbage.yaml", bytes(range(256)) * 4, "binary data"),
    "not UTF-8": ("latin1.yaml", "teams:\n  caf\xe9: {}\n".encode("latin-1"), "not UTF-8"),
    "share no backend can deliver": (PROFILES, ("share: 0.25", 'share: "1/3"'), "whole percents"),
    "share of a whole card": (PROFILES, ("share: 0.5", "share: 1.5"), "share must be below 1"),
    "profile for an unknown team": (PROFILES, ("teams: [vision]\n    images: *gpu-images\n\n  h200-mig",
                                               "teams: [robotics]\n    images: *gpu-images\n\n  h200-mig"),
                                    "unknown team 'robotics'"),
    "enum value": (TEAMS, ("on_exhausted: alert", "on_exhausted: ignore"), "'alert', 'deprioritize' or 'deny'"),
    "team defined twice": ("more-teams.yaml", "teams:\n  nlp:\n    priority: 1\n", "defined twice"),
    "invalid YAML": ("broken.yaml", "teams:\n  vision: [unclosed\n", "not valid YAML"),
    "merge key": ("merge.yaml", "x: &x {priority: 1}\nteams:\n  robotics:\n    <<: *x\n", "merge keys"),
    "named servers as text": (TEAMS, ("    priority: 100\n", '    priority: 100\n    named_servers: "3"\n'),
                              "valid integer (got '3')"),
    "negative named servers": (TEAMS, ("    priority: 100\n", "    priority: 100\n    named_servers: -1\n"),
                               "negative number"),
    "too many named servers": (TEAMS, ("    priority: 100\n", "    priority: 100\n    named_servers: 1000\n"),
                               "less than or equal to 100"),
    "sharing as text": (TEAMS, ("    priority: 100\n", '    priority: 100\n    sharing: "on"\n'), "valid boolean"),
    "job priority that does not exist": (TEAMS, ("    priority: 100\n", "    priority: 100\n    job_priorities: [urgent]\n"),
                                         "'low', 'normal' or 'high'"),
    "job priorities out of order": (JOBS, ("low: 0", "low: 15"), "must not decrease from low to normal to high"),
    "job priority offset missing": (JOBS, ("    high: 20\n", ""), "missing: high"),
    "exit code in both lists": (JOBS, ("always_retry_exit_codes: []", "always_retry_exit_codes: [2]"),
                                "exit codes [2] are both never-retry and always-retry"),
    "grace period of zero": (JOBS, ("grace_seconds: 60", "grace_seconds: 0"), "greater than or equal to 1"),
    "preemption by a kind that does not exist": (JOBS, ("by: [server, job]", "by: [server, admin]"),
                                                 "'server' or 'job'"),
}


def _broken_directory(tmp_path: Path, name: str) -> Path:
    directory = tmp_path / "policies"
    directory.mkdir()
    for file in DEFAULT_POLICY_DIR.glob("*.yaml"):
        shutil.copy(file, directory)
    target, change, _ = BROKEN[name]
    path = directory / target
    if isinstance(change, (tuple, list)):
        text = path.read_text()
        for old, new in [change] if isinstance(change, tuple) else change:
            assert old in text, f"test case {name!r} does not apply"
            text = text.replace(old, new, 1)
        path.write_text(text)
    elif isinstance(change, bytes):
        path.write_bytes(change)
    else:
        path.write_text(change)
    return directory


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_policy_is_refused_with_file_and_line(name, tmp_path, capsys):
    directory = _broken_directory(tmp_path, name)
    expected = BROKEN[name][2]
    with pytest.raises(PolicyError) as raised:
        load_policy(directory)
    assert expected in str(raised.value)

    assert main(["policy", "check", str(directory)]) != 0
    err = capsys.readouterr().err
    located = LOCATION.findall(err)
    assert located, err
    assert all(Path(file).parent == directory for file, _, _ in located)
    assert any(expected in line for line in err.splitlines() if LOCATION.match(line)), err


def test_error_points_at_the_offending_line(tmp_path):
    directory = _broken_directory(tmp_path, "string for a number")
    with pytest.raises(PolicyError) as raised:
        load_policy(directory)
    (problem,) = raised.value.problems
    text = (directory / TEAMS).read_text().splitlines()
    assert problem.file.endswith(TEAMS)
    assert text[problem.line - 1].strip() == 'priority: "10h"'
    assert problem.path == ("teams", "vision", "priority")


HIERARCHY = """\
teams:
  division:
    queue:
      deserved: {nvidia.com/gpu: 4, memory: 64Gi}
      guarantee: {nvidia.com/gpu: 1}
  alpha:
    queue:
      parent: division
      deserved: {nvidia.com/gpu: 2, memory: 32Gi}
      guarantee: {nvidia.com/gpu: 1}
  beta:
    queue:
      parent: division
      deserved: {nvidia.com/gpu: 1, memory: 32Gi}
"""


def _hierarchy(tmp_path: Path, text: str) -> Path:
    directory = tmp_path / "policies"
    directory.mkdir()
    (directory / "teams.yaml").write_text(text)
    return directory


def test_a_queue_tree_whose_parent_covers_its_children_is_accepted(tmp_path):
    policy = load_policy(_hierarchy(tmp_path, HIERARCHY))
    assert policy.teams["beta"].queue.parent == "division"


@pytest.mark.parametrize("change, field, expected", [
    # Each child fits alone; together they ask for 5 cards of the parent's 4.
    (("nvidia.com/gpu: 1, memory: 32Gi}", "nvidia.com/gpu: 3, memory: 32Gi}"), "deserved",
     "(nvidia.com/gpu: alpha 2 + beta 3 = 5 > division 4)"),
    # Volcano reads a child's deserved as max(deserved, guarantee): beta's guarantee of 3 counts as its deserved.
    (("nvidia.com/gpu: 1, memory: 32Gi}\n", "nvidia.com/gpu: 1, memory: 32Gi}\n      guarantee: {nvidia.com/gpu: 3}\n"),
     "deserved", "(nvidia.com/gpu: alpha 2 + beta 3 = 5 > division 4)"),
    (("memory: 64Gi}", "memory: 48Gi}"), "deserved", "(memory: alpha 32Gi + beta 32Gi = 64Gi > division 48Gi)"),
    (("memory: 64Gi}\n      guarantee: {nvidia.com/gpu: 1}\n", "memory: 64Gi}\n"), "guarantee",
     "(nvidia.com/gpu: alpha 1 > division none)"),
])
def test_a_queue_tree_whose_children_outgrow_their_parent_is_refused(tmp_path, capsys, change, field, expected):
    old, new = change
    assert HIERARCHY.count(old) == 1, "test case does not apply"
    directory = _hierarchy(tmp_path, HIERARCHY.replace(old, new))
    with pytest.raises(PolicyError) as raised:
        load_policy(directory)
    (problem,) = [p for p in raised.value.problems if expected in p.message]
    assert problem.path == ("teams", "division", "queue", field)
    # The problem points into the parent's queue in the file.
    lines = (directory / "teams.yaml").read_text().splitlines()
    assert lines.index("  division:") < problem.line - 1 < lines.index("  alpha:")
    assert main(["policy", "check", str(directory)]) != 0
    assert f"teams.yaml:{problem.line}:" in capsys.readouterr().err


def test_unknown_key_points_at_the_key(tmp_path):
    directory = _broken_directory(tmp_path, "unknown key")
    with pytest.raises(PolicyError) as raised:
        load_policy(directory)
    (problem,) = raised.value.problems
    line = (directory / TEAMS).read_text().splitlines()[problem.line - 1]
    assert line[problem.column - 1:].startswith("colour:")


def test_missing_directory_and_empty_directory(tmp_path):
    with pytest.raises(PolicyError, match="not a directory"):
        load_policy(tmp_path / "nope")
    with pytest.raises(PolicyError, match="no \\*.yaml policy files"):
        load_policy(tmp_path)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_any_bytes_either_load_or_give_located_problems(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "policy.yaml"
    path.write_bytes(data)
    try:
        load_policy_files([path])
    except PolicyError as error:
        assert error.problems
        assert all(p.file == str(path) and p.line >= 1 and p.column >= 1 for p in error.problems)


def test_a_lead_is_a_member_by_the_policy_or_by_the_hub_group(tmp_path):
    """Issue 33 item 5: a person `gpupool team add-member` put in the team's hub group can be named a lead; the
    files cannot see the groups, so the rule is applied where both are known, and a lead in neither is no lead."""
    (tmp_path / "policy.yaml").write_text(
        "teams:\n  vision: {members: [alice], leads: [alice, bob], reviewers: [bob]}\n  nlp: {leads: [bob]}\n")
    policy = load_policy_files([tmp_path / "policy.yaml"])
    assert policy.leads_of("alice") == ["vision"]
    assert policy.leads_of("bob") == [], "named a lead, in no team: no lead's rights"
    assert policy.leads_of("bob", ["vision"]) == ["vision"]
    assert policy.leads_of("bob", ["vision", "nlp"]) == ["vision", "nlp"]
    assert policy.leads_of("carol", ["vision"]) == []


def test_a_refused_hot_reload_says_why_until_the_files_are_fixed(tmp_path):
    from gpupool.policies.reload import current_policy, refused_change

    directory = tmp_path / "policies"
    shutil.copytree(DEFAULT_POLICY_DIR, directory, ignore=shutil.ignore_patterns("examples", "*.py", "__pycache__"))
    teams = directory / "teams.yaml"
    before = current_policy(directory)
    assert refused_change(directory) is None
    valid = teams.read_text()
    teams.write_text(valid.replace("priority: 100", "priority: -100", 1))
    assert current_policy(directory) is before, "an invalid edit never replaces the valid policy"
    refused = refused_change(directory)
    assert refused is not None and "negative number" in str(refused)
    (problem,) = refused.problems
    assert problem.file == str(teams) and valid.splitlines()[problem.line - 1].strip().startswith("priority: 100")
    teams.write_text(valid.replace("priority: 100", "priority: 90", 1))
    assert current_policy(directory).teams["vision"].priority == 90
    assert refused_change(directory) is None
