"""Each default location is defined once (`gpupool.policies.defaults`, the MLflow URL in `spawner/wiring.py`)
and every process that falls back to one falls back to the same place."""

from __future__ import annotations

import os
import re
from pathlib import Path

from traitlets.config import Config

from gpupool.hub.services import accounting_service as service
from gpupool.hub.config import PlatformSettings, apply_config
from gpupool.policies import DEFAULT_POLICY_DIR, defaults
from gpupool.spawner import volcano
from gpupool.spawner.local import LocalGPUSpawner
from gpupool.spawner.wiring import MLFLOW_PREFIX, mlflow_url

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted(f for folder in ("hub", "spawner", "policies", "mlflow", "bench")
                 for f in (ROOT / folder).rglob("*.py") if "__pycache__" not in f.parts)


def files_with(pattern: str) -> list[str]:
    return [str(f.relative_to(ROOT)) for f in SOURCES if re.search(pattern, f.read_text())]


def test_the_ledger_url_default_is_written_once():
    assert files_with(r"ledger\.sqlite") == ["policies/defaults.py"]


def test_the_state_folder_is_read_from_the_environment_in_one_place():
    assert files_with(r"""environ\.get\(\s*["']GPUPOOL_STATE_DIR["']|getenv\(\s*["']GPUPOOL_STATE_DIR""") == []
    assert files_with(r"""Path\(\s*["']state["']\s*\)""") == ["policies/defaults.py"]


def test_the_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUPOOL_STATE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert defaults.state_dir() == tmp_path / "state"
    assert defaults.state_dir({"GPUPOOL_STATE_DIR": "/var/lib/gpupool"}) == Path("/var/lib/gpupool")
    assert defaults.state_dir({"GPUPOOL_STATE_DIR": ""}) == tmp_path / "state"
    assert defaults.ledger_url("/var/lib/gpupool") == "sqlite:////var/lib/gpupool/ledger.sqlite"
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # servers run as their users: beside the 0700 state folder
    assert defaults.team_root("/var/lib/gpupool/state") == Path("/var/lib/gpupool/teams")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # every server runs as the hub's user: inside it
    assert defaults.team_root("/var/lib/gpupool/state") == Path("/var/lib/gpupool/state/teams")
    assert defaults.team_root("/s/state", servers_run_as_users=True) == Path("/s/teams")
    assert defaults.team_root("/s/state", servers_run_as_users=False) == Path("/s/state/teams")
    assert mlflow_url("http://127.0.0.1:8000/") == mlflow_url("http://127.0.0.1:8000") \
        == "http://127.0.0.1:8000/services/mlflow/"
    assert MLFLOW_PREFIX == "/services/mlflow/"


def test_the_hub_the_spawner_and_the_services_fall_back_alike(monkeypatch, tmp_path):
    for name in ("GPUPOOL_STATE_DIR", "GPUPOOL_LEDGER_URL", "GPUPOOL_TEAM_ROOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "state"
    settings = PlatformSettings.from_env()
    assert settings.state_dir == state
    assert settings.ledger_url == defaults.ledger_url(state)
    assert settings.team_root == str(defaults.team_root(state))
    assert settings.mlflow_url == "http://127.0.0.1:8000/services/mlflow/"
    spawner = LocalGPUSpawner(policy_dir=str(DEFAULT_POLICY_DIR))
    assert (spawner.state_dir, spawner.ledger_url) == (str(state), settings.ledger_url)
    assert spawner.team_root == str(defaults.team_root(state, servers_run_as_users=spawner.run_as == "user"))
    for run_as in ("user", "self"):
        assert LocalGPUSpawner(run_as=run_as, state_dir=str(state)).team_root == str(
            state.parent / "teams" if run_as == "user" else state / "teams")
    c = Config()
    apply_config(c, PlatformSettings(state_dir=state))
    (accounting,) = [s for s in c.JupyterHub.services if s["name"] == "accounting"]
    assert accounting["environment"]["GPUPOOL_LEDGER_URL"] == c.LocalGPUSpawner.ledger_url == settings.ledger_url
    assert accounting["environment"]["GPUPOOL_TEAM_ROOT"] == c.LocalGPUSpawner.team_root == settings.team_root
    assert c.LocalGPUSpawner.mlflow_url == settings.mlflow_url
    assert volcano.MLFLOW_URL == "http://proxy-public/services/mlflow/"


def test_the_accounting_service_falls_back_to_the_same_places(monkeypatch, tmp_path):
    """`python -m gpupool.hub.services.accounting_service` with no settings: the platform's ledger and team folders."""
    for name in ("GPUPOOL_STATE_DIR", "GPUPOOL_LEDGER_URL", "GPUPOOL_TEAM_ROOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    seen = {}

    class Stop(Exception):
        pass

    def make_app(ledger, policy_dir, prefix, team_root, *args):
        seen.update(ledger=ledger, team_root=team_root)
        raise Stop

    monkeypatch.setattr(service, "Ledger", lambda url: url)
    monkeypatch.setattr(service, "make_app", make_app)
    try:
        service.main([])
    except Stop:
        pass
    state = tmp_path / "state"
    assert seen == {"ledger": defaults.ledger_url(state), "team_root": str(defaults.team_root(state))}
