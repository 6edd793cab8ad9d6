"""One distribution: the wheel holds every subpackage and the policy files; `import mlflow` stays MLflow."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the build backend comes from the test extra, so this works without a network.
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    (path,) = out.glob("gpupool-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_holds_every_subpackage_and_policy_file(wheel):
    names = set(wheel.namelist())
    for package in ("hub", "spawner", "policies"):
        assert f"gpupool/{package}/__init__.py" in names
    assert "gpupool/mlflow/run_context.py" in names
    migrations = ROOT / "hub" / "accounting" / "migrations"
    for migration in [*migrations.glob("*.py"), *migrations.glob("*.mako"), *(migrations / "versions").glob("*.py")]:
        assert f"gpupool/hub/accounting/{migration.relative_to(ROOT / 'hub' / 'accounting')}" in names
    assert "gpupool/mlflow/__init__.py" not in names
    for policy in (ROOT / "policies").glob("*.yaml"):
        assert f"gpupool/policies/{policy.name}" in names
    for policy in (ROOT / "policies" / "examples").glob("*.yaml"):
        assert f"gpupool/policies/examples/{policy.name}" in names
    # the page templates: the accounting pages' and gpupool's overrides of the hub's (its home page)
    templates = [*(ROOT / "hub" / "templates").glob("*.html"), *(ROOT / "hub" / "accounting" / "templates").glob("*.html")]
    for template in templates:
        assert f"gpupool/{template.relative_to(ROOT)}" in names
    assert "gpupool/hub/templates/home.html" in names and "gpupool/hub/services/templates/usage.html" in names
    assert not any(n.startswith(("mlflow/", "tests/", "hub/", "policies/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = wheel.read(entry_points).decode()
    assert "gpupool = gpupool.hub.cli:main" in text
    assert "gpupool = gpupool.mlflow.run_context:GPUPoolRunContext" in text


def test_mlflow_folder_has_no_init():
    assert not (ROOT / "mlflow" / "__init__.py").exists()


@pytest.mark.parametrize("code", ["import mlflow; print(mlflow.__file__)", "-m"])
def test_import_mlflow_from_the_repository_root_is_the_real_library(code):
    if code == "-m":
        command = [sys.executable, "-m", "mlflow", "--version"]
    else:
        command = [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    if code == "-m":
        assert "version" in result.stdout.lower()
    else:
        location = Path(result.stdout.strip())
        assert location.name == "__init__.py"
        assert location.parent != ROOT / "mlflow", f"the repository's mlflow/ shadows MLflow: {location}"
        assert "site-packages" in location.parts


def test_run_context_plugin_tags_runs_from_a_gpupool_server(monkeypatch):
    from mlflow.tracking.context.registry import resolve_tags

    monkeypatch.setenv("GPUPOOL_TEAM", "vision")
    monkeypatch.setenv("GPUPOOL_PROFILE", "h200-quarter")
    monkeypatch.setenv("GPUPOOL_GPU_MODEL", "H200")
    monkeypatch.setenv("GPUPOOL_SHARE", "1/4")
    monkeypatch.setenv("JUPYTERHUB_USER", "alice")
    tags = resolve_tags()
    assert {k: v for k, v in tags.items() if k.startswith("gpupool.")} == {
        "gpupool.user": "alice", "gpupool.team": "vision", "gpupool.profile": "h200-quarter",
        "gpupool.gpu_model": "H200", "gpupool.share": "1/4",
    }
    monkeypatch.delenv("GPUPOOL_TEAM")
    assert not any(k.startswith("gpupool.") for k in resolve_tags())


def test_editable_install_maps_every_subpackage():
    import gpupool.hub
    import gpupool.mlflow.run_context
    import gpupool.policies
    import gpupool.policies.resources
    import gpupool.spawner.pool

    assert Path(gpupool.hub.__file__) == ROOT / "hub" / "__init__.py"
    assert Path(gpupool.policies.__file__) == ROOT / "policies" / "__init__.py"
    assert Path(gpupool.policies.resources.__file__) == ROOT / "policies" / "resources.py"
    assert Path(gpupool.spawner.pool.__file__) == ROOT / "spawner" / "pool.py"
    assert Path(gpupool.mlflow.run_context.__file__) == ROOT / "mlflow" / "run_context.py"
