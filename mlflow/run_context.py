"""MLflow run-context plugin: runs started inside a gpupool server are tagged with who ran them on what share.

Registered as the `mlflow.run_context_provider` entry point `gpupool`; MLflow calls it for every new run.
The values come from the `GPUPOOL_*` variables the spawners put into every user server. They are claims, not
facts: the MLflow service writes these tags itself from its records of the server or job the run comes from,
and refuses a run whose claims differ (`permissions.run_context`); `gpupool.job` is how a job's run names its job.
"""

from __future__ import annotations

import os

#: Environment variable → run tag.
RUN_TAGS = {
    "JUPYTERHUB_USER": "gpupool.user",
    "GPUPOOL_TEAM": "gpupool.team",
    "GPUPOOL_PROFILE": "gpupool.profile",
    "GPUPOOL_GPU_MODEL": "gpupool.gpu_model",
    "GPUPOOL_SHARE": "gpupool.share",
    "GPUPOOL_JOB_ID": "gpupool.job",  # set in a training job's runs: the run's cost is that job's
}


class GPUPoolRunContext:
    """The `GPUPOOL_*` tags, as an MLflow `RunContextProvider` (its interface: `in_context`, `tags`).

    Deliberately not a subclass, so that this module imports nothing of MLflow: when it is imported before
    MLflow, importing MLflow builds the run-context registry, which loads every `mlflow.run_context_provider`
    entry point while this module would still be importing MLflow, and MLflow would skip the provider with a
    "partially initialized module … circular import" warning. MLflow's registry only instantiates a provider
    and calls these two methods.
    """

    def in_context(self) -> bool:
        return "GPUPOOL_TEAM" in os.environ

    def tags(self) -> dict[str, str]:
        return {tag: os.environ[var] for var, tag in RUN_TAGS.items() if os.environ.get(var)}
