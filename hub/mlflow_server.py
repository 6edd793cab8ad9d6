"""`mlflow server` as one process: MLflow's own command prepares the stores and its server's settings, then
becomes its uvicorn server instead of starting it as a child and waiting for it.

With MLflow's job runner off (gpupool refuses its routes) the `mlflow server` process only forwards signals to
its uvicorn and waits: an idle interpreter holding everything the command imported (232 MiB PSS of the embedded
platform's 914 at rest, issue 33). Replacing it by uvicorn (exec) keeps every setting MLflow passes (its
environment and command line are built by MLflow itself) and leaves one process that hears the supervisor's
signals directly.

    python -m gpupool.hub.mlflow_server [mlflow server's options]
"""

from __future__ import annotations

import os
import sys


def _become(cmd, extra_env=None, **_options):
    """Stands in for the `_exec_cmd` MLflow's server starts uvicorn with: run `cmd` in this process."""
    env = {**os.environ, **(extra_env or {})}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], [str(part) for part in cmd], env)


def main(argv: list[str] | None = None) -> None:
    import mlflow.server
    from mlflow.cli import cli
    from mlflow.environment_variables import MLFLOW_SERVER_ENABLE_JOB_EXECUTION

    if MLFLOW_SERVER_ENABLE_JOB_EXECUTION.get():
        # The job runner is started beside the server after it and needs this process: run it as MLflow does.
        sys.exit("gpupool.hub.mlflow_server runs MLflow without its job runner: set "
                 "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false, or run `mlflow server`")
    if not hasattr(mlflow.server, "_exec_cmd"):
        sys.exit(f"MLflow {mlflow.__version__} starts its server otherwise: gpupool.hub.mlflow_server needs an update")
    mlflow.server._exec_cmd = _become
    cli.main(args=["server", *(sys.argv[1:] if argv is None else argv)], prog_name="mlflow")


if __name__ == "__main__":
    main()
