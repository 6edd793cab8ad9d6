"""One MLflow run per training job, across its restarts, and the trained model registered under the team.

    with resumable_run(checkpoint_dir, run_name="lora-sft") as run:   # the same run after a restart
        mlflow.log_metrics({"loss": loss}, step=step)
    version = register_folder(run.info.run_id, adapter_dir, "adapter", "vision-sft")

A job that restarts (a crash, a preemption) goes on in the run it began: the run's id is kept beside the
checkpoints, so its metrics form one history, and its time window (and so its GPU-hours and cost, which the
platform's MLflow tags on the run when it ends) covers every attempt. A registered model's name starts with
its team (`vision-…`); the platform copies the run's cost tags onto the version.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

RUN_FILE = "mlflow-run.json"
#: MLflow's most metrics in one log-batch request.
BATCH_LIMIT = 1000


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


@contextlib.contextmanager
def resumable_run(folder: str | os.PathLike, **start_kwargs):
    """`mlflow.start_run` that a restarted job resumes: the run whose id `folder` keeps, else a new one (its
    id then kept). Ends the run FINISHED on success; on an exception or a stop signal leaves it FAILED or
    KILLED, as MLflow does, and a later attempt sets it running again."""
    import mlflow

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kept = folder / RUN_FILE
    run_id = json.loads(kept.read_text())["run_id"] if kept.is_file() else None
    if run_id is not None:
        run = mlflow.start_run(run_id=run_id)
    else:
        run = mlflow.start_run(**start_kwargs)
        _write_atomically(kept, json.dumps({"run_id": run.info.run_id}))
    with run:
        yield run


class MetricsBuffer:
    """Metrics of every step, sent to MLflow in batches: at each checkpoint (`flush()` before the commit, so a
    resumed run's history has every step up to its checkpoint), every `every_seconds`, and at the end. A step
    never waits for the tracking server in between; one request carries many steps.

        metrics = MetricsBuffer()
        metrics.add({"loss": loss}, step)
        if step % every == 0:
            metrics.flush()
            save_checkpoint(step)
    """

    def __init__(self, every_seconds: float = 30.0, run_id: str | None = None):
        self.every_seconds, self.run_id = every_seconds, run_id
        self.pending: list = []
        self.sent_at = time.monotonic()

    def add(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        at = int(time.time() * 1000)
        self.pending += [Metric(key, float(value), at, step) for key, value in metrics.items()]
        if time.monotonic() - self.sent_at >= self.every_seconds:
            self.flush()

    def flush(self) -> None:
        import mlflow
        from mlflow import MlflowClient

        self.sent_at = time.monotonic()
        if not self.pending:
            return
        run_id = self.run_id or mlflow.active_run().info.run_id
        client = MlflowClient()
        for start in range(0, len(self.pending), BATCH_LIMIT):
            client.log_batch(run_id, metrics=self.pending[start:start + BATCH_LIMIT])
        self.pending = []


def register_folder(run_id: str, folder: str | os.PathLike, artifact_path: str, model_name: str,
                    description: str | None = None):
    """Log `folder` as the run's artifacts at `artifact_path` and register it as a new version of
    `model_name` (created if need be); the `ModelVersion`. Call after the run ended, so the version gets
    the run's cost tags."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient()
    client.log_artifacts(run_id, str(folder), artifact_path)
    try:
        client.create_registered_model(model_name)
    except mlflow.exceptions.MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":  # already there: a new version of it
            raise
    return client.create_model_version(model_name, f"runs:/{run_id}/{artifact_path}", run_id=run_id,
                                       description=description)


def team_model_name(name: str, team: str | None = None) -> str:
    """A registered model's name in the team (`vision` + `sft` → `vision-sft`), the team from the job's or
    server's `GPUPOOL_TEAM` by default."""
    team = team or os.environ.get("GPUPOOL_TEAM")
    if not team:
        raise ValueError("no team: set GPUPOOL_TEAM (gpupool's servers and jobs have it) or pass team")
    return name if name.startswith(f"{team}-") else f"{team}-{name}"
