"""The `gpupool` command as an admin runs it: from any folder, against the running platform `gpupool up` recorded.

A real hub (`tests/harness.py`); the command runs as a subprocess in a folder that is neither the state folder
nor its parent, without --state-dir.
"""

from __future__ import annotations

import json
import os
import re
import stat
from datetime import UTC, datetime
from fractions import Fraction

import pytest
import requests

from gpupool.hub.accounting.ledger import Ledger
from harness import Hub, wait_for

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


def test_an_approved_sign_up_joins_a_team_and_leads_it_before_logging_in(hub, elsewhere):
    """Issue 33 items 4 and 5: sign up, the admin approves at /hub/authorize (as their browser does), and
    `gpupool team add-member` puts the person in the team before their first login; named a lead in the policy
    files while in the team by its hub group alone, they are its lead once the hot reload takes the change."""
    def gpupool(*args):
        return hub.cli(*args, cwd=elsewhere)

    password = "erin-is-signing-up"
    signup = requests.Session()
    signup.get(f"{hub.url}/hub/signup", timeout=30)
    reply = signup.post(f"{hub.url}/hub/signup", timeout=60, data={
        "username": "erin", "signup_password": password, "signup_password_confirmation": password,
        "_xsrf": signup.cookies.get("_xsrf", "")})
    assert reply.status_code == 200 and "has been sent to the admin" in reply.text, reply.text[-2000:]
    pending = gpupool("team", "add-member", "vision", "erin")
    assert pending.returncode == 1 and "no user 'erin' on the hub" in pending.stderr, pending.stderr
    assert "approves them at /hub/authorize" in pending.stderr, "the refusal names the way out"

    admin = hub.log_in("admin", hub.admin_password())
    # approving changes who may log in: a GET (a link, an image another site shows the admin) changes nothing,
    # and a POST without the page's _xsrf token is refused
    link = admin.get(f"{hub.url}/hub/authorize/erin", timeout=60)
    assert link.status_code == 405 and "use the buttons on /hub/authorize" in link.text, link.text[-2000:]
    forged = admin.post(f"{hub.url}/hub/authorize/erin", timeout=60)
    assert forged.status_code == 403, forged.text[-2000:]
    assert admin.get(f"{hub.url}/hub/discard/erin", timeout=60).status_code == 405
    assert gpupool("team", "add-member", "vision", "erin").returncode == 1, "still not approved"
    approved = hub.approve(admin, "erin")
    assert approved.status_code == 200 and "erin" in approved.text
    added = gpupool("team", "add-member", "vision", "erin")
    assert added.returncode == 0 and "erin is now a member of team vision" in added.stdout, added.stderr
    assert "erin" in hub.api("GET", "/groups/vision").json()["users"]

    policy = hub.policies / "policy.yaml"
    valid = policy.read_text()
    try:
        policy.write_text(valid.replace("vision: {members: []}", "vision: {members: [], leads: [erin, erni]}"))
        checked = gpupool("policy", "check")
        assert checked.returncode == 0, checked.stderr
        assert f"OK {hub.policies}" in checked.stdout and "in force on the platform" in checked.stdout
        assert "teams.vision.leads: 'erni' is in neither the team's members nor its hub group" in checked.stderr
        assert "'erin'" not in checked.stderr
        erin = hub.log_in("erin", password)  # her first login
        token = {"Authorization": f"token {hub.user_token('erin')}"}
        bill = f"{hub.url}/services/accounting/api/teams/vision/bill?format=json"
        wait_for(lambda: requests.get(bill, headers=token, timeout=30).status_code == 200, timeout=60,
                 message="erin, a lead by the hub group, sees her team's bill")
        assert requests.get(bill.replace("vision", "robotics"), headers=token, timeout=30).status_code == 404

        # A refused change: said on the hub's pages to admins (file and line), by `policy check`, by `team …`.
        policy.write_text(valid.replace("vision: {members: []}", "vision: {members: [], priority: -3}"))
        line = next(i for i, text in enumerate(policy.read_text().splitlines(), 1) if "priority: -3" in text)
        where = f"{policy}:{line}:"
        checked = gpupool("policy", "check")
        assert checked.returncode == 1 and where in checked.stderr and "negative number" in checked.stderr
        assert "refuses this change and keeps its previous policy" in checked.stderr
        listed = gpupool("team", "list")
        assert listed.returncode == 0 and where in listed.stderr and "keeps the previous one" in listed.stderr
        for page in ("admin", "home", "authorize"):
            shown = wait_for(lambda: (lambda text: text if "gpupool-policy-refused" in text else None)(
                admin.get(f"{hub.url}/hub/{page}", timeout=30).text), timeout=60, message=f"the banner on /hub/{page}")
            assert where in shown and "negative number" in shown and "keeps the previous policy" in shown
        assert "gpupool-policy-refused" not in erin.get(f"{hub.url}/hub/home", timeout=30).text, "admins only"
    finally:
        policy.write_text(valid)
    assert gpupool("policy", "check").returncode == 0
    assert "gpupool-policy-refused" not in admin.get(f"{hub.url}/hub/admin", timeout=30).text
    assert gpupool("team", "remove-member", "vision", "erin").returncode == 0


def test_jobs_need_no_token_on_the_hubs_machine_for_the_account_that_runs_it(hub, elsewhere):
    """Issue 33 item 13: `gpupool jobs` finds the hub and acts as its admin like `gpupool team` does, with a token
    made for the command and deleted after it; anyone else on the machine cannot read what it uses."""
    listed = hub.cli("jobs", "list", cwd=elsewhere)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == "no jobs" or listed.stdout.startswith("JOB")
    missing = hub.cli("jobs", "show", "0123456789ab", cwd=elsewhere)
    assert missing.returncode == 1 and "no job '0123456789ab'" in missing.stderr, missing.stderr
    tokens = hub.api("GET", "/users/admin/tokens").json()["api_tokens"]
    assert not [t for t in tokens if "gpupool jobs" in (t.get("note") or "")], "the command's token is deleted"

    # Least privilege: the cli-token is the hub account's alone; another account is sent to its own token.
    assert stat.S_IMODE(os.stat(hub.state).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(hub.state / "cli-token").st_mode) == 0o600
    if os.geteuid() != 0:
        return
    done = _as_nobody(["jobs", "list", "--state-dir", str(hub.state)])
    assert done[0] == 1 and "another account's" in done[1] and "use your own token: --token" in done[1], done


def _as_nobody(argv: list[str]) -> tuple[int, str]:
    """`gpupool ARGV` as the account `nobody`: in a child of this process (this environment's interpreter lies
    in root's home, which other accounts cannot run), with nothing of root's left but the code already loaded."""
    import pwd
    import sys

    import gpupool.hub.cli
    import gpupool.hub.lifecycle
    import gpupool.hub.up  # noqa: F401  (loaded before the child drops root: it could not read them after)

    account = pwd.getpwnam("nobody")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        code = 2
        try:
            os.close(read)
            sys.stderr = os.fdopen(write, "w")  # pytest's capture holds the real one
            os.setgroups([])
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
            os.environ.pop("JUPYTERHUB_API_TOKEN", None)
            code = gpupool.hub.cli.main(argv)
        except BaseException as error:  # noqa: BLE001 - the parent reads what happened
            print(repr(error), file=sys.stderr)
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as out:
        text = out.read()
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), text
