"""The `gpupool` command as an admin runs it: from any folder, against the running platform `gpupool up` recorded.

A real hub (`gpupool.hub.harness`); the command runs as a subprocess in a folder that is neither the state folder
nor its parent, without --state-dir.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from fractions import Fraction

import pytest

from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.harness import Hub

POLICY = {
    "policy.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 1}]
teams:
  vision: {members: []}
  robotics: {members: [carol]}
profiles:
  cpu: {display_name: CPU only, teams: [vision, robotics], default: true}
billing: {currency: USD, prices: {H200: '2.00'}}
""",
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub(tmp_path_factory.mktemp("cli"), POLICY, mlflow=False)
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture
def elsewhere(tmp_path):
    return tmp_path  # not the state folder, not its parent: nothing to find by relative path


def test_team_commands_find_the_running_platform_and_refuse_unknown_users(hub, elsewhere):
    def gpupool(*args):
        return hub.cli(*args, cwd=elsewhere)

    listed = gpupool("team", "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == ["robotics: carol", "vision: (no members)"]

    typo = gpupool("team", "add-member", "vision", "nosuchuser")
    assert typo.returncode == 1 and "no user 'nosuchuser' on the hub" in typo.stderr and "--create" in typo.stderr
    assert hub.api("GET", "/users/nosuchuser").status_code == 404, "a typo creates no user"

    created = gpupool("team", "add-member", "vision", "dave", "--create")
    assert created.returncode == 0, created.stderr
    assert "created the hub user dave" in created.stdout and "dave is now a member of team vision" in created.stdout
    assert gpupool("team", "add-member", "vision", "carol").returncode == 0
    assert gpupool("team", "list").stdout.splitlines() == ["robotics: carol", "vision: carol, dave"]

    no_team = gpupool("team", "add-member", "robotic", "carol")
    assert no_team.returncode == 1 and "no team 'robotic' on the hub" in no_team.stderr
    assert "known: robotics, vision" in no_team.stderr

    removed = gpupool("team", "remove-member", "vision", "carol")
    assert removed.returncode == 0 and "carol is no longer a member of team vision" in removed.stdout
    assert "carol" not in hub.api("GET", "/groups/vision").json()["users"]
    again = gpupool("team", "remove-member", "vision", "carol")
    assert again.returncode == 1 and "'carol' is not a member of team vision (members: dave)" in again.stderr
    from_policy = gpupool("team", "remove-member", "robotics", "carol")
    assert from_policy.returncode == 0 and "list carol as a member of robotics" in from_policy.stderr

    # --state-dir still wins.
    other = gpupool("team", "list", "--state-dir", str(elsewhere / "state"))
    assert other.returncode == 1 and f"no gpupool platform in {elsewhere / 'state'}" in other.stderr


def test_bill_uses_the_running_platforms_policies_and_ledger(hub, elsewhere):
    ledger = Ledger(hub.ledger_url)
    ledger.open_interval("r1", "carol", "robotics", "cpu", "H200", Fraction(1, 2),
                         datetime(2026, 11, 2, 8, tzinfo=UTC))
    ledger.close_interval("r1", datetime(2026, 11, 2, 12, tzinfo=UTC), "stopped")  # 4 h × 0.5 = 2 GPU-hours
    ledger.dispose()
    done = hub.cli("bill", "--team", "robotics", "--period", "2026-11", "--format", "json", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    bill = json.loads(done.stdout)
    assert bill["team"] == "robotics" and bill["currency"] == "USD" and bill["total"] == "4.00"


def test_make_links_the_gpupool_command_onto_a_folder_of_path(tmp_path):
    import subprocess
    from pathlib import Path

    import gpupool.hub

    checkout = Path(gpupool.hub.__file__).resolve().parent.parent
    made = subprocess.run(["make", "-s", "-C", str(checkout), "cli", f"CLI_DIR={tmp_path / 'bin'}",
                           "-o", ".venv/.gpupool-installed"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert "is not on PATH" in made.stdout, "make says when the folder is not on PATH"
    done = subprocess.run(["gpupool", "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.startswith("gpupool "), done.stderr
