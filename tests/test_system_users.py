"""Run as root: hub users become system users, teams Unix groups, each team a group-private 2770 folder.

These tests create real (uniquely named) users and groups with useradd/groupadd and remove them again.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from gpupool.spawner.local import ensure_system_user, ensure_team_folder, runnable_by_others

pytestmark = pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd: creates real system users and groups",
)
log = logging.getLogger("test")


@pytest.fixture
def accounts():
    tag = uuid.uuid4().hex[:6]
    names = {"vision": f"gpv{tag}", "nlp": f"gpn{tag}", "alice": f"gpa{tag}", "nadia": f"gpd{tag}"}
    yield names
    for user in (names["alice"], names["nadia"]):
        subprocess.run(["userdel", "--remove", user], capture_output=True, check=False)
    for group in (names["vision"], names["nlp"]):
        subprocess.run(["groupdel", group], capture_output=True, check=False)


def as_user(user: str, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user, "--", *command], capture_output=True, text=True, check=False)


def test_users_groups_and_team_folders(accounts):
    vision, nlp, alice, nadia = accounts["vision"], accounts["nlp"], accounts["alice"], accounts["nadia"]
    ensure_system_user(alice, [vision], log)
    ensure_system_user(nadia, [nlp], log)
    ensure_system_user(alice, [vision], log)  # idempotent
    assert pwd.getpwnam(alice).pw_dir == f"/home/{alice}"
    assert alice in grp.getgrnam(vision).gr_mem and nadia not in grp.getgrnam(vision).gr_mem

    root = Path(tempfile.mkdtemp(prefix="gpupool-teams-"))
    os.chmod(root, 0o755)
    try:
        folder = ensure_team_folder(root, vision, as_root=True)
        ensure_team_folder(root, nlp, as_root=True)
        mode = folder.stat().st_mode
        assert stat.S_IMODE(mode) == 0o2770 and folder.stat().st_gid == grp.getgrnam(vision).gr_gid

        assert as_user(alice, "touch", str(folder / "data.csv")).returncode == 0
        assert (folder / "data.csv").stat().st_gid == grp.getgrnam(vision).gr_gid, "setgid keeps the team group"
        denied_write = as_user(nadia, "touch", str(folder / "intruder"))
        assert denied_write.returncode != 0 and "Permission denied" in denied_write.stderr
        denied_read = as_user(nadia, "ls", str(folder))
        assert denied_read.returncode != 0
        assert as_user(nadia, "touch", str(root / nlp / "ok")).returncode == 0
    finally:
        shutil.rmtree(root)


def test_runnable_by_others(tmp_path):
    private = tmp_path / "private"
    private.mkdir()
    os.chmod(private, 0o700)
    tool = private / "tool"
    tool.write_text("")
    os.chmod(tool, 0o755)
    assert not runnable_by_others(tool)
    assert runnable_by_others(Path("/bin/sh"))
