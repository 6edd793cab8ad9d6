"""Which job backend `gpupool-hub` runs the training jobs on: named by the hub's spawner class
(`gpupool.hub.app.job_backend_of`), never by testing classes one after another."""

from __future__ import annotations

from jupyterhub.spawner import LocalProcessSpawner

from gpupool.hub.app import JOB_BACKENDS, job_backend_of
from gpupool.spawner.kube import GPUKubeSpawner
from gpupool.spawner.local import LocalGPUSpawner


class SiteSpawner(LocalGPUSpawner):
    """A site's own spawner, derived from the embedded one."""


class DeclaringSpawner(GPUKubeSpawner):
    job_backend = "yunikorn"


def test_each_gpupool_spawner_names_its_backend_and_a_derived_class_inherits_it():
    assert job_backend_of(LocalGPUSpawner) == "local"
    assert job_backend_of(GPUKubeSpawner) == "volcano"
    assert job_backend_of(SiteSpawner) == "local"


def test_a_spawner_class_may_declare_its_own_backend():
    assert job_backend_of(DeclaringSpawner) == "yunikorn"


def test_a_spawner_of_no_gpupool_engine_runs_no_jobs():
    assert job_backend_of(LocalProcessSpawner) is None
    assert job_backend_of("jupyterhub.spawner.LocalProcessSpawner") is None  # not a class (yet): nothing


def test_the_mapping_names_the_classes_where_they_are_defined():
    assert {f"{c.__module__}.{c.__qualname__}" for c in (LocalGPUSpawner, GPUKubeSpawner)} == set(JOB_BACKENDS)
