"""Tools other JupyterHub deployments rely on are in the hub's environment, callable the way their READMEs say."""

from __future__ import annotations

import subprocess
import sys


def test_the_idle_culler_runs_as_its_readme_says():
    # jupyterhub-idle-culler's README: "command": [sys.executable, "-m", "jupyterhub_idle_culler", "--timeout=3600"]
    done = subprocess.run([sys.executable, "-m", "jupyterhub_idle_culler", "--help"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "--timeout" in done.stdout
