"""MLflow run-context plugin: runs started inside a gpupool server are tagged with who ran them on what share.

Registered as the `mlflow.run_context_provider` entry point `gpupool`; MLflow calls it for every new run.
The values come from the `GPUPOOL_*` variables the spawners put into every user server.
"""

from __future__ import annotations

import os

from mlflow.tracking.context.abstract_context import RunContextProvider

#: Environment variable → run tag.
RUN_TAGS = {
    "JUPYTERHUB_USER": "gpupool.user",
    "GPUPOOL_TEAM": "gpupool.team",
    "GPUPOOL_PROFILE": "gpupool.profile",
    "GPUPOOL_GPU_MODEL": "gpupool.gpu_model",
    "GPUPOOL_SHARE": "gpupool.share",
}


class GPUPoolRunContext(RunContextProvider):
    def in_context(self) -> bool:
        return "GPUPOOL_TEAM" in os.environ

    def tags(self) -> dict[str, str]:
        return {tag: os.environ[var] for var, tag in RUN_TAGS.items() if os.environ.get(var)}
