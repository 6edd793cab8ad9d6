"""JupyterHub's own suite is part of ours: its shipped spawner and named-server tests and the spawn and server
parts of its REST API tests, run with `LocalGPUSpawner` swapped in (the plugin `tests/jupyterhub_contract.py`,
which picks those parts of `test_api` and lists the differences that are gpupool's by design). A JupyterHub
upgrade that changes the spawner contract fails here, not for a user.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import jupyterhub
import psutil

from gpupool.hub.config import REPO_ROOT

#: `test_api` runs only its spawn and server tests (`API_SPAWN_AND_SERVER_TESTS` of the plugin deselects the rest).
MODULES = ("jupyterhub.tests.test_spawner", "jupyterhub.tests.test_named_servers", "jupyterhub.tests.test_api")


def run_jupyterhub_tests(folder: Path, *modules: str, select: str = "") -> tuple[subprocess.CompletedProcess, list]:
    """JupyterHub's test `modules` with the contract plugin, in a pytest of their own; (process, failures)."""
    env = dict(os.environ)
    # The hub's proxy and `jupyterhub-singleuser` as JupyterHub's tests expect them: on PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), str(REPO_ROOT / "node_modules" / ".bin"),
                                   env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    env["GPUPOOL_CONTRACT_ROOT"] = str(folder / "gpupool")
    report = folder / "junit.xml"
    command = [
        sys.executable, "-m", "pytest", "-p", "jupyterhub_contract", "-p", "no:cacheprovider",
        "--rootdir", str(folder), "-c", os.devnull, "-q", "-rfE", f"--junitxml={report}",
        # JupyterHub's own pytest settings (its pyproject.toml is not shipped with the package).
        "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=module",
        "-o", "asyncio_default_test_loop_scope=module", "-W", "ignore::pytest.PytestUnknownMarkWarning",
        "-o", "junit_logging=all",  # the hub's log of a failed test, in the report
        *(["-k", select] if select else []), "--pyargs", *modules,
    ]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=2400)
    failures = []
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failures.append(f"{case.get('classname')}::{case.get('name')}")
    return done, failures


def end_exit_watchers(folder: Path) -> None:
    """JupyterHub's `test_popen_kwargs` starts a spawner on a mocked `Popen` whose process is PID 5 (a kernel thread
    here): the exit watcher `LocalGPUSpawner` starts for it (`spawner.local.watch_exit`, whose record is in this run's
    folder) would wait for it as long as the machine runs. Its process group ends with the run."""
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if "gpupool-exit-watch" in command and any(str(folder) in part for part in command):
            try:
                os.killpg(os.getpgid(process.pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_jupyterhub_spawner_named_servers_and_api_tests_pass_with_local_gpu_spawner(tmp_path):
    try:
        done, failures = run_jupyterhub_tests(tmp_path, *MODULES)
    finally:
        end_exit_watchers(tmp_path)
    summary = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0 and not failures, (
        f"JupyterHub {jupyterhub.__version__}'s tests failed with LocalGPUSpawner: {failures}\n{summary}"
    )
