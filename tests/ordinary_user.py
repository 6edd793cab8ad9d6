"""The ordinary Unix user that runs a hub in the tests that try gpupool as a non-root person would.

A support module, imported by name (pytest's ``pythonpath = tests``): test modules never import one another,
since ``--import-mode=importlib`` gives them no importable names.
"""
from __future__ import annotations

import os
import pwd
import subprocess

from harness import platform_command

#: The account made (as root) for the journey's and the named servers' hubs run by an ordinary user.
ORDINARY_USER = "gpjourney"


def ordinary_user() -> tuple[str, str | None]:
    """The ordinary Unix user that runs the hub (created when missing); why it cannot, when it cannot."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid()).pw_name, None  # the tests themselves run as an ordinary user
    try:
        pwd.getpwnam(ORDINARY_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", ORDINARY_USER], check=True)
    account = pwd.getpwnam(ORDINARY_USER)
    try:
        done = subprocess.run([str(platform_command(ORDINARY_USER)), "--version"], user=account.pw_uid, group=account.pw_gid,
                              extra_groups=[], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "HOME": account.pw_dir})
        problem = None if done.returncode == 0 else (done.stderr or done.stdout).strip()[-500:]
    except OSError as error:
        problem = str(error)
    if problem:
        return ORDINARY_USER, (
            f"the platform installed for every user cannot be run by an ordinary user: "
            f"`{platform_command(ORDINARY_USER)} --version` as {ORDINARY_USER} fails ({problem}); `make install` "
            "as root builds it (/opt/gpupool/env, issue 12 item 2)")
    return ORDINARY_USER, None
