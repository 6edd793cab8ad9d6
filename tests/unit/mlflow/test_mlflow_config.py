"""How the embedded mode wires MLflow into the hub: the managed service, its role, the servers' environment."""

from __future__ import annotations

import os

from traitlets.config import Config

from gpupool.hub.config import PlatformSettings, apply_config
from gpupool.spawner.wiring import SERVER_TOKEN_SCOPES
from gpupool.spawner.mixin import GPUPoolSpawnerMixin, mlflow_env


def test_gpupool_up_runs_mlflow_behind_the_hub_with_state_in_the_state_folder(tmp_path):
    c = Config()
    apply_config(c, PlatformSettings(state_dir=tmp_path, port=9000))
    (service,) = [s for s in c.JupyterHub.services if s["name"] == "mlflow"]
    assert service["url"] == "http://127.0.0.1:9004"
    command = service["command"][service["command"].index("--") + 1:]  # under the lifecycle supervisor
    # MLflow's `mlflow server`, becoming its uvicorn (one process at rest, no waiting parent)
    assert command[1:5] == ["-m", "gpupool.hub.mlflow_server", "--app-name", "gpupool"]
    options = command
    assert service["environment"]["MLFLOW_BACKEND_STORE_URI"] == f"sqlite:///{tmp_path / 'mlflow.sqlite'}"
    assert options[options.index("--artifacts-destination") + 1] == str(tmp_path / "mlflow-artifacts")
    assert "--serve-artifacts" in options
    assert options[options.index("--static-prefix") + 1] == "/services/mlflow"
    assert options[options.index("--port") + 1] == "9004"
    # Only what gpupool serves runs (no job runner), and nothing phones home.
    assert service["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert service["environment"]["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert c.LocalGPUSpawner.mlflow_url == "http://127.0.0.1:9000/services/mlflow/"
    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert roles["gpupool-mlflow"]["scopes"] == [] and roles["gpupool-mlflow"]["services"] == ["mlflow"]
    assert "access:services!service=mlflow" in roles["user"]["scopes"]
    # On PostgreSQL when asked; its URL, which may hold a password, is never on a command line (`ps` shows those
    # to every user of the machine), only in the service's environment.
    c = Config()
    url = "postgresql+psycopg://u:secret-pw@db/mlflow"
    apply_config(c, PlatformSettings(state_dir=tmp_path, mlflow_backend_url=url))
    (service,) = [s for s in c.JupyterHub.services if s["name"] == "mlflow"]
    assert service["environment"]["MLFLOW_BACKEND_STORE_URI"] == url
    assert not [arg for s in c.JupyterHub.services for arg in s.get("command", []) if "secret-pw" in arg]


def test_a_servers_mlflow_environment_and_token_scopes():
    assert mlflow_env("http://hub/services/mlflow/", "tok", "vision") == {
        "MLFLOW_TRACKING_URI": "http://hub/services/mlflow", "MLFLOW_TRACKING_TOKEN": "tok",
        "MLFLOW_EXPERIMENT_NAME": "vision", "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    assert "MLFLOW_EXPERIMENT_NAME" not in mlflow_env("http://hub/services/mlflow/", "tok", None)
    # JupyterHub's default `server` role, plus calling MLflow, the jobs service (`gpupool jobs`) and the idle
    # culler (JupyterLab's warning before a stop, gpupool.hub.lab_idle): nothing else.
    assert set(SERVER_TOKEN_SCOPES) == {"users:activity!user", "access:servers!server",
                                        "access:services!service=mlflow", "access:services!service=jobs",
                                        "access:services!service=culler"}
    from gpupool.spawner.kube import GPUKubeSpawner
    from gpupool.spawner.local import LocalGPUSpawner

    assert LocalGPUSpawner().server_token_scopes == list(SERVER_TOKEN_SCOPES)
    # Both spawners take the variables and the scopes from the one mixin.
    for spawner_class in (LocalGPUSpawner, GPUKubeSpawner):
        assert "mlflow_url" in spawner_class.class_traits(config=True)
        assert spawner_class.get_env.__qualname__ != "GPUPoolSpawnerMixin.get_env"  # each adds its own …
        assert GPUPoolSpawnerMixin in spawner_class.__mro__  # … on top of the mixin's, which sets MLflow's


def test_the_team_root_is_one_setting_for_the_servers_and_the_datasets_tab(tmp_path):
    c = Config()
    apply_config(c, PlatformSettings(state_dir=tmp_path))
    (accounting,) = [s for s in c.JupyterHub.services if s["name"] == "accounting"]
    # Beside the 0700 state folder when servers may run as their own users (root), else inside it.
    default = tmp_path.parent / "teams" if os.geteuid() == 0 else tmp_path / "teams"
    assert c.LocalGPUSpawner.team_root == accounting["environment"]["GPUPOOL_TEAM_ROOT"] == str(default)
    c = Config()
    apply_config(c, PlatformSettings(state_dir=tmp_path, team_root="/srv/gpupool/teams"))
    (accounting,) = [s for s in c.JupyterHub.services if s["name"] == "accounting"]
    assert c.LocalGPUSpawner.team_root == accounting["environment"]["GPUPOOL_TEAM_ROOT"] == "/srv/gpupool/teams"


def test_without_mlflow_there_is_no_service_role_or_server_variables(tmp_path):
    c = Config()
    apply_config(c, PlatformSettings(state_dir=tmp_path, mlflow=False))
    assert [s["name"] for s in c.JupyterHub.services] == ["gpupool-queue", "accounting", "jobs", "culler"]
    assert "gpupool-mlflow" not in {r["name"] for r in c.JupyterHub.load_roles}
    assert c.LocalGPUSpawner.mlflow_url == ""
