"""JupyterHub configuration of the embedded mode; `gpupool up` runs `jupyterhub -f` on this file.

Settings come from GPUPOOL_* variables (see `gpupool up --help`). Files in `<state>/jupyterhub_config.d/*.py`
are run afterwards with the same `c`, for anything gpupool does not set.
"""

from gpupool.hub.config import Settings, apply_config

c = get_config()  # noqa: F821 - provided by JupyterHub
settings = Settings.from_env()
apply_config(c, settings)

for extra in sorted((settings.state_dir / "jupyterhub_config.d").glob("*.py")):
    exec(compile(extra.read_text(), str(extra), "exec"), {"c": c, "get_config": lambda: c})
